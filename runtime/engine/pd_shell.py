"""The shell's side of prefill-decode disaggregation: the job executor of xDeepServe (001 §5.1)
and the picks of DISAGG.md §2 (`runtime.engine.pd` has the picture).

- Prefill die: the least queue length x prompt length, counting the request to place
  ((queued + 1) x (queued tokens + its tokens)): a long prompt goes where little is queued.
  The prefix cache's locality is the tie-break: a die that prefilled the same first block lately
  wins a tie, so its cached blocks are hit. Dies behind a dead link are skipped.
- Decode die: the least KV counting every reservation (`sched.LoadBalancer` over the decode
  dies): prompt + max_tokens of each request placed there and not finished.
- Both masters get the request at once (SGLang's way): the decode master allocates while the
  prefill master computes.
"""

from __future__ import annotations

from collections import OrderedDict

from runtime.engine.config import EngineConfig
from sched.lb import LoadBalancer

LOCALITY = 256  # recent first blocks remembered per prefill die


class PDRouter:
    def __init__(self, cfg: EngineConfig):
        topo = cfg.pd
        self.prefill, self.decode = list(topo.prefill), list(topo.decode)
        self.policy = cfg.kv_policy
        self.block_size = cfg.block_size
        limit = cfg.max_num_seqs + cfg.queue_ahead
        self.lb = LoadBalancer(len(self.decode), limit, cfg.decode_blocks or cfg.blocks,
                               cfg.block_size, cfg.lb_policy)  # fmt: skip
        self.queued: dict[int, dict[int, int]] = {p: {} for p in self.prefill}  # die -> id -> n
        self.recent: dict[int, OrderedDict] = {p: OrderedDict() for p in self.prefill}
        self.where: dict[int, int] = {}  # request -> its prefill die, until prefilled
        self.dead: dict[int, set[int]] = {}  # prefill die -> decode dies that see it dead
        self.counters = {"pd_dispatched": 0, "pd_recomputed": 0, "pd_failed": 0}
        # With the KV pool the hit is pod-wide, the same for every prefill die: the choice is
        # load alone (000 §4.1's stateless scheduler), no "same first block lately" tie-break
        self.locality = cfg.kv_pool is None

    def pick(self, tokens: list[int], max_tokens: int, ns: str | None = None,
             ) -> tuple[int, int] | None:  # fmt: skip
        """(prefill die, decode die) for a request, or None if every decode die is full. `ns`:
        its cache salt (a first block of another ns is no hit: not the same key)."""
        g = self.lb.pick(len(tokens), max_tokens)
        if g is None:
            return None
        alive = [p for p in self.prefill if not self.dead.get(p)] or self.prefill
        key = self._key(tokens, ns)

        def score(p: int) -> tuple:
            q = self.queued[p]
            near = key not in self.recent[p] if self.locality else False
            return ((len(q) + 1) * (sum(q.values()) + len(tokens)), near)

        return min(alive, key=score), self.decode[g]

    def _key(self, tokens: list[int], ns: str | None) -> tuple | None:
        """The locality key of a prompt: its ns and first block (None: no full block)."""
        return (ns, *tokens[: self.block_size]) if len(tokens) > self.block_size else None

    def on_dispatch(self, rid: int, p: int, d: int, tokens: list[int], max_tokens: int,
                    ns: str | None = None) -> None:  # fmt: skip
        self.lb.on_dispatch(self.decode.index(d), rid, len(tokens), max_tokens)
        self.queued[p][rid] = len(tokens)
        self.where[rid] = p
        key = self._key(tokens, ns)
        if key is not None:
            rec = self.recent[p]
            rec[key] = None
            rec.move_to_end(key)
            while len(rec) > LOCALITY:
                rec.popitem(last=False)
        self.counters["pd_dispatched"] += 1

    def on_prefilled(self, rid: int) -> None:
        p = self.where.pop(rid, None)
        if p is not None:
            self.queued[p].pop(rid, None)

    def on_finish(self, rid: int) -> None:
        self.on_prefilled(rid)
        self.lb.on_finish(rid)

    def on_stats(self, body: dict) -> None:
        """A decode master's link states: prefill dies it sees dead are skipped."""
        d = body.get("group")
        for link, v in (body.get("pd_links") or {}).items():
            p = int(link.split("->")[0])
            if p in self.dead or v["state"] == "dead":
                seen = self.dead.setdefault(p, set())
                (seen.add if v["state"] == "dead" else seen.discard)(d)

    def queue_tokens(self) -> dict[int, int]:
        return {p: sum(q.values()) for p, q in self.queued.items()}


def pd_summary(cfg: EngineConfig, stats: dict, router: PDRouter | None) -> dict | None:
    """A PD engine's transfers from its masters' latest stats (None when not PD): per link and
    in all, bytes, copy seconds, GB/s, results, checksum mismatches, leases, probes."""
    topo = cfg.pd
    if topo is None:
        return None
    dec = [stats.get(g) or {} for g in topo.decode]
    pre = [stats.get(g) or {} for g in topo.prefill]
    links = {k: dict(v) for s in dec for k, v in (s.get("pd_links") or {}).items()}
    nbytes = sum(v["bytes"] for v in links.values())
    ns = sum(v["ns"] for v in links.values())
    n = sum(v["transfers"] for v in links.values())
    for v in links.values():
        v["gbps"] = v["bytes"] / v["ns"] if v["ns"] else 0.0
    out = {"prefill_dies": list(topo.prefill), "decode_dies": list(topo.decode),
           "transfers": n, "bytes": nbytes, "copy_s": ns / 1e9,
           "gbps": nbytes / ns if ns else 0.0, "mean_bytes": nbytes / n if n else 0.0,
           "links": links}  # fmt: skip
    for key in ("pd_success", "pd_failed", "pd_checksum_mismatches", "pd_quarantined_blocks",
                "pd_probes"):  # fmt: skip
        out[key[3:]] = sum(s.get(key, 0) for s in dec)
    for key in ("pd_leases_freed", "pd_leases_expired", "pd_leased", "pd_failed_orders"):
        out[key[3:]] = sum(s.get(key, 0) for s in pre)
    if router is not None:
        out.update({k[3:]: v for k, v in router.counters.items()})
    return out


def pd_blocks(cfg: EngineConfig, g: int) -> int:
    """KV blocks of group `g` (a PD pod's decode dies may have `decode_blocks`)."""
    topo = cfg.pd
    if topo is not None and g in topo.decode and cfg.decode_blocks:
        return cfg.decode_blocks
    return cfg.blocks


def pd_master_spec(cfg: EngineConfig, g: int) -> dict | None:
    """`MasterSpec.pd` of group `g` (None outside a PD pod)."""
    topo = cfg.pd
    if topo is None:
        return None
    m = cfg.model_config()
    return {"role": topo.role(g), "prefill": list(topo.prefill), "decode": list(topo.decode),
            "n_layers": m.kv_layers, "row_floats": m.kv_cache_dim, "lease_s": cfg.kv_lease_s,
            "timeout_s": cfg.kv_timeout_s, "checksum": cfg.kv_checksum}  # fmt: skip


__all__ = ["PDRouter", "pd_blocks", "pd_master_spec", "pd_summary"]
