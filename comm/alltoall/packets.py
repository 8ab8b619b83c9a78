"""Dispatch packets, as the pull, fused and A2E paths share them: dedup rows packed on the
source, and received rows grouped by local expert (step 7), each in compiled passes."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from comm.alltoall.handles import DedupGroups, DispatchResult, dispatch_result
from comm.alltoall.state import kernels, place_info
from comm.endpoint import Endpoint
from comm.routing import DedupLayout, DispatchLayout, Placement
from memory import layout as L
from memory.errors import ProtocolError


def assemble(ep: Endpoint, parts: list, pb: int, quant: str | None, placement: Placement,
             lay: DispatchLayout | None, topk_idx: np.ndarray, topk_weights: np.ndarray,
             op: int, proto: str) -> DispatchResult:  # fmt: skip
    """Step 7: rows grouped by local expert, stable, so (src_rank, slot, k) order stays.

    `parts` is a list of (src, uint8 [count, stride] rows), own or remote memory. Two compiled
    passes (`comm.kernels.assemble_count`, `assemble_place`: a counting sort by local expert);
    each payload is copied once, straight from the (possibly remote) row to its place."""
    k = kernels()
    hidden = ep.layout.a2a_hidden
    stride = ep.layout.pull_disp_stride
    n_local = place_info(ep, placement).num_local[ep.die_id]
    counts = np.zeros(n_local, np.int64)
    flats = []
    for src, rows in parts:
        n = len(rows)
        if not n:
            continue
        flat8 = rows.reshape(-1)
        flat32 = flat8.view(np.int32)
        if k.assemble_count(flat32, n, stride, counts) < 0:
            raise ProtocolError(
                f"die {ep.die_id}: dispatch rows from die {src} name a local expert outside"
                f" [0, {n_local}) (not dispatch packets of this placement): nothing read"
            )
        flats.append((src, n, flat8, flat32))
    total = int(counts.sum())
    cursor = np.zeros(n_local, np.int64)
    np.cumsum(counts[:-1], out=cursor[1:])
    dt = np.int8 if quant == "int8" else np.float32
    x = np.empty((total, hidden), dt)
    scale_bits = np.empty(total, np.int32)
    src_rank, slot, k_index, local = np.empty((4, total), np.int64)
    x8 = x.view(np.uint8).reshape(total, pb)
    for src, n, flat8, flat32 in flats:  # the one copy (a pull: a remote read)
        k.assemble_place(flat8, flat32, n, stride, pb, src, cursor, x8, scale_bits, src_rank,
                         slot, k_index, local)  # fmt: skip
    scales = scale_bits.view(np.float32) if quant == "int8" else None
    rows = (x, scales, src_rank, slot, k_index, local, counts)
    return dispatch_result(proto, quant, placement, lay, topk_idx, topk_weights, op, rows)


def payload_bits(payload: np.ndarray, pb: int, scale: np.ndarray) -> tuple:
    """(payload as uint8 [batch, pb], scales as int32 bits): what the raw pack kernels take."""
    src8 = np.ascontiguousarray(payload).view(np.uint8).reshape(len(payload), pb)
    return src8, np.ascontiguousarray(scale, np.float32).view(np.int32)


def dedup_packer(
    src8: np.ndarray, scale_bits: np.ndarray, dl: DedupLayout, stride: int
) -> Callable[[int, int, np.ndarray, np.ndarray], None]:
    """`pack(a, b, flat8, flat32)`: dedup rows a:b of `dl` (one per token and destination die)
    into the rows of flat8 / flat32 (a send area or a peer's block, `stride` bytes apart),
    from src8 (the payload as uint8 [batch, bytes]) and scale_bits (the scales' int32 bits).
    One compiled pass without the wrapper's per-call checks (`kernels.pack_dedup_rows_raw`):
    the layout is this die's own, each row's entries at most min(topk, its die's experts),
    which the stride holds (memory.layout sizes it; `check_placement` caps the experts per die)."""
    raw = kernels().pack_dedup_rows_raw
    eoff = L.dedup_entries_off(src8.shape[1])
    most = (stride - L.PULL_ROW_META - eoff) // L.DEDUP_ENTRY
    slots, start, ks, locs, w = dl.row_slot, dl.ent_start, dl.ent_k, dl.ent_local, dl.ent_w

    def pack(a: int, b: int, flat8: np.ndarray, flat32: np.ndarray) -> None:
        if raw(src8, scale_bits, slots[a:b], start[a : b + 1], ks, locs, w, flat8, flat32, stride,
               eoff, most):  # fmt: skip
            raise ProtocolError(
                f"dedup rows [{a}, {b}): a slot, an entry range or more than {most} entries a"
                f" row (stride {stride}) outside what the layout allows; nothing written"
            )

    return pack


def assemble_dedup(ep: Endpoint, parts: list, pb: int, quant: str | None, placement: Placement,
                   lay: DispatchLayout | None, topk_idx: np.ndarray, topk_weights: np.ndarray,
                   op: int, proto: str, dl: DedupLayout) -> DispatchResult:  # fmt: skip
    """Step 7 of a dedup dispatch: each received row is expanded into one output row per entry
    of its list, grouped by local expert as `assemble` (entries ascend in k within a row, rows
    in slot order within a source, so the output is the same as without dedup). Two compiled
    passes (`comm.kernels.dedup_count`, `dedup_place`: a counting sort by local expert); each
    payload is copied once per entry, straight from the (possibly remote) row to its place."""
    lo = ep.layout
    k = kernels()
    hidden, stride, topk = lo.a2a_hidden, lo.pull_disp_stride, lo.a2a_topk
    most = min(topk, lo.a2a_experts_per_die)
    eoff = L.dedup_entries_off(pb)
    n_local = place_info(ep, placement).num_local[ep.die_id]
    counts = np.zeros(n_local, np.int64)
    flats = [(src, rows.reshape(-1), len(rows)) for src, rows in parts if len(rows)]
    m = 0
    for src, flat, n in flats:
        got = k.dedup_count(flat, n, stride, eoff, most, topk, counts)
        if got < 0:
            raise ProtocolError(
                f"die {ep.die_id}: dedup dispatch rows from die {src} carry entry counts outside"
                f" [1, {most}], k outside [0, {topk}) or local experts outside [0, {n_local}) (or"
                " are not dedup rows): out of step with the protocol; nothing read"
            )
        m += got
    total = sum(n for _, _, n in flats)
    cursor = np.zeros(n_local, np.int64)
    np.cumsum(counts[:-1], out=cursor[1:])
    dt = np.int8 if quant == "int8" else np.float32
    x = np.empty((m, hidden), dt)
    bits = np.empty((2, m), np.int32)  # per output row its scale, per entry its weight
    meta = np.empty((5, m), np.int64)  # per output row its origin; per entry its output row
    grp = np.empty((3, total), np.int64)  # per group its source, slot and first k
    src_rank, slot, k_index, local, pos = meta
    start = np.zeros(total + 1, np.int64)
    x8 = x.view(np.uint8).reshape(m, pb)
    g0 = 0
    for src, flat, n in flats:
        k.dedup_place(flat, n, stride, eoff, src, cursor, g0, x8, bits, meta, grp, start)
        g0 += n
    scale_bits, w_bits = bits
    g_src, g_slot, g_kfirst = grp
    scales = scale_bits.view(np.float32) if quant == "int8" else None
    groups = DedupGroups(src=g_src, slot=g_slot, kfirst=g_kfirst, start=start, pos=pos,
                         w=w_bits.view(np.float32))  # fmt: skip
    rows = (x, scales, src_rank, slot, k_index, local, counts)
    return dispatch_result(
        proto, quant, placement, lay, topk_idx, topk_weights, op, rows, dl, groups
    )
