"""`/metrics` of the prompt tokens by source and of the KV pool (`--kv-pool`, docs/serving.md
"KV pool").

- `xpod_prompt_tokens_by_source_total{group, source="local"|"pool"|"computed"}`: every
  engine, pool or not: a request's prompt counted once, at its admission, by where its tokens
  came from (runtime.engine.cache_stats: local = the die's prefix cache, pool = loaded from the
  pool, computed = prefilled). `local` is kept at its high-water mark per group: a load lands
  just before its request's admission, and in between local would read low.
- per group, from the masters' pool side (runtime.engine.pool_master): `xpod_pool_queries`
  (prompt tokens looked up past the die-local hit), `xpod_pool_hits` (tokens loaded and used),
  `xpod_pool_loads`, `xpod_pool_load_fallbacks` (timed out or lost their server: recomputed),
  `xpod_pool_crc_mismatches`, `xpod_pool_load_kv_full` (no room to load into),
  `xpod_pool_load_bytes`, `xpod_pool_load_seconds`, `xpod_pool_offered_blocks` (new prompt
  blocks offered for storing), over hosts `xpod_pool_remote_hits` (tokens of loads that
  fetched from another host's server), `xpod_pool_fetch_bytes`, `xpod_pool_fetch_failures`,
  on a PD decode die `xpod_pool_decode_hits` and `xpod_pool_decode_load_bytes`;
  gauges `xpod_pool_requests_waiting` (for a load),
  `xpod_pool_quarantined` (fallen-back loads whose blocks a server may still write),
  `xpod_pool_store_holds`.
- pod-wide, from the pool's shell (runtime.engine.pool_shell): `xpod_pool_lookups`,
  `xpod_pool_hints` (lookups whose hit went to a master), `xpod_pool_hint_blocks`,
  `xpod_pool_stores`, `xpod_pool_stored_blocks`, `xpod_pool_store_failures`,
  `xpod_pool_evictions`, `xpod_pool_demotions`, `xpod_pool_promotions`,
  `xpod_pool_server_deaths`, `xpod_pool_server_restarts`, `xpod_pool_quota_refused_blocks`
  (blocks of a namespace at its quota, not stored), over hosts `xpod_pool_remote_hint_blocks`
  and `xpod_pool_remote_cut_blocks`; gauges `xpod_pool_index_entries`,
  `xpod_pool_blocks{tier="dram"|"ssd"}` (in use), `xpod_pool_capacity_blocks{tier}`,
  `xpod_pool_block_bytes`, `xpod_pool_orphans`, `xpod_pool_server_up`.
"""

from __future__ import annotations

import contextlib

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from runtime.engine.cache_stats import SOURCES, prompt_sources

MASTER_COUNTERS = {
    "xpod_pool_queries": ("Prompt tokens looked up in the KV pool past the die-local hit.",
                          "pool_query_tokens", 1),
    "xpod_pool_hits": ("Prompt tokens loaded from the KV pool and used.", "pool_hit_tokens", 1),
    "xpod_pool_loads": ("KV pool loads ordered.", "pool_loads", 1),
    "xpod_pool_load_fallbacks": ("KV pool loads that timed out or lost their server (the"
                                 " prefix recomputed).", "pool_load_fallbacks", 1),
    "xpod_pool_crc_mismatches": ("Loaded blocks whose crc differed from the stored one.",
                                 "pool_crc_mismatches", 1),
    "xpod_pool_load_kv_full": ("Pool hits not loaded: no free KV blocks to load into.",
                               "pool_kv_full", 1),
    "xpod_pool_load_bytes": ("Bytes loaded from the KV pool.", "pool_load_bytes", 1),
    "xpod_pool_load_seconds": ("Time from a load's order to its landing.", "pool_load_ns",
                               1e-9),
    "xpod_pool_offered_blocks": ("New prompt blocks offered to the KV pool for storing.",
                                 "pool_put_blocks", 1),
    "xpod_pool_remote_hits": ("Prompt tokens of loads that fetched from another host's pool"
                              " server (--hosts).", "pool_remote_hit_tokens", 1),
    "xpod_pool_fetch_bytes": ("Bytes fetched over TCP from other hosts' pool servers.",
                              "pool_fetch_bytes", 1),
    "xpod_pool_fetch_failures": ("Fetches from another host's pool server refused or"
                                 " malformed (the prefix recomputed).", "pool_fetch_failed", 1),
    "xpod_pool_decode_hits": ("A PD decode die's prompt tokens copied from the KV pool by its"
                              " master (the KV link carries the rest).", "pool_decode_tokens", 1),
    "xpod_pool_decode_load_bytes": ("Bytes a PD decode die's master copied from the KV pool.",
                                    "pool_decode_bytes", 1),
}  # fmt: skip
MASTER_GAUGES = {
    "xpod_pool_requests_waiting": ("Requests waiting for a KV pool load.", "pool_waiting"),
    "xpod_pool_quarantined": ("Fallen-back loads whose blocks a pool server may still write.",
                              "pool_quarantined"),
    "xpod_pool_store_holds": ("Blocks sets held until the pool has stored them.",
                              "pool_holds"),
}  # fmt: skip
SHELL_COUNTERS = {
    "xpod_pool_lookups": ("Prompts looked up in the KV pool index.", "pool_lookups"),
    "xpod_pool_hints": ("Lookups whose hit went to a master.", "pool_hints"),
    "xpod_pool_hint_blocks": ("Blocks of the hits sent to masters.", "pool_hint_blocks"),
    "xpod_pool_stores": ("Store orders sent to the pool server.", "pool_stores"),
    "xpod_pool_stored_blocks": ("Blocks the pool stored.", "pool_stored_blocks"),
    "xpod_pool_store_failures": ("Store orders that failed.", "pool_store_failed"),
    "xpod_pool_evictions": ("Blocks evicted from the DRAM tier.", "index_evictions"),
    "xpod_pool_demotions": ("Blocks demoted from DRAM to the SSD tier.", "index_demotions"),
    "xpod_pool_promotions": ("Blocks promoted from the SSD tier to DRAM.", "index_promotions"),
    "xpod_pool_server_deaths": ("Pool server exits seen.", "pool_server_deaths"),
    "xpod_pool_server_restarts": ("Pool server restarts.", "pool_server_restarts"),
    "xpod_pool_quota_refused_blocks": ("Blocks not stored: their namespace (cache salt) was"
                                       " at its --pool-quota.", "pool_quota_refused_blocks"),
    "xpod_pool_remote_hint_blocks": ("Blocks of the hits held by another host's server than"
                                     " the die's (--hosts: fetched).", "pool_remote_hint_blocks"),
    "xpod_pool_remote_cut_blocks": ("Hits cut at a block another host's server would first"
                                    " promote from its SSD tier.", "pool_remote_cut_blocks"),
}  # fmt: skip


class CacheMetrics:
    """The families of the module docstring; `collect(by)` with the groups' stats."""

    def __init__(self, engine):
        self.engine = engine
        self.local: dict[int, tuple[int, int]] = {}  # group -> (query tokens, local high-water)

    def collect(self, by: dict):
        m = CounterMetricFamily("xpod_prompt_tokens_by_source", "Prompt tokens of admitted"
                                " requests by source: the die's prefix cache (local), the KV pool"
                                " (pool) or prefilled (computed).",
                                labels=["group", "source"])  # fmt: skip
        for g, s in by.items():
            src = prompt_sources(s)
            query = int((s or {}).get("prefix_query_tokens", 0))
            q0, hw = self.local.get(g, (0, 0))
            hw = src["local"] if query < q0 else max(hw, src["local"])  # a new master: from 0
            self.local[g] = (query, hw)
            src["local"] = hw
            for k in SOURCES:
                m.add_metric([str(g), k], src[k])
        yield m
        pool = getattr(self.engine, "pool", None)
        if pool is None:
            return
        yield from self._masters(by)
        yield from self._shell(pool)

    def _masters(self, by: dict):
        for name, (doc, key, scale) in MASTER_COUNTERS.items():
            m = CounterMetricFamily(name, doc, labels=["group"])
            for g, s in by.items():
                m.add_metric([str(g)], (s or {}).get(key, 0) * scale)
            yield m
        for name, (doc, key) in MASTER_GAUGES.items():
            m = GaugeMetricFamily(name, doc, labels=["group"])
            for g, s in by.items():
                m.add_metric([str(g)], (s or {}).get(key, 0))
            yield m

    def _shell(self, pool):
        lock = getattr(self.engine, "lock", None)  # the shell's pool runs under the tracker's
        with lock if lock is not None else contextlib.nullcontext():
            st = pool.stats()
        for name, (doc, key) in SHELL_COUNTERS.items():
            yield CounterMetricFamily(name, doc, value=st.get(key, 0))
        used = GaugeMetricFamily("xpod_pool_blocks", "KV pool blocks in use, by tier.",
                                 labels=["tier"])  # fmt: skip
        cap = GaugeMetricFamily("xpod_pool_capacity_blocks", "KV pool capacity in blocks, by"
                                " tier.", labels=["tier"])  # fmt: skip
        used.add_metric(["dram"], sum((st.get("index_dram_used") or {}).values()))
        used.add_metric(["ssd"], sum((st.get("index_ssd_used") or {}).values()))
        cap.add_metric(["dram"], st.get("n_slots", 0))
        cap.add_metric(["ssd"], st.get("ssd_blocks", 0))
        yield used
        yield cap
        for name, doc, v in (
            ("xpod_pool_index_entries", "Blocks the KV pool index holds.",
             st.get("index_entries", 0)),
            ("xpod_pool_block_bytes", "Bytes of one KV pool block (all layers).",
             st.get("slot_bytes", 0)),
            ("xpod_pool_orphans", "Index entries whose parent is gone (0).",
             st.get("index_orphans", 0)),
            ("xpod_pool_server_up", "1 while the pool is on (its server not out of restarts).",
             1.0 if st.get("up") else 0.0),
        ):  # fmt: skip
            yield GaugeMetricFamily(name, doc, value=v)


__all__ = ["CacheMetrics"]
