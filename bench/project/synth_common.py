"""What both trace synthesizers share (bench.project.synth, bench.project.synth_a2e): a die's
recorder, the shifted peer order and the barrier as the protocols record them, and the writing
of die files and meta.json (docs/projection.md §1.1), labelled `synthesized`."""

from __future__ import annotations

import json
import os
from pathlib import Path

from bench.alltoall.inputs import Point
from bench.project.capture import CAPTURE_WARMUP
from comm.capture import Capture
from memory import layout as L
from runtime.pod.capture import FORMAT, VERSION


class SynthDie:
    """One die's recorder and the layouts it needs."""

    def __init__(self, d: int, lo: L.RegionLayout):
        self.d = d
        self.cap = Capture(d, lo)
        self.a2a = self.cap.stream("a2a")
        self.syncs = 0


def shifted_order(me: int, n: int) -> list[int]:
    """`comm.endpoint.shifted`: the dies from me + 1 on, wrapping around, me last."""
    return [(me + 1 + i) % n for i in range(n)]


def barrier(die: SynthDie, n: int, lo: L.RegionLayout) -> None:
    """`comm.endpoint.barrier`: this die's count into every peer's word, then every peer's."""
    die.syncs += 1
    base, cap = lo.sync_off // L.WORD, die.cap
    for p in range(n):
        if p != die.d:
            cap.pub(p, (base + die.d,), (die.syncs,))
    for p in range(n):
        if p != die.d:
            cap.acq((base + p,), (die.syncs,), (p,), "sync[peer]", 0)


def write_die(die: SynthDie, out: Path) -> dict:
    """Write one die's file (no host times: a synthesized trace has none); its meta entry."""
    for e in die.cap.events:
        e[2] = e[3] = 0
    return die.cap.write(str(out))


def write_meta(out: Path, entries: list[dict], config: dict, pt: Point, protocol: str,
                quant: str, calls: list[str]) -> Path:  # fmt: skip
    """meta.json, LAST (docs/projection.md §1.1), labelled `synthesized`."""
    workload = {"bench": "alltoall", "protocol": protocol, "quant": quant, "batch": pt.batch,
                "hidden": pt.hidden, "topk": pt.topk, "experts": pt.num_experts,
                "routing": pt.routing, "seed": pt.seed, "dies": pt.dies,
                "attention_dies": pt.attention_dies,
                "combine_dtype": pt.combine_dtype}  # fmt: skip
    meta = {"format": FORMAT, "version": VERSION, "layout_version": L.LAYOUT_VERSION,
            "num_dies": pt.dies, "dies": entries, "config": config,
            "workload": workload, "calls": list(calls), "warmup": CAPTURE_WARMUP,
            "synthesized": True, "commit": ""}  # fmt: skip
    tmp = out / ".meta.json.tmp"
    tmp.write_text(json.dumps(meta, indent=1, sort_keys=True), encoding="utf-8")
    os.replace(tmp, out / "meta.json")
    return out


__all__ = ["SynthDie", "barrier", "shifted_order", "write_die", "write_meta"]
