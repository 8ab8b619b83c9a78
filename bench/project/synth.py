"""The trace synthesizer: the capture a pod would write, without the pod (docs/projection.md).

A capture's structure (which die puts how many rows to which, which words it publishes and
waits for) is a deterministic function of the routing, the layout and the protocol's steps.
This module emits it from xpod's own code — the benchmark's routing (`bench.alltoall.inputs`),
`comm.routing`'s dispatch and dedup layouts, `memory.layout`'s words — through the same
`comm.capture.Capture` recorder the protocols use, step for step as the protocol code calls
it, so that pods this machine cannot run (EP256, 001 §7's 480 + 288 dies) can be projected.
Its output is labelled `synthesized`, and it is tested equal, event for event (all but the
host times), to real captures at every size the machine runs (tests/integration/
test_project_synth.py). It extrapolates structure, never timing.

Protocols: the expert-parallel fused dispatch / combine (`fused`, `fused-dedup`, INT8 or
float32 rows), as `bench.alltoall.dies.ep_run` calls them (a barrier before each call); the
A2E / E2A of a split pod (`a2e`) are `bench.project.synth_a2e`'s, which `synthesize_alltoall`
hands over to.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from bench.alltoall.inputs import Point, routing, split_protocol
from bench.project.capture import CAPTURE_ITERS, CAPTURE_WARMUP
from bench.project.synth_common import SynthDie, barrier, shifted_order, write_die, write_meta
from comm.alltoall.fields import G_SEQ
from comm.capture import Capture, tokens_of
from comm.routing import Placement, get_dedup_layout, get_dispatch_layout
from memory import layout as L
from runtime import PodConfig

SYNTH_PROTOCOLS = ("fused", "fused-dedup")


class Routes:
    """Every die's routing and what it makes each die send and receive (`synth_decode`
    builds one per MoE layer from explicit routings: `Routes.of`)."""

    def __init__(self, pt: Point, dedup: bool):
        self.pt, self.dedup = pt, dedup
        n = pt.dies
        self.placement = Placement.default(pt.num_experts, tuple(range(n)))
        self.idx = [routing(pt, d)[0] for d in range(n)]
        w = [routing(pt, d)[1] for d in range(n)]
        self.lay = [get_dispatch_layout(self.idx[d], self.placement) for d in range(n)]
        self.dl = [get_dedup_layout(self.idx[d], w[d], self.placement) for d in range(n)] if (
            dedup
        ) else None  # fmt: skip

    @classmethod
    def of(cls, pt: Point, idx: list[np.ndarray], placement: Placement) -> Routes:
        """Routes of explicit routings (`idx[d]`: die d's int64 [rows, topk]), no dedup."""
        r = cls.__new__(cls)
        r.pt, r.dedup, r.dl, r.placement = pt, False, None, placement
        r.idx = list(idx)
        r.lay = [get_dispatch_layout(x, placement) for x in r.idx]
        return r

    def offsets(self, src: int) -> list[int]:
        lay = self.dl[src] if self.dedup else self.lay[src]
        return lay.dest_offsets.tolist()

    def sent_slots(self, src: int, dst: int) -> np.ndarray:
        """The batch slots of src's rows to dst (one per message, or per dedup row)."""
        a, b = self.offsets(src)[dst], self.offsets(src)[dst + 1]
        return (self.dl[src].row_slot if self.dedup else self.lay[src].msg_slot)[a:b]

    def comb_lin(self, src: int, dst: int) -> np.ndarray:
        """(slot * topk + k) of the combine rows dst returns to src."""
        a, b = self.offsets(src)[dst], self.offsets(src)[dst + 1]
        topk = self.pt.topk
        if self.dedup:
            dl = self.dl[src]
            return dl.row_slot[a:b] * topk + dl.row_kfirst[a:b]
        lay = self.lay[src]
        return lay.msg_slot[a:b] * topk + lay.msg_k[a:b]

    def entries(self, src: int, dst: int) -> int:
        """(token, expert) entries src sends dst (what a dedup row expands to)."""
        return int(self.lay[src].num_tokens_per_die[dst])


def fused_dispatch(die: SynthDie, r: Routes, lo: L.RegionLayout, it: int, quant: str) -> None:
    pt, cap, me = r.pt, die.cap, die.d
    stride = lo.pull_disp_stride
    op, n = it + 1, pt.dies
    half = op & 1
    if quant == "int8":  # `comm.alltoall.pull.dispatch`
        b, h = pt.batch, pt.hidden
        cap.op("quantize", 3 * b * h, 2 * b * h, b * h + 4 * b, unit="aiv", rows=b, hidden=h)
    offs = r.offsets(me)
    flag = lo.fused_flag_word(half, me)
    order = shifted_order(me, n)
    for d in order:  # `comm.alltoall.fused._carry_dispatch`: every die's rows, then flags
        a, b = offs[d], offs[d + 1]
        if b > a:
            slots = r.sent_slots(me, d)
            cap.rows(d, b - a, b - a if r.dedup else tokens_of(slots), stride)
            cap.put(d, (b - a) * stride, "fused_disp")
    for d in order:
        if d != me:
            cap.pub(d, (flag + G_SEQ,), (op,))
    for src in range(n):  # `fused_gather` / `_fused_receive`
        f = lo.fused_flag_word(half, src)
        cap.acq((f + G_SEQ,), (op,), (src,), f"fused.flag[{half}]", 0)
    rows = sum(len(r.sent_slots(s, me)) for s in range(n))
    out = sum(r.entries(s, me) for s in range(n)) if r.dedup else rows
    cap.op("assemble", 0, rows * stride, out * stride, unit="aiv", rows=rows)


def _combine_rows(cap: Capture, r: Routes, lo: L.RegionLayout, me: int, src: int) -> bool:
    """The combine rows `me` returns to `src` (`push_combine`, or `local_rows` for itself);
    True if there were any."""
    lin = r.comb_lin(src, me)
    if not len(lin):
        return False
    stride = lo.pull_comb_stride
    cap.rows(src, len(lin), tokens_of(lin // r.pt.topk), stride)
    cap.put(src, len(lin) * stride, "fused_comb")
    return True


def _slot_words(cap: Capture, r: Routes, lo: L.RegionLayout, me: int, src: int, op: int):
    """`publish_slots`: the completion words of those rows, after every row."""
    lin = r.comb_lin(src, me)
    base = lo.fused_cflag_off // L.WORD
    cap.pub(src, (lin + base).tolist(), [op] * len(lin))


def fused_combine(die: SynthDie, r: Routes, lo: L.RegionLayout, it: int) -> None:
    pt, cap, me = r.pt, die.cap, die.d
    op, n, topk = it + 1, pt.dies, pt.topk
    if r.dedup:  # `comm.alltoall.scatter.write_groups_by_src`
        ent = sum(r.entries(s, me) for s in range(n))
        groups = sum(len(r.comb_lin(s, me)) for s in range(n))
        h = pt.hidden
        if groups:
            cap.op("reduce_groups", 2 * ent * h, 2 * ent * h, 2 * groups * h, unit="aiv",
                   rows=ent, groups=groups)  # fmt: skip
        sent = [s for s in shifted_order(me, n) if _combine_rows(cap, r, lo, me, s) and s != me]
    else:  # `write_slots_by_src`: every remote source, then this die's own rows
        sent = [s for s in shifted_order(me, n) if s != me and _combine_rows(cap, r, lo, me, s)]
        _combine_rows(cap, r, lo, me, me)
    for s in sent:
        _slot_words(cap, r, lo, me, s, op)
    idx = r.idx[me]  # `wait_slots` over every routed slot of this die's tokens
    if r.dedup:
        first = r.dl[me].idx_first
        r_slot, r_k = np.nonzero(first >= 0)
        owners = r.placement.die_of[first[r_slot, r_k]]
    else:
        lay = r.lay[me]
        r_slot, r_k, owners = lay.msg_slot, lay.msg_k, lay.msg_dest
    base = lo.fused_cflag_off // L.WORD
    if len(r_slot):
        words = (base + r_slot * topk + r_k).tolist()
        cap.acq(words, [op] * len(words), np.asarray(owners).tolist(), "fused.cflag", 0)
    rows, h = len(r_slot), pt.hidden
    cap.op("weighted_sum", 2 * rows * h, rows * lo.pull_comb_stride, 2 * idx.shape[0] * h,
           unit="aiv", rows=rows)  # fmt: skip


def synthesize_alltoall(cfg: PodConfig, pt: Point, protocol: str, quant: str,
                        directory: str | Path) -> Path:  # fmt: skip
    """Write the capture `bench.project.capture.capture_alltoall(cfg, pt, protocol, quant)`
    would write, from the routing and the layout alone (`synthesized: true`)."""
    if protocol == "a2e":  # the split pod's A2E / E2A (`bench.project.synth_a2e`)
        from bench.project.synth_a2e import synthesize_a2e

        return synthesize_a2e(cfg, pt, quant, directory)
    if protocol not in SYNTH_PROTOCOLS or pt.attention_dies:
        raise ValueError(f"synthesize: protocol {protocol!r}: only {', '.join(SYNTH_PROTOCOLS)}")
    base, dedup = split_protocol(protocol)
    lo = cfg.layout()
    r = Routes(pt, dedup)
    dies = [SynthDie(d, lo) for d in range(pt.dies)]
    for it in range(CAPTURE_WARMUP + CAPTURE_ITERS):
        for name, step in (("dispatch", fused_dispatch), ("combine", fused_combine)):
            for die in dies:
                barrier(die, pt.dies, lo)
                die.cap.begin(name, it, die.a2a)
                with die.cap.on(die.a2a):
                    if name == "dispatch":
                        step(die, r, lo, it, quant)
                    else:
                        step(die, r, lo, it)
                die.cap.end(name, it)
    return _write(dies, cfg, pt, protocol, quant, Path(directory))


def _write(dies: list[SynthDie], cfg: PodConfig, pt: Point, protocol: str, quant: str,
           out: Path) -> Path:  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    (out / "meta.json").unlink(missing_ok=True)
    entries = [write_die(die, out) for die in dies]
    return write_meta(out, entries, cfg.to_dict(), pt, protocol, quant, ["dispatch", "combine"])


__all__ = ["SYNTH_PROTOCOLS", "Routes", "fused_combine", "fused_dispatch", "synthesize_alltoall"]
