"""Views of the all-to-all areas in any die's region (its own or a peer's), bounds checked.

Pull send rows, fused dispatch blocks, fused combine buffers and meta words; the views used on
every call are made once and kept in `ep.a2a.views`.
"""

from __future__ import annotations

import numpy as np

from comm.alltoall.fields import DISPATCH
from comm.endpoint import Endpoint
from comm.quant import combine_dtype
from memory.errors import ProtocolError


def area_check(ep: Endpoint, what: str, start: int, count: int, capacity: int) -> None:
    """The last line of defence: never read or write rows outside an area."""
    if start < 0 or count < 0 or start + count > capacity:
        raise ProtocolError(
            f"die {ep.die_id}: {what}: rows [{start}, {start + count}) outside the area of"
            f" {capacity} rows; nothing written"
        )


def pull_rows(ep: Endpoint, die: int, kind: int, half: int, start: int, count: int) -> np.ndarray:
    """uint8 [count, stride] view of a die's pull send rows (its own or a peer's: remote read)."""
    lo = ep.layout
    if kind == DISPATCH:
        stride, cap = lo.pull_disp_stride, lo.pull_disp_rows
    else:
        stride, cap = lo.pull_comb_stride, lo.pull_comb_rows
    area_check(ep, f"pull {('dispatch', 'combine')[kind]} rows of die {die}", start, count, cap)
    base = lo.pull_block_off(kind, half) + start * stride
    arr = ep.regions[die].array
    return arr[base : base + count * stride].reshape(count, stride)


def meta_words(ep: Endpoint, die: int, off: int, n: int) -> np.ndarray:
    """int64 numpy view of n meta words of a die's region at byte offset off (made once)."""
    views = ep.a2a.views
    v = views.get((die, off, n))
    if v is None:
        v = views[die, off, n] = ep.regions[die].array[off : off + 8 * n].view(np.int64)
    return v


def fused_rows(ep: Endpoint, die: int, half: int, src: int, count: int) -> np.ndarray:
    """uint8 [count, stride]: the first `count` rows of die's pre-allocated dispatch buffer
    block for src (the bound is checked: never a row outside the block)."""
    lo = ep.layout
    area_check(ep, f"fused dispatch block of die {die} for source {src}", 0, count,
               lo.fused_disp_rows)  # fmt: skip
    base, stride = block_off(ep, half, src), lo.pull_disp_stride
    return ep.regions[die].array[base : base + count * stride].reshape(count, stride)


def block_off(ep: Endpoint, half: int, src: int) -> int:
    """Byte offset of the dispatch block for source src in a die's fused receive area."""
    lo = ep.layout
    return lo.fused_disp_off + (half * ep.num_dies + src) * lo.fused_disp_rows * lo.pull_disp_stride


def comb_dtype(ep: Endpoint) -> np.dtype:
    """The dtype of this pod's combine rows (PodConfig.a2a_combine_dtype)."""
    return combine_dtype(ep.layout.a2a_combine_bytes)


def comb_buf(ep: Endpoint, die: int) -> np.ndarray:
    """[max_batch * topk, comb_stride / element] of the combine dtype: die's fused combine
    buffer, row slot * topk + k."""
    views = ep.a2a.comb_f32
    v = views.get(die)
    if v is None:
        lo = ep.layout
        n, stride = lo.a2a_max_batch * lo.a2a_topk, lo.pull_comb_stride
        raw = ep.regions[die].array[lo.fused_comb_off : lo.fused_comb_off + n * stride]
        cdt = comb_dtype(ep)
        v = views[die] = raw.view(cdt).reshape(n, stride // cdt.itemsize)
    return v


def comb_flat(ep: Endpoint, die: int) -> np.ndarray:
    """uint8 flat view of die's fused combine buffer (rows pull_comb_stride bytes apart)."""
    views = ep.a2a.views
    v = views.get(("comb", die))
    if v is None:
        lo = ep.layout
        n = lo.a2a_max_batch * lo.a2a_topk * lo.pull_comb_stride
        v = views["comb", die] = ep.regions[die].array[lo.fused_comb_off : lo.fused_comb_off + n]
    return v


def comb_flat_elems(ep: Endpoint, die: int) -> np.ndarray:
    """Flat view of die's fused combine buffer in elements, as `reduce_groups_raw` takes it:
    uint16 (bfloat16 bits) or float32 (made once)."""
    views = ep.a2a.views
    v = views.get(("comb_elems", die))
    if v is None:
        v = views["comb_elems", die] = flat_elems(ep, comb_flat(ep, die))
    return v


def flat_elems(ep: Endpoint, flat8: np.ndarray) -> np.ndarray:
    """A flat uint8 view of combine rows as uint16 (bfloat16 bits) or float32 elements."""
    return flat8.view(np.uint16 if ep.layout.a2a_combine_bytes == 2 else np.float32)
