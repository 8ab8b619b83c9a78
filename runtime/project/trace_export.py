"""A projection as a Chrome trace-event file (Perfetto, chrome://tracing open it).

One process per die, named "die N (projected PROFILE)"; one thread (track) per stream, named
after it; each event a complete event ("X") at projected µs, from the moment its stream reached
it (the previous event of the stream finished; the first event: when it became ready) to its
finish, so a wait shows as a long `acq` or `end`; its kind, peer and bytes in `args`. Two counter
tracks ("C") per die: egress and ingress GB/s over the result's port bins.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from runtime.project.graph import KINDS, Graph
from runtime.project.result import Result


def trace_events(result: Result) -> list[dict]:
    """The trace's events (metadata, complete events, counters), in a deterministic order."""
    cap, g = result.capture, result.graph
    label = f"projected {result.profile.name}"
    out: list[dict] = []
    for die in range(cap.num_dies):
        out.append(_meta("process_name", die, 0, f"die {die} ({label})"))
        out.append(_meta("process_sort_index", die, 0, die, key="sort_index"))
        for s, name in enumerate(cap.streams[die]):
            out.append(_meta("thread_name", die, s, name))
    for (die, s), first in zip(g.stream_key, g.stream_base, strict=True):
        for seq in range(_stream_len(g, die, s)):
            out.append(_complete(result, die, s, seq, first + seq))
    out.extend(_counters(result))
    return out


def write_trace(result: Result, path: str | os.PathLike) -> Path:
    """Write the trace of `result` to `path` (tmp + rename: nothing partial is left)."""
    out = Path(path)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(trace_document(result), separators=(",", ":")) + "\n", "utf-8")
    os.replace(tmp, out)
    return out


def trace_document(result: Result) -> dict:
    """The whole trace file as a dict: {"traceEvents": [...], "displayTimeUnit", "otherData"}."""
    return {
        "traceEvents": trace_events(result),
        "displayTimeUnit": "ns",
        "otherData": {
            "profile": result.profile.name,
            "profile_sha256": result.profile.sha256,
            "contention_model": result.contention_model,
            "time": f"projected µs on {result.profile.name}, not this machine's",
        },
    }


def _stream_len(g: Graph, die: int, s: int) -> int:
    starts = g.base[die]
    end = starts[s + 1] if s + 1 < len(starts) else g.die_start[die + 1]
    return end - starts[s]


def _meta(name: str, pid: int, tid: int, value: object, key: str = "name") -> dict:
    return {"name": name, "ph": "M", "pid": pid, "tid": tid, "args": {key: value}}


def _complete(result: Result, die: int, s: int, seq: int, x: int) -> dict:
    g = result.graph
    ev = result.capture.events[die][g.file_idx[x]]
    kind = KINDS[g.kind[x]]
    start = result.finish[x - 1] if seq else result.ready[x]
    args = {"kind": kind, "seq": seq, "ready_us": round(result.ready[x], 4)}
    args.update(_fields(kind, ev))
    name = kind
    if kind == "op":
        name = f"op {ev[4]}"
    elif kind in ("begin", "end"):
        name = f"{kind} {ev[4]} #{ev[5]}"
    elif kind in ("put", "get", "pub"):
        name = f"{kind} -> {ev[4]}" if kind != "get" else f"get <- {ev[4]}"
    return {"name": name, "ph": "X", "pid": die, "tid": s, "ts": round(start, 4),
            "dur": round(result.finish[x] - start, 4), "args": args}  # fmt: skip


def _fields(kind: str, ev: list) -> dict:
    if kind == "put":
        return {"peer": ev[4], "bytes": ev[5], "area": ev[6], "rows": ev[7], "tokens": ev[8]}
    if kind == "get":
        return {"peer": ev[4], "bytes": ev[5], "area": ev[6], "rows": ev[7]}
    if kind == "pub":
        return {"peer": ev[4], "words": ev[5][:8], "values": ev[6][:8], "count": len(ev[5])}
    if kind == "acq":
        return {"field": ev[7], "words": len(ev[4]), "writers": sorted(set(ev[6]))[:16]}
    if kind == "op":
        return {"flops": ev[5], "rd_bytes": ev[6], "wr_bytes": ev[7], "dims": ev[8]}
    if kind == "copy":
        return {"bytes": ev[4]}
    if kind in ("begin", "end"):
        return {"call": ev[5]}
    return {"stream": ev[4], "seq_of": ev[5]}  # after


def _counters(result: Result) -> list[dict]:
    ports = result.ports
    if ports.bin_us <= 0:
        return []
    out = []
    scale = 1.0 / (ports.bin_us * 1e3)  # bytes per bin -> GB/s
    for die in range(result.capture.num_dies):
        for name, rows in (("egress GB/s", ports.egress), ("ingress GB/s", ports.ingress)):
            for k, nbytes in enumerate(rows[die]):
                out.append({"name": name, "ph": "C", "pid": die, "ts": round(k * ports.bin_us, 4),
                            "args": {"GB/s": round(float(nbytes) * scale, 4)}})  # fmt: skip
            end = round(len(rows[die]) * ports.bin_us, 4)
            out.append({"name": name, "ph": "C", "pid": die, "ts": end, "args": {"GB/s": 0.0}})
    return out


__all__ = ["trace_document", "trace_events", "write_trace"]
