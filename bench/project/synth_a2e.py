"""The trace synthesizer for A2E / E2A: the capture a split pod would write, without the pod.

`synthesize_a2e` writes what `bench.project.capture.capture_alltoall(cfg, pt, "a2e", quant)`
writes (docs/projection.md §1: the same die files event for event but for the host times, the
same meta but `synthesized: true`, no commit and the files' hashes), from the benchmark's
routing (`bench.alltoall.inputs.routing` of each attention die), `comm.routing`'s dispatch
layout over the expert dies and `memory.layout`'s words, through the same `comm.capture.Capture`
recorder, step for step as `comm.alltoall.trampoline` calls it when `bench.alltoall.dies.a2e_run`
drives it: a barrier before each call; one DP domain, one micro-batch, `Split.make(dies, A)`
(attention dies 0..A-1, attention die i's trampoline expert die A + i, so A <= E); operation
number g = call + 1 on every die (half g & 1). Per call:

    A2E   attention die a   [quantize]; its rows to its trampoline t (put a2e_in); t's a2e
                            flag (pub)
          trampoline t      a's flag (acq); a's rows to each expert die in the shifted order
                            (put fused_disp, its own: a local put); then each expert die's
                            forwarded flag for a (pub; its own: a local store)
          every expert die  each attention die's forwarded flag, written by its trampoline
                            (acq); assemble
    E2A   every expert die  its rows to each row's trampoline in the shifted order (put
                            fused_comb), its own partner's rows (a local put), then their
                            completion words (pub); its a2e_seen word in every other
                            trampoline (pub)
          trampoline t      a's completion words (acq, but the rows it wrote itself); every
                            other expert die's a2e_seen (acq each); a's rows to a (put
                            fused_comb), their completion words (pub), a's done flag (pub)
          attention die a   its done flag (acq); every routed (slot, k) (acq); weighted_sum

Sizes beyond the launcher's cap (`PodConfig` allows 256 dies; 001 §7.1's one DP domain is 160
attention + 288 expert dies): `uncapped` builds the config without the checks that cap, and
only its layout is used — the synthesizer never launches a pod. 001 places 256 routed experts
and 32 redundant copies on 288 expert dies, one expert per die; `Placement.default` (what
`comm.a2e` places, block placement, experts divisible over the expert dies) cannot hold 256
experts on 288 dies, so that layout is 288 experts, one per die, routed uniformly (uniform
routing gives a redundant copy the load of a routed expert, which 001's balancing aims at):
`Point(448, 96, 7168, 8, 288, seed, attention_dies=160)`, `config_for(pt, "int8")`.

A decode step's calls (`bench.project.synth_decode_split`) are emitted by the same code through
its public entry points: `A2ERoutes.of` (explicit routings, any expert placement, each attention
die's micro-batch `slot_base`) and the four bodies `a2e_attention`, `a2e_expert` (with `learn`:
the expert loop's `_learn_event` acquire), `e2a_expert`, `e2a_attention`.
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np

from bench.alltoall.inputs import Point, routing
from bench.project.capture import CAPTURE_ITERS, CAPTURE_WARMUP
from bench.project.synth_common import SynthDie, barrier, shifted_order, write_die, write_meta
from comm.alltoall.fields import G_SEQ
from comm.alltoall.split import Split
from comm.capture import area_of, tokens_of
from comm.routing import Placement, get_dispatch_layout
from memory import layout as L
from memory.errors import ConfigError
from runtime import PodConfig

POD_MAX_DIES = 256  # PodConfig's num_dies cap (a launch limit)


def uncapped(cfg: PodConfig, **changes: object) -> PodConfig:
    """`cfg` with `changes` set, without `PodConfig`'s checks (its die cap among them): a
    config for a layout, never for a launch. `cfg` itself was checked when it was made."""
    out = copy.copy(cfg)
    for k, v in changes.items():
        object.__setattr__(out, k, v)
    return out


def config_for(pt: Point, quant: str, **fields: object) -> PodConfig:
    """The pod config of an A2E point: areas sized for its batch, hidden, top-k and experts
    (num_experts / E on each expert die), int8 or float32 dispatch rows. Beyond 256 dies
    every check runs at 256 dies and the die count is then set (`uncapped`)."""
    n_exp = pt.dies - pt.attention_dies
    kw = dict(app_bytes=1 << 20, a2a_max_batch=pt.batch, a2a_hidden=pt.hidden,
              a2a_topk=pt.topk, num_experts=pt.num_experts,
              a2a_max_local_experts=pt.num_experts // n_exp,
              a2a_dispatch_dtype="int8" if quant == "int8" else "float32")  # fmt: skip
    kw.update(fields)
    cfg = PodConfig(num_dies=min(pt.dies, POD_MAX_DIES), **kw)
    if pt.dies <= POD_MAX_DIES:
        return cfg
    cfg = uncapped(cfg, num_dies=pt.dies)
    lo = cfg.layout()
    if lo.region_bytes > cfg.max_region_bytes:
        raise ConfigError(f"{pt.dies} dies: a region needs {lo.region_bytes} B, more than"
                          f" max_region_bytes {cfg.max_region_bytes}")  # fmt: skip
    return cfg


def _capture_config(cfg: PodConfig) -> PodConfig:
    """What `capture_alltoall` launches (and records in meta.json) for `cfg`."""
    return uncapped(cfg, capture=True, trace=False, hosts=(), fabric="auto",
                    timeout_s=cfg.timeout_s if cfg.timeout_s >= 60 else 60.0)  # fmt: skip


class _Routes:
    """The attention dies' routing over the expert dies, the split and what they imply."""

    def __init__(self, pt: Point):
        self.pt = pt
        self.split = Split.make(pt.dies, pt.attention_dies)
        self.placement = Placement.default(pt.num_experts, pt.expert_dies)
        self.idx = [routing(pt, a)[0] for a in range(pt.attention_dies)]
        self.lay = [get_dispatch_layout(i, self.placement) for i in self.idx]
        self.offs = [lay.dest_offsets.tolist() for lay in self.lay]
        self.pos = {d: p for p, d in enumerate(self.placement.dies)}
        self.tramp = [self.split.trampoline(a) for a in range(pt.attention_dies)]

    def base(self, a: int) -> int:
        """The batch slot of attention die a's first row (its micro-batch's `slot_base`)."""
        return 0

    def span(self, a: int, e: int) -> slice:
        """Attention die a's messages to expert die e (canonical order: by destination)."""
        p = self.pos[e]
        return slice(self.offs[a][p], self.offs[a][p + 1])

    def lin(self, a: int, e: int | None = None) -> np.ndarray:
        """slot * topk + k of a's messages (to expert die e only, if given)."""
        lay, s = self.lay[a], slice(None) if e is None else self.span(a, e)
        return (lay.msg_slot[s] + self.base(a)) * self.pt.topk + lay.msg_k[s]


def _flag_word(lo: L.RegionLayout, op: int) -> int:
    """`trampoline._flag_word`: a trampoline's inbound a2e flag, an attention die's done flag."""
    return (lo.a2e_flag_off + (op & 1) * L.FIELD_BYTES) // L.WORD


def _a2e_attention(die: SynthDie, r: _Routes, lo: L.RegionLayout, op: int, quant: str) -> None:
    """`a2e` on an attention die: quantize, then `_a2e_stage1`."""
    pt, cap, a = r.pt, die.cap, die.d
    if quant == "int8":  # bf16 in, int8 + scale out
        b, h = r.idx[a].shape[0], pt.hidden
        cap.op("quantize", 3 * b * h, 2 * b * h, b * h + 4 * b, unit="aiv", rows=b, hidden=h)
    lay, t, stride = r.lay[a], r.tramp[a], lo.pull_disp_stride
    n = lay.num_msgs
    if n:  # every packet into the trampoline's inbound area
        cap.rows(t, n, tokens_of(lay.msg_slot), stride)
        cap.put(t, n * stride, area_of(lo, lo.a2e_in_off + (op & 1) * lo.pull_disp_rows * stride))
    cap.pub(t, (_flag_word(lo, op) + G_SEQ,), (op,))  # its one metadata write


def _a2e_expert(die: SynthDie, r: _Routes, lo: L.RegionLayout, op: int,
                learn: bool = False) -> None:  # fmt: skip
    """`a2e` on an expert die: `_a2e_stage2` if it is a trampoline, then (`learn`: the die
    takes the event id from the packets, `_learn_event`) `_expert_gather`."""
    pt, cap, me = r.pt, die.cap, die.d
    half, stride = op & 1, lo.pull_disp_stride
    exp = set(r.placement.dies)
    for a in r.split.partners(me):  # A2E': forward the partner's packets
        cap.acq((_flag_word(lo, op) + G_SEQ,), (op,), (a,), f"a2e.flag[{half}]", 0)
        block = lo.fused_disp_off + (half * pt.dies + a) * lo.fused_disp_rows * stride
        order = [d for d in shifted_order(me, pt.dies) if d in exp]
        for d in order:
            s = r.span(a, d)
            k = s.stop - s.start
            if k:  # the forwarded rows' messages (its own: a local put)
                cap.rows(d, k, tokens_of(r.lay[a].msg_slot[s]), stride)
                cap.put(d, k * stride, "fused_disp" if d == me else area_of(lo, block))
        flag = lo.fused_flag_word(half, a) + G_SEQ
        for d in order:  # every expert die's flag for a, after every row (its own: a store)
            if d != me:
                cap.pub(d, (flag,), (op,))
    if learn:  # the first source's forwarded flag, before the gather's
        f = lo.fused_flag_word(half, 0)
        cap.acq((f + G_SEQ,), (op,), (r.tramp[0],), f"fused.flag[{half}] (forwarded)", 0)
    for a in range(pt.attention_dies):  # `fused_gather`: the flags their trampolines wrote
        f = lo.fused_flag_word(half, a)
        cap.acq((f + G_SEQ,), (op,), (r.tramp[a],), f"fused.flag[{half}] (forwarded)", 0)
    n = sum(r.span(a, me).stop - r.span(a, me).start for a in range(pt.attention_dies))
    cap.op("assemble", 0, n * stride, n * stride, unit="aiv", rows=n)


def _comb_rows(die: SynthDie, lo: L.RegionLayout, peer: int, lin: np.ndarray) -> None:
    """`push_combine` / `local_rows`: combine rows at lin of peer (or of the die itself)."""
    stride = lo.pull_comb_stride
    die.cap.rows(peer, len(lin), tokens_of(lin // lo.a2a_topk), stride)
    die.cap.put(peer, len(lin) * stride, "fused_comb")


def _comb_words(die: SynthDie, lo: L.RegionLayout, peer: int, lin: np.ndarray, op: int) -> None:
    """`publish_slots`: the completion words of those rows, after every row."""
    die.cap.pub(peer, (lin + lo.fused_cflag_off // L.WORD).tolist(), [op] * len(lin))


def _e2a_expert(die: SynthDie, r: _Routes, lo: L.RegionLayout, op: int) -> None:
    """`_e2a_expert`: `write_slots_by_src` to the trampolines, the a2e_seen words, then E2A'
    on a trampoline."""
    pt, cap, me = r.pt, die.cap, die.d
    n_att = pt.attention_dies
    to = {r.tramp[a]: r.lin(a, me) for a in range(n_att)}  # one partner per trampoline
    to = {t: lin for t, lin in to.items() if len(lin)}
    runs = [t for t in shifted_order(me, pt.dies) if t in to and t != me]
    for t in runs:  # every remote trampoline's rows, this die's own, then the words
        _comb_rows(die, lo, t, to[t])
    if me in to:
        _comb_rows(die, lo, me, to[me])
    for t in runs:
        _comb_words(die, lo, t, to[t], op)
    seen = lo.a2e_seen_off // L.WORD
    for a in range(n_att):  # this die finished the operation: every trampoline learns it
        if r.tramp[a] != me:
            cap.pub(r.tramp[a], (seen + me,), (op,))
    cbase = lo.fused_cflag_off // L.WORD
    for a in r.split.partners(me):  # E2A': the partner's rows, once every expert die's are in
        lay, lin = r.lay[a], r.lin(a)
        if len(lin):  # `wait_slots(..., "e2a", owners)`: its own rows are program order
            cap.acq((lin + cbase).tolist(), [op] * len(lin), lay.msg_dest.tolist(), "e2a.cflag", 0)
        for x in r.placement.dies:
            cap.acq((seen + x,), (op,), (x,), "a2e.seen (its E2A of the operation)", 0)
        if len(lin):
            _comb_rows(die, lo, a, lin)
            _comb_words(die, lo, a, lin, op)
        cap.pub(a, (_flag_word(lo, op) + G_SEQ,), (op,))  # done, after the rows


def _e2a_attention(die: SynthDie, r: _Routes, lo: L.RegionLayout, op: int) -> None:
    """`e2a` on an attention die: the done flag, every routed slot, the weighted sum."""
    pt, cap, a = r.pt, die.cap, die.d
    t = r.tramp[a]
    cap.acq((_flag_word(lo, op) + G_SEQ,), (op,), (t,), f"e2a'.done[{op & 1}]", 0)
    r_slot, r_k = np.nonzero(r.idx[a] >= 0)
    if len(r_slot):
        words = (lo.fused_cflag_off // L.WORD + (r_slot + r.base(a)) * pt.topk + r_k).tolist()
        cap.acq(words, [op] * len(words), [t] * len(words), "e2a'.cflag", 0)
    rows, h = len(r_slot), pt.hidden
    cap.op("weighted_sum", 2 * rows * h, rows * lo.pull_comb_stride, 2 * r.idx[a].shape[0] * h,
           unit="aiv", rows=rows)  # fmt: skip


def synthesize_a2e(cfg: PodConfig, pt: Point, quant: str, directory: str | Path) -> Path:
    """Write the capture `bench.project.capture.capture_alltoall(cfg, pt, "a2e", quant)` would
    write, from the routing and the layout alone (`synthesized: true`); `cfg` may exceed the
    launcher's die cap (`config_for`). One die at a time: a die's file is written, and its
    events dropped, before the next die's are made."""
    if not pt.attention_dies:
        raise ValueError("synthesize_a2e: the point has no attention dies (Point.attention_dies)")
    if quant not in ("int8", "none"):
        raise ValueError(f"synthesize_a2e: quant {quant!r}: 'int8' or 'none'")
    if cfg.num_dies != pt.dies:
        raise ValueError(f"synthesize_a2e: the config has {cfg.num_dies} dies, the point {pt.dies}")
    lo = cfg.layout()
    r = _Routes(pt)
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    (out / "meta.json").unlink(missing_ok=True)  # an old capture is incomplete from here on
    entries = []
    for d in range(pt.dies):
        die = SynthDie(d, lo)
        att = d < pt.attention_dies
        for it in range(CAPTURE_WARMUP + CAPTURE_ITERS):
            op = it + 1  # one domain, one micro-batch: `Split.next_op` counts calls
            for name in ("a2e", "e2a"):
                barrier(die, pt.dies, lo)
                die.cap.begin(name, it, die.a2a)
                with die.cap.on(die.a2a):
                    if name == "a2e":
                        (_a2e_attention(die, r, lo, op, quant) if att else
                         _a2e_expert(die, r, lo, op))  # fmt: skip
                    elif att:
                        _e2a_attention(die, r, lo, op)
                    else:
                        _e2a_expert(die, r, lo, op)
                die.cap.end(name, it)
        entries.append(write_die(die, out))
    config = _capture_config(cfg).to_dict()
    return write_meta(out, entries, config, pt, "a2e", quant, ["a2e", "e2a"])


class A2ERoutes(_Routes):
    """One A2E / E2A call's routes from explicit routings (what `bench.project.
    synth_decode_split` emits a decode step's calls with): attention die a's routed experts
    `idx[a]` (int64 [rows, topk], its micro-batch's rows), the expert placement over the
    expert dies, the batch slot of each attention die's first row (`bases`, its micro-batch's
    `slot_base`). One DP domain (`Split.make(pt.dies, pt.attention_dies)`); `pt` gives the
    pod's dies, attention dies, top-k and hidden."""

    @classmethod
    def of(cls, pt: Point, idx: list[np.ndarray], placement: Placement,
           bases: list[int] | None = None) -> A2ERoutes:  # fmt: skip
        r = cls.__new__(cls)
        r.pt = pt
        r.split = Split.make(pt.dies, pt.attention_dies)
        r.placement = placement
        r.idx = [np.asarray(x, np.int64).reshape(-1, pt.topk) for x in idx]
        r.lay = [get_dispatch_layout(i, placement) for i in r.idx]
        r.offs = [lay.dest_offsets.tolist() for lay in r.lay]
        r.pos = {d: p for p, d in enumerate(placement.dies)}
        r.tramp = [r.split.trampoline(a) for a in range(pt.attention_dies)]
        r.bases = list(bases) if bases is not None else [0] * pt.attention_dies
        return r

    def base(self, a: int) -> int:
        return int(self.bases[a])


def a2e_attention(die: SynthDie, r: A2ERoutes, lo: L.RegionLayout, op: int, quant: str) -> None:
    """The body of an attention die's `a2e` call of operation `op` (quantize if int8, its
    rows to its trampoline, the trampoline's flag)."""
    _a2e_attention(die, r, lo, op, quant)


def a2e_expert(die: SynthDie, r: A2ERoutes, lo: L.RegionLayout, op: int,
               learn: bool = False) -> None:  # fmt: skip
    """The body of an expert die's `a2e` call: A2E' if it is a trampoline, (`learn`: an
    expert die of a decode loop, which takes the event id from the packets) the gather."""
    _a2e_expert(die, r, lo, op, learn)


def e2a_expert(die: SynthDie, r: A2ERoutes, lo: L.RegionLayout, op: int) -> None:
    """The body of an expert die's `e2a` call: its rows to the trampolines, E2A'."""
    _e2a_expert(die, r, lo, op)


def e2a_attention(die: SynthDie, r: A2ERoutes, lo: L.RegionLayout, op: int) -> None:
    """The body of an attention die's `e2a` call: the done flag, every routed slot, the sum."""
    _e2a_attention(die, r, lo, op)


__all__ = ["A2ERoutes", "a2e_attention", "a2e_expert", "config_for", "e2a_attention",
           "e2a_expert", "synthesize_a2e", "uncapped"]  # fmt: skip
