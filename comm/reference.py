"""Plain-numpy reference of every expert-parallel collective (docs/protocols.md §5-8).

Readable, not fast: each function takes the inputs of *all* dies at once and returns what every
die must end up with. The protocols of `comm/` and their tests compare against these functions,
so the orders below are part of the contract.

Canonical row order of a dispatch output on an expert die (`DispatchOut`):

    grouped by local expert ascending; within one expert by (src_rank, batch_slot, k_index)
    ascending

Combine (the only floating-point arithmetic here, so it must be reproduced bit for bit): for each
source token `slot`, starting from `out = +0.0` (float32) and for `k = 0, 1, ..., K-1` in order,
skipping unrouted `k` (`topk_idx[slot, k] == -1`):

    prod = np.float32(topk_weights[slot, k]) * row(slot, k)    # float32 multiply, rounded
    out  = out + prod                                          # float32 add, rounded

elementwise over `hidden`, two roundings per term, no fused multiply-add, no pairwise or
reordered summation. `row(slot, k)` is the expert output row whose origin is `(src, slot, k)`,
as the combine delivers it: with `combine_dtype="bfloat16"` (the pods' default, 000 §4.2.1's
16-bit combine message) each row is first rounded to bfloat16, nearest even, and widened back to
float32 exactly (`comm.quant.round_combine`); with "float32" it is the row itself.
A token with no routed k is all zeros. Since the order is fixed by `k`, not by arrival, the
result is the same whatever order the rows arrived in.

Combine with dedup (`combine_ref(..., dedup=True)`, DeepEP's layout, docs/protocols.md §6.3):
the expert die returns one row per (token, die), so the sum is split in two levels. For each
die `d` holding some of the token's experts, over its k in ascending order, from +0.0:

    part_d = part_d + np.float32(topk_weights[slot, k]) * row(slot, k)    # float32, unrounded row

then `part_d` is rounded to the combine dtype once (as a row above), and, in ascending order of
each die's smallest k (`k_d`), from +0.0:

    out = out + np.float32(1.0) * part_d

so the result differs from the plain combine (the bfloat16 rounding moves after the weights)
and is bit-exact against this.

Disaggregated pods (§8): `a2e_ref` / `e2a_ref` are the same collectives with attention dies as
sources and a placement over the expert dies; trampoline forwarding moves bytes differently but
must deliver exactly these outputs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from comm.quant import combine_dtype, dequantize_int8, quantize_int8, round_combine
from comm.routing import Placement, check_topk_idx, get_dispatch_layout

__all__ = [
    "QUANT_MODES",
    "DispatchOut",
    "a2e_ref",
    "combine_ref",
    "dedup_sum",
    "dequantize_dispatch",
    "dispatch_ref",
    "e2a_ref",
    "moe_ref",
]

QUANT_MODES = (None, "int8")


def _frozen(arr: np.ndarray) -> np.ndarray:
    arr = np.ascontiguousarray(arr)
    arr.flags.writeable = False
    return arr


@dataclass(frozen=True, eq=False)
class DispatchOut:
    """What one expert die receives from a dispatch, rows in the canonical order.

    Fields (`n_rows` = messages received by this die from all sources; arrays read-only):
        x: float32 `[n_rows, hidden]`, or int8 when quantized: the token rows.
        scales: float32 `[n_rows]`, the per-token INT8 scale of each row, or None if not quantized.
        src_rank: int64 `[n_rows]`, the source die (rank) of each row.
        batch_slot: int64 `[n_rows]`, the row's slot in its source's batch.
        k_index: int64 `[n_rows]`, the column of the source's `topk_idx` that routed it here.
        local_expert: int64 `[n_rows]`, the local expert index on this die; non-decreasing.
        expert_counts: int64 `[num_local_experts]`, rows per local expert; the rows of local expert
            `j` are `sum(expert_counts[:j]) : sum(expert_counts[:j + 1])`.
    """

    x: np.ndarray
    scales: np.ndarray | None
    src_rank: np.ndarray
    batch_slot: np.ndarray
    k_index: np.ndarray
    local_expert: np.ndarray
    expert_counts: np.ndarray

    @property
    def num_rows(self) -> int:
        return int(self.src_rank.size)


def dequantize_dispatch(out: DispatchOut) -> DispatchOut:
    """The same rows with float32 `x` (dequantized if int8) and `scales=None`.

    Arguments:
        out: a `DispatchOut`, quantized or not.

    Returns:
        out_f32: a `DispatchOut` with `x` float32 `[n_rows, hidden]` = `q * scale` per row (or `out`
            itself when it is not quantized).
    """
    if out.scales is None:
        return out
    return replace(out, x=_frozen(dequantize_int8(out.x, out.scales)), scales=None)


# -- input checks ----------------------------------------------------------------------------------


def _check_sources(n: int, src_ranks, name: str = "src_ranks") -> list[int]:
    ranks = list(range(n)) if src_ranks is None else list(src_ranks)
    if len(ranks) != n:
        raise ValueError(f"{name}: expected {n} ranks (one per source), got {len(ranks)}")
    for i, r in enumerate(ranks):
        if isinstance(r, bool) or not isinstance(r, int | np.integer) or r < 0:
            raise TypeError(f"{name}[{i}]: expected a die id (int >= 0), got {r!r}")
    if len(set(ranks)) != n:
        raise ValueError(f"{name}: source ranks must be distinct, got {ranks}")
    return [int(r) for r in ranks]


def _check_dispatch_inputs(xs, topk_idxs, placement, quant) -> list[np.ndarray]:
    """Validate `dispatch_ref` arguments; returns the routing tables as int64 arrays."""
    if not isinstance(placement, Placement):
        raise TypeError(f"placement: expected a Placement, got {type(placement).__name__}")
    if quant not in QUANT_MODES:
        raise ValueError(f"quant: expected one of {QUANT_MODES}, got {quant!r}")
    if len(xs) == 0 or len(xs) != len(topk_idxs):
        raise ValueError(
            f"xs, topk_idxs: expected one entry per source (at least one), "
            f"got {len(xs)} and {len(topk_idxs)}"
        )
    hidden = None
    topks = []
    for i, (x, topk) in enumerate(zip(xs, topk_idxs, strict=True)):
        if not isinstance(x, np.ndarray) or x.dtype != np.float32:
            raise TypeError(f"xs[{i}]: expected a float32 array, got {getattr(x, 'dtype', x)!r}")
        if x.ndim != 2 or (hidden is not None and x.shape[1] != hidden):
            raise ValueError(
                f"xs[{i}]: expected shape [batch, {hidden or 'hidden'}], got {x.shape}"
            )
        hidden = x.shape[1]
        topk = check_topk_idx(topk, placement.num_experts, f"topk_idxs[{i}]")
        if topk.shape[0] != x.shape[0]:
            raise ValueError(
                f"topk_idxs[{i}]: has {topk.shape[0]} rows but xs[{i}] has {x.shape[0]} tokens"
            )
        topks.append(topk)
    return topks


# -- dispatch --------------------------------------------------------------------------------------


def dispatch_ref(
    xs: Sequence[np.ndarray],
    topk_idxs: Sequence[np.ndarray],
    placement: Placement,
    quant: str | None = None,
    src_ranks: Sequence[int] | None = None,
) -> dict[int, DispatchOut]:
    """Reference dispatch: every routed (token, k) pair delivered to the die of its expert.

    Arguments:
        xs: one float32 `[b_i, hidden]` per source, the tokens of source rank `src_ranks[i]`;
            `b_i` may differ between sources (and be 0), `hidden` may not.
        topk_idxs: one int `[b_i, k_i]` per source, logical expert ids, -1 = not routed.
        placement: maps logical experts to (die, local expert); its `dies` are the receivers.
        quant: None (send float32 rows) or "int8" (quantize each source token once with
            `quantize_int8`, send `q` and its scale; outputs keep int8 + scales).
        src_ranks: die id of each source, distinct; default `0..len(xs)-1`.

    Returns:
        outs: `{die: DispatchOut}` for every die of `placement.dies` (empty outputs included),
            rows in the canonical order (local expert, src_rank, batch_slot, k_index).
    """
    topks = _check_dispatch_inputs(xs, topk_idxs, placement, quant)
    ranks = _check_sources(len(xs), src_ranks)
    # Per source: its messages (canonical send order) and its payload, quantized once per token.
    sent = []
    for x, topk, rank in zip(xs, topks, ranks, strict=True):
        payload, scales = quantize_int8(x) if quant == "int8" else (x, None)
        sent.append((rank, get_dispatch_layout(topk, placement), payload, scales))
    hidden = xs[0].shape[1]
    return {
        die: _receive(sent, placement, p, hidden, quant) for p, die in enumerate(placement.dies)
    }


def _receive(sent, placement: Placement, p: int, hidden: int, quant) -> DispatchOut:
    """Collect the messages of every source for the die at position `p`, in canonical order."""
    parts = {name: [] for name in ("x", "scales", "src", "slot", "k", "local")}
    for rank, layout, payload, scales in sent:
        lo, hi = layout.dest_offsets[p], layout.dest_offsets[p + 1]
        slot = layout.msg_slot[lo:hi]
        parts["x"].append(payload[slot])
        parts["scales"].append(scales[slot] if scales is not None else np.zeros(0, np.float32))
        parts["src"].append(np.full(hi - lo, rank, dtype=np.int64))
        parts["slot"].append(slot)
        parts["k"].append(layout.msg_k[lo:hi])
        parts["local"].append(layout.msg_local_expert[lo:hi])
    cat = {name: np.concatenate(arrs) for name, arrs in parts.items()}
    order = np.lexsort((cat["k"], cat["slot"], cat["src"], cat["local"]))
    x_dtype = np.int8 if quant == "int8" else np.float32
    num_local = placement.num_local(placement.dies[p])
    return DispatchOut(
        x=_frozen(cat["x"][order].astype(x_dtype, copy=False)),
        scales=_frozen(cat["scales"][order]) if quant == "int8" else None,
        src_rank=_frozen(cat["src"][order]),
        batch_slot=_frozen(cat["slot"][order].astype(np.int64)),
        k_index=_frozen(cat["k"][order].astype(np.int64)),
        local_expert=_frozen(cat["local"][order].astype(np.int64)),
        expert_counts=_frozen(np.bincount(cat["local"], minlength=num_local).astype(np.int64)),
    )


# -- combine ---------------------------------------------------------------------------------------


def _check_expert_outs(expert_outs, dispatch_outs) -> int:
    """Validate expert outputs against their dispatch outputs; returns `hidden`."""
    if set(expert_outs) != set(dispatch_outs):
        raise ValueError(
            f"expert_outs: expected one entry per die {sorted(dispatch_outs)}, "
            f"got {sorted(expert_outs)}"
        )
    hidden = None
    for die in sorted(dispatch_outs):
        y, d = expert_outs[die], dispatch_outs[die]
        if not isinstance(d, DispatchOut):
            raise TypeError(f"dispatch_outs[{die}]: expected a DispatchOut, got {type(d).__name__}")
        if not isinstance(y, np.ndarray) or y.dtype != np.float32:
            raise TypeError(f"expert_outs[{die}]: expected float32, got {getattr(y, 'dtype', y)!r}")
        if y.ndim != 2 or y.shape[0] != d.num_rows or (hidden is not None and y.shape[1] != hidden):
            raise ValueError(
                f"expert_outs[{die}]: expected shape [{d.num_rows}, {hidden or 'hidden'}] "
                f"(one row per dispatched row), got {y.shape}"
            )
        hidden = y.shape[1]
    return hidden


def _check_topk_shape(topk, name: str) -> np.ndarray:
    """int64 `[batch, k]` without range check (combine does not know num_experts)."""
    topk = np.asarray(topk)
    if topk.dtype.kind not in "iu":
        raise TypeError(f"{name}: expected an integer array, got dtype {topk.dtype}")
    if topk.ndim != 2:
        raise ValueError(f"{name}: expected shape [batch, k], got shape {topk.shape}")
    return topk.astype(np.int64, copy=False)


def _check_weights(topk_idxs, topk_weights) -> list[np.ndarray]:
    if len(topk_weights) != len(topk_idxs):
        raise ValueError(
            f"topk_weights: expected one entry per source ({len(topk_idxs)}), "
            f"got {len(topk_weights)}"
        )
    out = []
    for i, (w, topk) in enumerate(zip(topk_weights, topk_idxs, strict=True)):
        w = np.asarray(w)
        if w.dtype.kind != "f":
            raise TypeError(f"topk_weights[{i}]: expected a float array, got dtype {w.dtype}")
        if w.shape != np.shape(topk):
            raise ValueError(
                f"topk_weights[{i}]: expected shape {np.shape(topk)} (as topk_idxs[{i}]), "
                f"got {w.shape}"
            )
        out.append(w.astype(np.float32))
    return out


def _gather_rows(expert_outs, dispatch_outs, rank: int, topk: np.ndarray, hidden: int):
    """`rows[slot, k]`: expert output row of origin (rank, slot, k); `routed` = `topk >= 0`;
    `die[slot, k]`: the die that returned it (-1 if unrouted)."""
    rows = np.zeros((*topk.shape, hidden), dtype=np.float32)
    seen = np.zeros(topk.shape, dtype=np.int64)
    die_of = np.full(topk.shape, -1, dtype=np.int64)
    for die in sorted(dispatch_outs):
        d = dispatch_outs[die]
        mine = d.src_rank == rank
        slot, k = d.batch_slot[mine], d.k_index[mine]
        if slot.size and (slot.max() >= topk.shape[0] or k.max() >= topk.shape[1]):
            raise ValueError(f"dispatch_outs[{die}]: rows of rank {rank} outside its topk shape")
        rows[slot, k] = expert_outs[die][mine]
        die_of[slot, k] = die
        np.add.at(seen, (slot, k), 1)
    routed = topk >= 0
    if not np.array_equal(seen, routed.astype(np.int64)):
        slot, k = (int(v) for v in np.argwhere(seen != routed)[0])
        raise ValueError(
            f"dispatch_outs: rank {rank} (slot {slot}, k {k}) has {seen[slot, k]} rows, expected "
            f"{int(routed[slot, k])} (topk_idx {topk[slot, k]})"
        )
    return rows, routed, die_of


def combine_ref(
    expert_outs: dict[int, np.ndarray],
    dispatch_outs: dict[int, DispatchOut],
    topk_idxs: Sequence[np.ndarray],
    topk_weights: Sequence[np.ndarray],
    src_ranks: Sequence[int] | None = None,
    combine_dtype: str = "bfloat16",
    dedup: bool = False,
) -> list[np.ndarray]:
    """Reference combine: weighted sum of each token's expert outputs, back on its source die.

    Arguments:
        expert_outs: `{die: float32 [n_rows, hidden]}`, row `j` is the expert output of row `j` of
            `dispatch_outs[die]`; same keys as `dispatch_outs`.
        dispatch_outs: `{die: DispatchOut}` from `dispatch_ref` (only the origin columns are used).
        topk_idxs: one int `[b_i, k_i]` per source, as given to the dispatch (-1 = not routed).
        topk_weights: one float `[b_i, k_i]` per source; converted to float32 first.
        src_ranks: die id of each source, as given to the dispatch; default `0..len-1`.
        combine_dtype: "bfloat16" (rows rounded to bfloat16 on the way, as a pod's default
            `a2a_combine_dtype`) or "float32".
        dedup: the two-level sum of a dedup combine (module docstring): per die, then over dies.

    Returns:
        outs: one float32 `[b_i, hidden]` per source, `out[slot] = sum over routed k, ascending, of
            float32(w[slot, k]) * row(slot, k)`, accumulated exactly as the module docstring says;
            zeros for a token with no routed k.
    """
    if not isinstance(dedup, bool | np.bool_):
        raise TypeError(f"dedup: expected a bool, got {type(dedup).__name__}")
    cdt = _combine_dtype(combine_dtype)
    hidden = _check_expert_outs(expert_outs, dispatch_outs)
    topks = [_check_topk_shape(t, f"topk_idxs[{i}]") for i, t in enumerate(topk_idxs)]
    weights = _check_weights(topks, topk_weights)
    ranks = _check_sources(len(topks), src_ranks)
    unknown = sorted({int(r) for d in dispatch_outs.values() for r in d.src_rank} - set(ranks))
    if unknown:
        raise ValueError(f"dispatch_outs: rows from ranks {unknown}, not among src_ranks {ranks}")
    outs = []
    for rank, topk, w in zip(ranks, topks, weights, strict=True):
        rows, routed, die_of = _gather_rows(expert_outs, dispatch_outs, rank, topk, hidden)
        if dedup:
            outs.append(dedup_sum(rows, routed, die_of, w, cdt))
            continue
        rows = round_combine(rows, cdt)
        out = np.zeros((topk.shape[0], hidden), dtype=np.float32)
        for k in range(topk.shape[1]):  # ascending k: the fixed accumulation order
            sel = routed[:, k]
            prod = w[sel, k][:, None] * rows[sel, k]  # float32 * float32, rounded once
            out[sel] = out[sel] + prod  # float32 add, rounded once
        outs.append(out)
    return outs


def dedup_sum(
    rows: np.ndarray, routed: np.ndarray, die_of: np.ndarray, w: np.ndarray, cdt: np.dtype
) -> np.ndarray:
    """The two-level sum of a dedup combine for one source (module docstring).

    rows: float32 [batch, k, hidden], row (slot, k); routed: bool [batch, k]; die_of: int
    [batch, k], the die of each routed (slot, k); w: float32 [batch, k]; cdt: the combine
    dtype each die's partial sum is rounded to. Returns float32 [batch, hidden]."""
    batch, n_k, hidden = rows.shape
    first = np.zeros((batch, n_k), dtype=np.int64)  # k_d of the die of (slot, k)
    for k in range(n_k):
        first[:, k] = k
        for j in range(k - 1, -1, -1):  # the smallest earlier k on the same die
            same = routed[:, j] & (die_of[:, j] == die_of[:, k])
            first[same, k] = j
    part = np.zeros_like(rows)
    slots = np.arange(batch)
    for k in range(n_k):  # ascending k within each die's partial sum
        sel = routed[:, k]
        f = first[sel, k]
        part[slots[sel], f] = part[slots[sel], f] + w[sel, k][:, None] * rows[sel, k]
    part = round_combine(part, cdt)
    out = np.zeros((batch, hidden), dtype=np.float32)
    one = np.float32(1.0)
    for k in range(n_k):  # ascending k_d over the dies
        sel = routed[:, k] & (first[:, k] == k)
        out[sel] = out[sel] + one * part[sel, k]
    return out


def _combine_dtype(name) -> np.dtype:
    try:
        return combine_dtype(name)
    except ValueError:
        raise ValueError(f"combine_dtype: {name!r} must be 'bfloat16' or 'float32'") from None


# -- disaggregated wrappers and the whole MoE layer ------------------------------------------------


def _check_att_dies(att_dies, n: int, placement: Placement) -> list[int]:
    ranks = _check_sources(n, att_dies, "att_dies")
    shared = sorted(set(ranks) & set(placement.dies))
    if shared:
        raise ValueError(
            f"att_dies: dies {shared} are also expert dies {placement.dies}; a disaggregated pod "
            f"keeps attention and expert dies apart (use dispatch_ref for co-located experts)"
        )
    return ranks


def a2e_ref(xs, topk_idxs, placement: Placement, att_dies, quant=None) -> dict[int, DispatchOut]:
    """Reference A2E (attention -> expert dies, docs/protocols.md §8): `dispatch_ref` with the
    attention dies as sources and `placement` over the expert dies.

    The two stages through the trampolines (A2E, then A2E') must deliver exactly this; the
    trampoline is invisible in the result (`src_rank` is the attention die, not the trampoline).

    Arguments:
        xs, topk_idxs, quant: as in `dispatch_ref`, one entry per attention die.
        placement: `Placement` over the expert dies.
        att_dies: die id of each attention die (the sources), disjoint from `placement.dies`.

    Returns:
        outs: `{expert die: DispatchOut}`, as `dispatch_ref`.
    """
    ranks = _check_att_dies(att_dies, len(xs), placement)
    return dispatch_ref(xs, topk_idxs, placement, quant=quant, src_ranks=ranks)


def e2a_ref(
    expert_outs, dispatch_outs, topk_idxs, topk_weights, att_dies, combine_dtype: str = "bfloat16"
) -> list[np.ndarray]:
    """Reference E2A (expert -> attention, docs/protocols.md §8): `combine_ref` with the attention
    dies as sources. E2A + E2A' through the trampolines must give these outputs bit for bit.

    Arguments:
        expert_outs, dispatch_outs, topk_idxs, topk_weights, combine_dtype: as in `combine_ref`.
        att_dies: die id of each attention die, as given to `a2e_ref`.

    Returns:
        outs: one float32 `[b_i, hidden]` per attention die, as `combine_ref`.
    """
    ranks = _check_sources(len(topk_idxs), att_dies, "att_dies")
    return combine_ref(expert_outs, dispatch_outs, topk_idxs, topk_weights, src_ranks=ranks,
                       combine_dtype=combine_dtype)  # fmt: skip


def moe_ref(
    xs: Sequence[np.ndarray],
    topk_idxs: Sequence[np.ndarray],
    topk_weights: Sequence[np.ndarray],
    placement: Placement,
    expert_fn: Callable[[int, DispatchOut], np.ndarray],
    quant: str | None = None,
    src_ranks: Sequence[int] | None = None,
    combine_dtype: str = "bfloat16",
    dedup: bool = False,
) -> list[np.ndarray]:
    """Reference routed-expert MoE layer: dispatch, run the experts, combine.

    Arguments:
        xs, topk_idxs, topk_weights, placement, quant, src_ranks, combine_dtype, dedup: as in
            `dispatch_ref` and `combine_ref`.
        expert_fn: `expert_fn(die, out) -> float32 [out.num_rows, hidden]`, called once per die of
            `placement.dies` in order, with `out` already dequantized (`dequantize_dispatch`: `x`
            float32, `scales=None`) so experts see what the expert die computes on.

    Returns:
        outs: one float32 `[b_i, hidden]` per source, as `combine_ref`.
    """
    dispatched = dispatch_ref(xs, topk_idxs, placement, quant=quant, src_ranks=src_ranks)
    expert_outs = {die: expert_fn(die, dequantize_dispatch(d)) for die, d in dispatched.items()}
    return combine_ref(expert_outs, dispatched, topk_idxs, topk_weights, src_ranks=src_ranks,
                       combine_dtype=combine_dtype, dedup=dedup)  # fmt: skip
