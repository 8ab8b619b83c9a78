"""Per-die protocol trace and its export to Chrome trace-event JSON (opens in Perfetto).

A record is one protocol step of docs/protocols.md: `(t_ns, dur_ns, op, step, peer, lane, event_id,
nbytes)`; `t_ns` is CLOCK_MONOTONIC (the same clock in every process of the machine), `dur_ns` is 0
for instants (a publish) and the time spent for copies and polls. Records go into a bounded deque
(a tuple append, ~0.1 us), so tracing can stay on in benchmarks; the oldest records fall off.
"""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Iterable, Sequence

now_ns = time.perf_counter_ns  # CLOCK_MONOTONIC on Linux: comparable across processes

# (op, step) -> step name shown in the timeline. Step numbers are those of docs/protocols.md.
STEP_NAMES: dict[tuple[str, int], str] = {
    ("send", 1): "1 mte2 app->ub",
    ("send", 2): "2 mte3 ub->ring",
    ("send", 3): "3 publish desc",
    ("send", 4): "4 poll ack",
    ("send", 8): "8 done",
    ("recv", 5): "5 poll desc",
    ("recv", 6): "6 copy ring->app",
    ("recv", 7): "7 ack",
    ("dma_send", 2): "2 dma app->ring",
    ("dma_send", 3): "3 publish desc",
    ("dma_send", 4): "4 poll ack",
    ("dma_send", 8): "8 done",
    ("dma_recv", 5): "5 poll desc",
    ("dma_recv", 6): "6 dma ring->app",
    ("dma_recv", 7): "7 ack",
    ("zc_send", 0): "0 poll rendezvous",
    ("zc_send", 2): "2 write app->remote app",
    ("zc_send", 3): "3 publish desc",
    ("zc_send", 4): "4 poll ack",
    ("zc_send", 8): "8 done",
    ("zc_recv", 0): "0 publish rendezvous",
    ("zc_recv", 5): "5 poll desc",
    ("zc_recv", 7): "7 ack",
    # expert-parallel all-to-all (comm.alltoall; docs/protocols.md §6-8)
    ("pull_dispatch", 2): "1-2 load + quantize",
    ("pull_dispatch", 3): "3 write own send rows",
    ("pull_dispatch", 4): "4 publish off/count/seq",
    ("pull_dispatch", 5): "5 poll fields",
    ("pull_dispatch", 6): "6-7 pull + group by expert",
    ("pull_combine", 3): "3 write own combine rows",
    ("pull_combine", 4): "4 publish off/count/seq",
    ("pull_combine", 5): "5 poll fields",
    ("pull_combine", 6): "6-7 pull + reduce",
    ("fused_dispatch", 1): "1 quantize + write packets",
    ("fused_dispatch", 2): "2 counts + flag",
    ("fused_dispatch", 3): "3 poll flags + assemble",
    ("fused_combine", 1): "1-2 write rows + slot words",
    ("fused_combine", 3): "3 poll slot words",
    ("fused_combine", 4): "reduce",
    ("a2e", 1): "A2E write to trampoline",
    ("a2e", 2): "A2E' forward",
    ("a2e", 3): "poll flags + assemble",
    ("e2a", 1): "E2A write to trampolines",
    ("e2a", 3): "E2A' poll",
    ("e2a", 4): "E2A' forward",
    ("e2a", 5): "poll slot words",
    ("e2a", 6): "reduce",
}

# Names of tracks that are not AIV lanes (users register theirs, e.g. runtime.decode's "model").
TRACK_NAMES: dict[int, str] = {}

RECORD_FIELDS = ("t_ns", "dur_ns", "op", "step", "peer", "lane", "event_id", "nbytes")


class Trace:
    """Bounded per-die record buffer. `enabled` is read by hot paths before calling `rec`."""

    def __init__(self, die_id: int, capacity: int = 1 << 16, enabled: bool = False):
        self.die_id = die_id
        self.enabled = enabled
        self.records: deque[tuple] = deque(maxlen=capacity)

    def rec(
        self,
        t_ns: int,
        dur_ns: int,
        op: str,
        step: int,
        peer: int,
        lane: int,
        event_id: int,
        nbytes: int,
    ) -> None:
        self.records.append((t_ns, dur_ns, op, step, peer, lane, event_id, nbytes))

    def clear(self) -> None:
        self.records.clear()

    def snapshot(self) -> list[tuple]:
        return list(self.records)


def steps_of(records: Iterable[Sequence], op_prefix: str = "", peer: int | None = None) -> list:
    """(op, step) pairs in time order, optionally only ops starting with `op_prefix` and one peer.

    Tests use this to assert protocol step order.
    """
    out = []
    for r in sorted(records, key=lambda r: (r[0], r[0] + r[1])):
        if r[2].startswith(op_prefix) and (peer is None or r[4] == peer):
            out.append((r[2], r[3]))
    return out


def to_chrome(per_die: dict[int, Sequence[Sequence]]) -> dict:
    """Chrome trace-event JSON: one process per die, one thread per lane, one event per step."""
    events: list[dict] = []
    t0 = min((r[0] for recs in per_die.values() for r in recs), default=0)
    for die_id, recs in sorted(per_die.items()):
        events.append(_meta("process_name", die_id, 0, {"name": f"die {die_id}"}))
        events.append(_meta("process_sort_index", die_id, 0, {"sort_index": die_id}))
        lanes = sorted({int(r[5]) for r in recs})
        for lane in lanes:
            name = TRACK_NAMES.get(int(lane), f"lane {lane}")
            events.append(_meta("thread_name", die_id, lane, {"name": name}))
        for t_ns, dur_ns, op, step, peer, lane, event_id, nbytes in recs:
            ev = {
                "name": f"{op} {STEP_NAMES.get((op, step), step)}",
                "cat": op,
                "pid": die_id,
                "tid": int(lane),
                "ts": (t_ns - t0) / 1e3,
                "args": {"peer": int(peer), "event_id": int(event_id), "bytes": int(nbytes)},
            }
            if dur_ns > 0:
                ev["ph"] = "X"
                ev["dur"] = dur_ns / 1e3
            else:
                ev["ph"] = "i"
                ev["s"] = "t"
            events.append(ev)
    return {"traceEvents": events, "displayTimeUnit": "ns"}


def _meta(name: str, pid: int, tid: int, args: dict) -> dict:
    return {"name": name, "ph": "M", "pid": pid, "tid": tid, "args": args}


def write_chrome(path: str, per_die: dict[int, Sequence[Sequence]]) -> int:
    """Write the Chrome trace JSON; returns the number of step events written."""
    doc = to_chrome(per_die)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f)
    return sum(1 for e in doc["traceEvents"] if e["ph"] != "M")
