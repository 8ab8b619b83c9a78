"""The serving engine's Perfetto timeline: masters above dies.

```
 master g   (process -1 - g, sorted above the dies)
   track "plan"      spans: planning and publishing step commands
   track "results"   spans: taking results (scheduler updates, outputs)
   track "kv pool"   spans: each KV pool load, from its order to its landing (blocks)
   counters          running, waiting, KV blocks in use, output tokens, dummy steps,
                     preemptions, prefix-hit tokens
 die d      (process d)  as comm.trace exports it: the "serve" track (wait command = the
            scheduling bubble, vote, park, step), the "model" track (attention, gate, dispatch,
            experts, combine), and the protocol steps of comm per lane
```
All timestamps are CLOCK_MONOTONIC nanoseconds (`time.perf_counter_ns` in every process), so
the tracks line up.
"""

from __future__ import annotations

import json

from comm.trace import to_chrome

COUNTERS = (
    "running",
    "waiting",
    "kv_blocks_used",
    "output_tokens",
    "dummy_steps",
    "preemptions",
    "prefix_hit_tokens",
)


def serving_trace(dies: dict[int, list], masters: dict[int, dict]) -> dict:
    doc = to_chrome(dies)
    t0 = min(
        [r[0] for recs in dies.values() for r in recs]
        + [s[0] for m in masters.values() for s in m.get("spans", [])],
        default=0,
    )
    shift = min((r[0] for recs in dies.values() for r in recs), default=t0) - t0
    events = doc["traceEvents"]
    for e in events:  # to_chrome measured from the dies' first record: re-base on the earliest
        if "ts" in e:
            e["ts"] += shift / 1e3
    for g, m in sorted(masters.items()):
        pid = -1 - int(g)
        events.append(_meta("process_name", pid, 0, {"name": f"master {g}"}))
        events.append(_meta("process_sort_index", pid, 0, {"sort_index": -100 + int(g)}))
        events.append(_meta("thread_name", pid, 0, {"name": "plan"}))
        events.append(_meta("thread_name", pid, 1, {"name": "results"}))
        events.append(_meta("thread_name", pid, 2, {"name": "kv pool"}))
        for t, dur, name, n in m.get("spans", []):
            events.append({"name": f"{name} ({n})", "cat": "master", "ph": "X", "pid": pid,
                           "tid": {"plan": 0, "kv pool load": 2}.get(name, 1),
                           "ts": (t - t0) / 1e3,
                           "dur": max(dur, 1) / 1e3, "args": {"n": n}})  # fmt: skip
        for t, *vals in m.get("counters", []):
            events.append({"name": f"group {g}", "cat": "master", "ph": "C", "pid": pid,
                           "ts": (t - t0) / 1e3,
                           "args": dict(zip(COUNTERS, vals, strict=True))})  # fmt: skip
    return doc


def write_serving_trace(path: str, dies: dict[int, list], masters: dict[int, dict]) -> int:
    doc = serving_trace(dies, masters)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f)
    return sum(1 for e in doc["traceEvents"] if e["ph"] != "M")


def _meta(name: str, pid: int, tid: int, args: dict) -> dict:
    return {"name": name, "ph": "M", "pid": pid, "tid": tid, "args": args}
