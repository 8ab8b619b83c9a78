"""What each die runs (`Pod.run`): warm-up and timed iterations of dispatch + combine (or A2E +
E2A), its own times in ns, and a check of the last iteration's rows and combine output."""

from __future__ import annotations

import time

import numpy as np

import comm
from bench.alltoall.inputs import Point, routing, split_protocol, tokens
from comm.quant import combine_dtype
from comm.routing import Placement


def _inputs(die, pt: Point) -> tuple:
    key = ("a2a_inputs", pt)
    if key not in die.user:
        die.user[key] = (tokens(pt, die.die_id), *routing(pt, die.die_id))
    return die.user[key]


def _expert_out(die, rows: int, hidden: int) -> np.ndarray:
    """float32 [>= rows, hidden] of ones, kept between calls (its pages touched once)."""
    buf = die.user.get("a2a_expert_out")
    if buf is None or buf.shape[0] < rows or buf.shape[1] != hidden:
        buf = die.user["a2a_expert_out"] = np.ones((max(rows, 1), hidden), np.float32)
    return buf


def _weight_sums(w: np.ndarray) -> np.ndarray:
    """What combine returns in every column when every expert row is 1.0: the ascending-k
    float32 sum of the weights, the operation order of comm.reference.combine_ref."""
    acc = np.zeros(w.shape[0], np.float32)
    for k in range(w.shape[1]):
        acc = acc + w[:, k]
    return acc


def _dedup_weight_sums(pt: Point, idx: np.ndarray, w: np.ndarray) -> np.ndarray:
    """What a dedup combine returns in every column when every expert row is 1.0: per die the
    ascending-k sum of its weights, rounded to the combine dtype, then summed over the dies in
    order of their first k (comm.reference.combine_ref(..., dedup=True) on rows of ones)."""
    from comm.reference import dedup_sum

    placement = Placement.default(pt.num_experts, pt.expert_dies)
    routed = idx >= 0
    die_of = np.where(routed, placement.die_of[np.maximum(idx, 0)], -1)
    ones = np.ones((*idx.shape, 1), np.float32)
    return dedup_sum(ones, routed, die_of, w, combine_dtype(pt.combine_dtype))[:, 0]


def _check(die, what: str, got_rows: int, want_rows: int, out, w, want_sums=None) -> None:
    if got_rows != want_rows:
        raise RuntimeError(f"die {die.die_id}: {what} delivered {got_rows} rows, want {want_rows}")
    if out is None:
        return
    sums = _weight_sums(w) if want_sums is None else want_sums
    if not np.array_equal(out, np.broadcast_to(sums[:, None], out.shape)):
        raise RuntimeError(f"die {die.die_id}: {what} combine output differs from sum_k w[k]")


def ep_run(die, pt: Point, protocol: str, quant: str, warmup: int, iters: int, want) -> dict:
    """warmup + iters x (barrier, dispatch, barrier, combine); this die's times in ns.

    `want[die_id]` = rows this die must receive; the last iteration's rows and combine output
    are checked (expert rows of ones, so out[slot] = sum_k w[slot, k] exactly).
    """
    x, idx, w = _inputs(die, pt)
    eout = _expert_out(die, int(want[die.die_id]), pt.hidden)
    q = None if quant == "none" else quant
    base, dedup = split_protocol(protocol)
    now, disp, comb, iter_ns = time.perf_counter_ns, [], [], []
    cpu0 = time.process_time()
    for i in range(warmup + iters):
        if i == warmup:
            cpu0 = time.process_time()
        comm.barrier(die)
        t0 = now()
        d = comm.dispatch(die, x, idx, w, protocol=base, quant=q, event_id=i, dedup=dedup)
        t1 = now()
        comm.barrier(die)
        t2 = now()
        out = comm.combine(die, eout[: len(d.x)], d.handle, event_id=i)
        t3 = now()
        iter_ns.append(t3 - t0)
        if i >= warmup:
            disp.append(t1 - t0)
            comb.append(t3 - t2)
    cpu_s = time.process_time() - cpu0
    sums = _dedup_weight_sums(pt, idx, w) if dedup else None
    _check(die, f"{protocol} {quant}", len(d.x), int(want[die.die_id]), out, w, sums)
    return {"dispatch_ns": disp, "combine_ns": comb, "iter_ns": iter_ns, "cpu_s": cpu_s}


def a2e_run(die, pt: Point, protocol: str, quant: str, warmup: int, iters: int, want) -> dict:
    """As `ep_run`, with comm.a2e / comm.e2a: attention dies send and get the combine output,
    expert dies receive rows and return expert outputs. Also returns the die's metadata writes."""
    n_att = pt.attention_dies
    is_att = die.die_id < n_att
    x, idx, w = _inputs(die, pt) if is_att else (None, None, None)
    eout = None if is_att else _expert_out(die, int(want[die.die_id]), pt.hidden)
    q = None if quant == "none" else quant
    now, disp, comb, iter_ns = time.perf_counter_ns, [], [], []
    cpu0 = time.process_time()
    for i in range(warmup + iters):
        if i == warmup:
            cpu0 = time.process_time()
        comm.barrier(die)
        t0 = now()
        res, h = comm.a2e(die, x, idx, w, n_att, quant=q, event_id=i)
        t1 = now()
        comm.barrier(die)
        t2 = now()
        out = comm.e2a(die, None if is_att else eout[: len(res.x)], h, event_id=i)
        t3 = now()
        iter_ns.append(t3 - t0)
        if i >= warmup:
            disp.append(t1 - t0)
            comb.append(t3 - t2)
    cpu_s = time.process_time() - cpu0
    got = pt.batch * pt.topk if is_att else len(res.x)
    _check(die, f"a2e {quant}", got, int(want[die.die_id]), out if is_att else None, w)
    return {
        "dispatch_ns": disp,
        "combine_ns": comb,
        "iter_ns": iter_ns,
        "cpu_s": cpu_s,
        "metadata_writes": h.metadata_writes,
        "role": h.role,
    }
