"""`/metrics` of a PD pod (prefill-decode disaggregation, `runtime.engine.pd`).

- `xpod_pd_ttft_phase_seconds{phase}`: a PD request's time to first token in five parts:
  queue (arrival in the shell to its prefill die's first plan), prefill (to its first token
  on the prefill die), kv_wait (to its KV order: the decode die's scatter list was not in yet,
  i.e. the decode side had no room: backpressure), transfer (to its KV checked in the decode
  die) and first_step (to its first token in the shell: the decode die's first step, which
  sends it with the next one).
- `xpod_pd_requests{state}`: requests per connector state in the decode masters
  (Bootstrapping, WaitingForInput, Transferring), `xpod_pd_deferred` (requests made to wait for
  room, each once: backpressure) and `xpod_pd_transfers{result}` (success,
  failed) since start; `xpod_pd_recomputed` / `xpod_pd_failed` by the shell's policy.
- per link (`prefill->decode`): `xpod_kv_transfer_bytes`, `xpod_kv_transfer_seconds` (the copy
  on the prefill die's KV thread), `xpod_kv_transfers`, `xpod_kv_link_state{state}` (1 for the
  link's state: ok, slow, dead: the probe's verdict).
- `xpod_kv_checksum_mismatches`, `xpod_kv_quarantined_blocks`, `xpod_kv_link_probes`; the
  prefill dies' leases: `xpod_kv_leases_held`, `xpod_kv_leases_freed`, `xpod_kv_leases_expired`;
  `xpod_pd_prefill_queue_tokens{group}` (prompt tokens placed on a prefill die, not prefilled).
"""

from __future__ import annotations

from prometheus_client import Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

PHASES = ("queue", "prefill", "kv_wait", "transfer", "first_step")
PHASE_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28,
                 2.56, 5.0, 10.0, 30.0)  # fmt: skip
LINK_STATES = ("ok", "slow", "dead")


def ttft_phases(t) -> dict[str, float] | None:
    """The four parts of a finished PD request's TTFT (seconds), or None if it has not all."""
    pd = t.pd
    if not all(pd.get(k) for k in ("sched", "prefilled", "ordered", "landed")) or not t.t_first:
        return None
    ordered = max(pd["ordered"], pd["prefilled"])
    return {"queue": max(0.0, pd["sched"] - t.t0),
            "prefill": max(0.0, pd["prefilled"] - pd["sched"]),
            "kv_wait": ordered - pd["prefilled"],
            "transfer": max(0.0, pd["landed"] - ordered),
            "first_step": max(0.0, t.t_first - pd["landed"])}  # fmt: skip


class PDMetrics:
    def __init__(self, engine, registry):
        self.engine = engine
        self.phase = Histogram("xpod_pd_ttft_phase_seconds", "A PD request's time to first token"
                               " by part: queue, prefill, kv_wait, transfer, first_step.",
                               ["phase"],
                               buckets=PHASE_BUCKETS, registry=registry)  # fmt: skip
        for p in PHASES:
            self.phase.labels(p)

    def on_finish(self, t) -> None:
        parts = ttft_phases(t)
        if parts is not None:
            for p, v in parts.items():
                self.phase.labels(p).observe(v)

    def collect(self, by: dict):
        topo = self.engine.config.pd
        dec = [by.get(g) or {} for g in topo.decode]
        pre = [by.get(g) or {} for g in topo.prefill]
        m = GaugeMetricFamily("xpod_pd_requests", "PD requests per connector state in the"
                              " decode masters.", labels=["state"])  # fmt: skip
        for state in ("Bootstrapping", "WaitingForInput", "Transferring"):
            m.add_metric([state], sum((s.get("pd_states") or {}).get(state, 0) for s in dec))
        yield m
        m = CounterMetricFamily("xpod_pd_transfers", "KV transfers ended, by result.",
                                labels=["result"])  # fmt: skip
        m.add_metric(["success"], sum(s.get("pd_success", 0) for s in dec))
        m.add_metric(["failed"], sum(s.get("pd_failed", 0) for s in dec))
        yield m
        yield CounterMetricFamily("xpod_pd_deferred", "PD requests the decode masters made wait"
                                  " for room (backpressure), each counted once.",
                                  value=sum(s.get("pd_deferred", 0) for s in dec))  # fmt: skip
        links = {k: v for s in dec for k, v in (s.get("pd_links") or {}).items()}
        fams = [CounterMetricFamily("xpod_kv_transfer_bytes", "KV bytes moved over a link.",
                                    labels=["link"]),
                CounterMetricFamily("xpod_kv_transfer_seconds", "Copy time of a link's KV"
                                    " transfers (prefill die's KV thread).", labels=["link"]),
                CounterMetricFamily("xpod_kv_transfers", "KV transfers over a link.",
                                    labels=["link"])]  # fmt: skip
        state = GaugeMetricFamily(
            "xpod_kv_link_state",
            "1 for a link's state (the probe's verdict): ok, slow, dead.",
            labels=["link", "state"],
        )
        for link, v in sorted(links.items()):
            fams[0].add_metric([link], v["bytes"])
            fams[1].add_metric([link], v["ns"] / 1e9)
            fams[2].add_metric([link], v["transfers"])
            for st in LINK_STATES:
                state.add_metric([link, st], 1.0 if v["state"] == st else 0.0)
        yield from fams
        yield state
        for name, doc, key, src in (
            ("xpod_kv_checksum_mismatches", "Transfers whose landed KV's crc32 differed from"
             " the source's.", "pd_checksum_mismatches", dec),
            ("xpod_kv_quarantined_blocks", "Decode KV blocks kept out of use: a dead link's"
             " prefill die may still write them.", "pd_quarantined_blocks", dec),
            ("xpod_kv_link_probes", "Link probes sent by the decode masters.", "pd_probes", dec),
            ("xpod_kv_leases_freed", "Prefill leases freed by the decode side's read.",
             "pd_leases_freed", pre),
            ("xpod_kv_leases_expired", "Prefill leases that expired (freed unread).",
             "pd_leases_expired", pre),
        ):  # fmt: skip
            yield CounterMetricFamily(name, doc, value=sum(s.get(key, 0) for s in src))
        yield GaugeMetricFamily("xpod_kv_leases_held", "Requests whose prefill blocks are held"
                                " for their decode die.",
                                value=sum(s.get("pd_leased", 0) for s in pre))  # fmt: skip
        router = self.engine.tracker.pd
        if router is not None:
            for key in ("pd_recomputed", "pd_failed"):
                yield CounterMetricFamily(f"xpod_{key}", f"PD requests whose transfer failed:"
                                          f" {key[3:]} (kv_policy).",
                                          value=router.counters[key])  # fmt: skip
            q = GaugeMetricFamily(
                "xpod_pd_prefill_queue_tokens",
                "Prompt tokens placed on a prefill die and not prefilled yet.",
                labels=["group"],
            )
            for p, n in router.queue_tokens().items():
                q.add_metric([str(p)], n)
            yield q
