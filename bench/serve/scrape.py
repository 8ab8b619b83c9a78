"""What a `/metrics` scrape of xpod serve says: the Prometheus text parsed, samples summed
over labels, and a run's server figures (deltas between two scrapes, KV balance over many)."""

from __future__ import annotations

import numpy as np

SOURCES = ("local", "pool", "computed")  # xpod_prompt_tokens_by_source_total's sources


def parse_prometheus(text: str) -> dict[str, list[tuple[dict, float]]]:
    """Prometheus text -> {sample name: [(labels, value)]} (prometheus-client's parser)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, list[tuple[dict, float]]] = {}
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            out.setdefault(smp.name, []).append((dict(smp.labels), float(smp.value)))
    return out


def total(snap: dict | None, name: str, **labels: str) -> float:
    """Sum of `name`'s samples whose labels match."""
    if not snap:
        return 0.0
    rows = snap.get(name, ())
    return sum(v for lab, v in rows if all(lab.get(k) == x for k, x in labels.items()))


def increase(s0: dict | None, s1: dict | None, name: str, **labels: str) -> float:
    """How much counter `name` (its samples whose labels match, summed) rose from s0 to s1; a
    sample that went down was reset (the server restarted a process) and counts from 0, as
    Prometheus's increase() does."""
    if not s1:
        return 0.0
    before = {tuple(sorted(lab.items())): v for lab, v in (s0 or {}).get(name, ())}
    out = 0.0
    for lab, v in s1.get(name, ()):
        if all(lab.get(k) == x for k, x in labels.items()):
            v0 = before.get(tuple(sorted(lab.items())), 0.0)
            out += v - v0 if v >= v0 else v
    return out


def by_label(snap: dict | None, name: str, label: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for lab, v in (snap or {}).get(name, ()):
        out[lab.get(label, "")] = out.get(lab.get(label, ""), 0.0) + v
    return out


def kv_balance(snaps: list[dict]) -> float:
    """Mean over scrapes of max/mean KV usage over groups (scrapes whose mean is > 0)."""
    ratios = []
    for s in snaps:
        use = list(by_label(s, "xpod_kv_cache_usage_perc", "group").values())
        if use and sum(use) > 0:
            ratios.append(max(use) * len(use) / sum(use))
    return float(np.mean(ratios)) if ratios else 0.0


def cache_figures(d) -> dict:
    """Prompt tokens by source over the run (`xpod_prompt_tokens_by_source_total`: the die's
    prefix cache, the KV pool, computed) and, with `--kv-pool`, the pool's loads; `d(name,
    **labels)` is a counter's delta. Empty from a server that exports neither."""
    src = {k: d("xpod_prompt_tokens_by_source_total", source=k) for k in SOURCES}
    n = sum(src.values())
    if not n:
        return {}
    out = {f"{k}_prompt_tokens": int(v) for k, v in src.items()}
    out.update(hit_rate=(src["local"] + src["pool"]) / n, local_hit_rate=src["local"] / n,
               pool_hit_rate=src["pool"] / n)  # fmt: skip
    loads, secs = d("xpod_pool_loads_total"), d("xpod_pool_load_seconds_total")
    if loads or d("xpod_pool_lookups_total"):
        nbytes = d("xpod_pool_load_bytes_total")
        out.update(pool_loads=int(loads), pool_fallbacks=int(d("xpod_pool_load_fallbacks_total")),
                   pool_crc_mismatches=int(d("xpod_pool_crc_mismatches_total")),
                   pool_load_gbps=nbytes / secs / 1e9 if secs else 0.0,
                   pool_load_ms_mean=secs * 1e3 / loads if loads else 0.0,
                   pool_stored_blocks=int(d("xpod_pool_stored_blocks_total")),
                   pool_evictions=int(d("xpod_pool_evictions_total")))  # fmt: skip
    return out


CPU_ROLES = (("shell", "shell"), ("master", "masters"), ("output", "outputs"), ("die", "dies"))


def server_figures(s0: dict | None, s1: dict | None, snaps: list[dict], n_out: int) -> dict:
    """The /metrics figures of a run: deltas from s0 to s1 (and KV balance over `snaps`)."""
    if not s0 or not s1:
        return {}

    def d(name: str, **labels: str) -> float:
        return total(s1, name, **labels) - total(s0, name, **labels)

    def ratio(a: float, b: float) -> float:
        return a / b if b else 0.0

    steps, fwd = d("xpod_steps_total"), d("xpod_forward_seconds_total")
    dummy = d("xpod_dummy_steps_total")
    out = {
        "kv_balance": kv_balance(snaps),
        # a die's steps: with rows (xpod_steps_total) or without (xpod_dummy_steps_total)
        "dummy_step_share": ratio(dummy, dummy + steps),
        "bubble_ms_per_step": ratio(d("xpod_scheduling_bubble_seconds_total") * 1e3, steps),
        "moe_wait_share": ratio(d("xpod_moe_wait_seconds_total"), fwd),
        "attention_imbalance_mean": ratio(
            d("xpod_attention_imbalance_sum"), d("xpod_attention_imbalance_count")
        ),
        "prefix_hit_rate": ratio(
            d("xpod_prefix_cache_hits_total"), d("xpod_prefix_cache_queries_total")
        ),
        "step_ms_mean": ratio(d("xpod_step_seconds_sum") * 1e3, d("xpod_step_seconds_count")),
        "steps": int(steps),
        "preemptions": int(d("xpod_num_preemptions_total")),
    }
    drafts, dtok = (
        d("xpod_spec_decode_num_drafts_total"),
        d("xpod_spec_decode_num_draft_tokens_total"),
    )
    if drafts:  # MTP (--server-args "--num-speculative-tokens K"): vLLM's derived figures
        acc = d("xpod_spec_decode_num_accepted_tokens_total")
        per = by_label(s1, "xpod_spec_decode_num_accepted_tokens_per_pos_total", "position")
        per0 = by_label(s0, "xpod_spec_decode_num_accepted_tokens_per_pos_total", "position")
        out.update(
            num_drafts=int(drafts), num_draft_tokens=int(dtok), num_accepted_tokens=int(acc),
            acceptance_rate=ratio(acc, dtok), mean_acceptance_length=1 + ratio(acc, drafts),
            acceptance_per_pos=[ratio(per[j] - per0.get(j, 0.0), drafts)
                                for j in sorted(per, key=int)],
            mtp_ms_per_step=ratio(d("xpod_mtp_seconds_total") * 1e3, steps),
        )  # fmt: skip
    out.update(cache_figures(d))
    cpu = 0.0
    for role, key in CPU_ROLES:
        v = d("xpod_process_cpu_seconds_total", role=role)
        cpu += v
        out[f"cpu_s_{key}"] = v
        out[f"cpu_ms_per_token_{key}"] = ratio(v * 1e3, n_out)
    out["cpu_s_server"] = cpu
    out["cpu_ms_per_token_server"] = ratio(cpu * 1e3, n_out)
    return out
