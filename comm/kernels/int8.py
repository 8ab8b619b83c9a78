"""`comm.quant.quantize_int8` (INT8 early quantization, per token) in two compiled passes."""

from __future__ import annotations

import numba
import numpy as np

from comm.kernels.common import ro

_t = numba.types


@numba.njit(_t.void(ro(_t.uint32, 2), _t.uint32[::1]), cache=True, nogil=True,
            boundscheck=False)  # fmt: skip
def _row_amax(bits, amax):  # pragma: no cover - compiled
    """amax[r] = the float32 bits of max |x[r]| (0 for an empty row), from x's bits: with the
    sign cleared, float order is integer order, and an integer max vectorizes (a float max
    reduction would need fast-math); bits >= 0x7F800000 mean the row holds inf or NaN."""
    n, h = bits.shape
    mag = np.uint32(0x7FFFFFFF)
    for r in range(n):
        row = bits[r]
        m = np.uint32(0)
        for c in range(h):
            m = max(m, row[c] & mag)
        amax[r] = m


@numba.njit(_t.void(ro(_t.float32, 2), ro(_t.float32, 1), _t.int8[:, ::1]), cache=True,
            nogil=True, boundscheck=False)  # fmt: skip
def _quantize_rows(x, scale, q):  # pragma: no cover - compiled
    """q[r, c] = clip(rint(x[r, c] / scale[r]), -127, 127): float32 division, round half to
    even, as comm.quant.quantize_int8."""
    n, h = x.shape
    lo, hi = np.float32(-127.0), np.float32(127.0)
    for r in range(n):
        row, out, s = x[r], q[r], scale[r]
        for c in range(h):
            v = np.rint(row[c] / s)
            out[c] = np.int8(min(max(v, lo), hi))


def quantize_int8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`comm.quant.quantize_int8` of float32 `[n, hidden]` rows in two compiled passes (the row
    maxima, then the quantization), bit for bit its result; a row with inf or NaN is handed to
    it, which raises its ValueError naming the element."""
    from comm.quant import quantize_int8 as reference
    from comm.quant import row_scales

    if not isinstance(x, np.ndarray) or x.dtype != np.float32 or x.ndim != 2:
        return reference(x)  # its checks and messages
    x = np.ascontiguousarray(x)
    amax = np.empty(len(x), np.float32)
    _row_amax(x.view(np.uint32), amax.view(np.uint32))
    if not np.isfinite(amax).all():
        return reference(x)  # raises, naming the first non-finite element
    scale = row_scales(amax)
    q = np.empty(x.shape, np.int8)
    _quantize_rows(x, scale, q)
    return q, scale
