"""Where an engine's prompt tokens came from (the die-local prefix cache, the KV pool, or
computed) and the KV pool's figures of a run, from the masters' counters and the pool's shell
(`Engine.stats`, `PoolShell.stats()`): the sums `/metrics` exports, for `xpod generate`.

A master counts at a request's admission (`sched.Scheduler._admit`, once per request, not for a
preemption's recompute): `prefix_query_tokens` (its prompt) and `prefix_hit_tokens` (the prefix
found in the die's cache, which includes the blocks the pool just loaded there); its pool side
counts `pool_hit_tokens` (blocks landed and registered, runtime.engine.pool_master). So:
pool = pool_hit_tokens, local = prefix_hit_tokens - pool_hit_tokens, computed =
prefix_query_tokens - prefix_hit_tokens. A load lands just before its request's admission: in
between, local would read low (`prompt_sources` clamps it at 0; /metrics keeps its high-water
mark so the counter never goes down).
"""

from __future__ import annotations

SOURCES = ("local", "pool", "computed")


def prompt_sources(stats: dict | None) -> dict[str, int]:
    """{local, pool, computed} prompt tokens of one master's stats (module docstring)."""
    s = stats or {}
    hit, query = int(s.get("prefix_hit_tokens", 0)), int(s.get("prefix_query_tokens", 0))
    pool = int(s.get("pool_hit_tokens", 0))
    return {"local": max(0, hit - pool), "pool": pool, "computed": max(0, query - hit)}


def cache_summary(stats: dict, pool: dict | None) -> dict:
    """Prompt tokens by source and their shares over the groups' latest stats; with a pool
    (`pool`: its shell's stats) also its loads, stores and tiers."""
    tot = dict.fromkeys(SOURCES, 0)
    for s in stats.values():
        for k, v in prompt_sources(s).items():
            tot[k] += v
    n = sum(tot.values())
    out: dict = {f"{k}_tokens": v for k, v in tot.items()}
    out.update({f"{k}_rate": round(v / n, 4) if n else 0.0 for k, v in tot.items()})
    out["hit_rate"] = round((tot["local"] + tot["pool"]) / n, 4) if n else 0.0
    if pool is None:
        return out
    m = {k: sum(int((s or {}).get(k, 0)) for s in stats.values()) for k in
         ("pool_loads", "pool_load_fallbacks", "pool_crc_mismatches", "pool_load_bytes",
          "pool_load_ns", "pool_put_blocks", "pool_kv_full", "pool_remote_loads",
          "pool_remote_hit_tokens", "pool_fetch_bytes")}  # fmt: skip
    secs = m["pool_load_ns"] / 1e9
    out.update(
        loads=m["pool_loads"], load_fallbacks=m["pool_load_fallbacks"],
        crc_mismatches=m["pool_crc_mismatches"], load_bytes=m["pool_load_bytes"],
        load_ms_mean=round(secs * 1e3 / m["pool_loads"], 3) if m["pool_loads"] else None,
        load_gbps=round(m["pool_load_bytes"] / secs / 1e9, 3) if secs else None,
        offered_blocks=m["pool_put_blocks"], kv_full=m["pool_kv_full"],
        stored_blocks=pool.get("pool_stored_blocks", 0),
        store_failures=pool.get("pool_store_failed", 0),
        entries=pool.get("index_entries", 0),
        dram_used_blocks=sum((pool.get("index_dram_used") or {}).values()),
        dram_blocks=pool.get("n_slots", 0),
        ssd_used_blocks=sum((pool.get("index_ssd_used") or {}).values()),
        ssd_blocks=pool.get("ssd_blocks", 0),
        evictions=pool.get("index_evictions", 0), demotions=pool.get("index_demotions", 0),
        server_deaths=pool.get("pool_server_deaths", 0),
        server_restarts=pool.get("pool_server_restarts", 0), up=bool(pool.get("up", False)),
        servers=pool.get("servers", 1), remote_loads=m["pool_remote_loads"],
        remote_hit_tokens=m["pool_remote_hit_tokens"], fetch_bytes=m["pool_fetch_bytes"],
    )  # fmt: skip
    return out


def cache_lines(c: dict) -> list[str]:
    """The summary as printed by `xpod generate`: prompt tokens by source, then the pool's."""
    n = c["local_tokens"] + c["pool_tokens"] + c["computed_tokens"]
    lines = [f"prompt tokens by source: local {c['local_tokens']} ({c['local_rate']:.1%}), pool"
             f" {c['pool_tokens']} ({c['pool_rate']:.1%}), computed {c['computed_tokens']}"
             f" ({c['computed_rate']:.1%}) of {n} admitted"]  # fmt: skip
    if "loads" in c:
        ms = "-" if c["load_ms_mean"] is None else f"{c['load_ms_mean']:.2f}"
        gbps = "" if c["load_gbps"] is None else f", {c['load_gbps']:.2f} GB/s"
        lines.append(f"kv pool loads: {c['loads']} ({c['load_fallbacks']} fell back,"
                     f" {c['crc_mismatches']} crc mismatches, {c['kv_full']} without room),"
                     f" {c['load_bytes'] / 1e6:.2f} MB, {ms} ms per load{gbps}")  # fmt: skip
        lines.append(f"kv pool stores: {c['offered_blocks']} blocks offered, {c['stored_blocks']}"
                     f" stored ({c['store_failures']} failed); DRAM {c['dram_used_blocks']}/"
                     f"{c['dram_blocks']} blocks, SSD {c['ssd_used_blocks']}/{c['ssd_blocks']};"
                     f" {c['evictions']} evictions, {c['demotions']} demotions; server restarts"
                     f" {c['server_restarts']}{'' if c['up'] else ' (pool down)'}")  # fmt: skip
        if c.get("servers", 1) > 1:
            lines.append(f"kv pool over {c['servers']} hosts (one server each):"
                         f" {c['remote_loads']} loads fetched from another host's server,"
                         f" {c['remote_hit_tokens']} tokens, {c['fetch_bytes'] / 1e6:.2f} MB"
                         " over TCP")  # fmt: skip
    return lines


__all__ = ["SOURCES", "cache_lines", "cache_summary", "prompt_sources"]
