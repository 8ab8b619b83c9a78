"""Compiled matrix products of the toy model for a die's few rows (numba).

A decode step gives each die one row per request, often 2-3. numpy hands `x @ W` with 2-3 rows to
the BLAS GEMM, whose fixed cost (packing W for a blocked product) is that of 8 rows: on the 2-core
machines xpod runs on, `[2, 256] @ [256, 512]` costs 33 us in OpenBLAS and 19 us here, `[3, ...]`
47 against 21; one row (BLAS's GEMV) and 4 or more rows are as fast in BLAS. So `mm` uses this
kernel for 2 to `SMALL_ROWS` rows and BLAS otherwise.

The kernel accumulates each output over the inner dimension in ascending order in float64 (every
product exact) and rounds once: a row's result does not depend on the other rows of the call, and
it is closer to the exact product than BLAS's float32 sums (max error 2e-6 against 4e-5 for
`[2, 256] @ [256, 512]` of unit normals). It is not bit-equal to BLAS; the pod and its references
call the same `mm` on the same rows per die, so `--check` and the schedule replays stay bit-equal.
"""

from __future__ import annotations

import numba
import numpy as np

SMALL_ROWS = 3  # rows up to which the kernel beats BLAS here (measured: 2.5-4x at 2 rows)

_F32_2D = numba.types.float32[:, ::1]
_F32_3D = numba.types.float32[:, :, ::1]
_RO_F32_2D = numba.types.Array(numba.types.float32, 2, "C", readonly=True)
_RO_F32_3D = numba.types.Array(numba.types.float32, 3, "C", readonly=True)


@numba.njit(numba.types.void(_RO_F32_2D, _RO_F32_2D, _F32_2D), cache=True, nogil=True,
            boundscheck=False)  # fmt: skip
def _mm(x, w, out):  # pragma: no cover - compiled
    """out = x @ w: per row, W's rows scaled and added in ascending k (one pass over W a row),
    in float64 (each product exact, the sum rounded once to float32: at least as accurate as
    BLAS's float32 sums)."""
    m, k_n = x.shape
    n = w.shape[1]
    acc = np.empty(n, np.float64)
    for i in range(m):
        for c in range(n):
            acc[c] = 0.0
        for k in range(k_n):
            a = np.float64(x[i, k])
            wr = w[k]
            for c in range(n):
                acc[c] += a * np.float64(wr[c])
        o = out[i]
        for c in range(n):
            o[c] = np.float32(acc[c])


@numba.njit(numba.types.void(_RO_F32_3D, _RO_F32_3D, _F32_3D), cache=True, nogil=True,
            boundscheck=False)  # fmt: skip
def _bmm(x, w, out):  # pragma: no cover - compiled
    """out[h] = x[h] @ w[h] for every h, as `_mm`."""
    for h in range(x.shape[0]):
        _mm(x[h], w[h], out[h])


def mm(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """`x @ w` for float32 x `[m, k]` (or `[h, m, k]` with w `[h, k, n]`): the kernel for 2 to
    SMALL_ROWS rows of C-contiguous float32 weights, BLAS otherwise (one row is BLAS's GEMV,
    which is as fast)."""
    if not 2 <= x.shape[-2] <= SMALL_ROWS or x.dtype != np.float32 or w.dtype != np.float32 or (
        not w.flags.c_contiguous or x.ndim != w.ndim or x.ndim not in (2, 3)
    ):  # fmt: skip
        return x @ w
    x = np.ascontiguousarray(x)
    out = np.empty((*x.shape[:-1], w.shape[-1]), np.float32)
    (_mm if x.ndim == 2 else _bmm)(x, w, out)
    return out


_RO_F32_1D = numba.types.Array(numba.types.float32, 1, "C", readonly=True)
_RO_F32_2A = numba.types.Array(numba.types.float32, 2, "A", readonly=True)
_RO_F32_3A = numba.types.Array(numba.types.float32, 3, "A", readonly=True)


@numba.njit(numba.types.void(_RO_F32_2A, _RO_F32_1D, numba.types.float32, _F32_2D), cache=True,
            nogil=True, boundscheck=False)  # fmt: skip
def _rms_norm(x, weight, eps, out):  # pragma: no cover - compiled
    """out[i] = (x[i] * (1 / sqrt(mean(x[i]^2) + eps))) * weight: the mean of squares summed in
    float64 (every square exact) and rounded once; the rest float32 operations, in this order."""
    n, d = x.shape
    for i in range(n):
        row = x[i]
        acc = 0.0
        for c in range(d):
            v = np.float64(row[c])
            acc += v * v
        ms = np.float32(acc / d)
        inv = np.float32(1.0) / np.float32(np.sqrt(ms + eps))
        o = out[i]
        for c in range(d):
            o[c] = (row[c] * inv) * weight[c]


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm of float32 rows `[n, d]` (any strides) by float32 `weight [d]`, in one compiled
    call: numpy's mean, sqrt, divide and two multiplies were 5 calls, ~11 us for a die's 2 rows
    (17 norms per decode step of a die), this is ~1 us. Other shapes: the caller's numpy."""
    out = np.empty(x.shape, np.float32)
    _rms_norm(x, np.ascontiguousarray(weight), np.float32(eps), out)
    return out


@numba.njit(numba.types.void(_RO_F32_3A, _RO_F32_2A, _RO_F32_2A, _F32_3D), cache=True,
            nogil=True, boundscheck=False)  # fmt: skip
def _rope(x, cos, sin, out):  # pragma: no cover - compiled
    """out[i, h] pairs (x0 c - x1 s, x0 s + x1 c) with c, s of row i: float32 products and
    sums in numpy's order (numba contracts nothing into a fused multiply-add)."""
    n, nh, p = x.shape
    for i in range(n):
        for h in range(nh):
            src, dst = x[i, h], out[i, h]
            for j in range(p // 2):
                x0, x1 = src[2 * j], src[2 * j + 1]
                c, s = cos[i, j], sin[i, j]
                dst[2 * j] = x0 * c - x1 * s
                dst[2 * j + 1] = x0 * s + x1 * c


def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """`runtime.model.apply_rope` of float32 `[n, H, rope_dim]` (any strides) in one compiled
    call, bit for bit numpy's (6 calls before)."""
    out = np.empty(x.shape, np.float32)
    _rope(x, cos, sin, out)
    return out


def warm() -> None:
    """Compile or load the kernels (a pod calls it before its dies fork)."""
    mm(np.zeros((2, 4), np.float32), np.zeros((4, 3), np.float32))
    mm(np.zeros((2, 2, 4), np.float32), np.zeros((2, 4, 3), np.float32))
    rms_norm(np.ones((2, 4), np.float32), np.ones(4, np.float32), 1e-6)
    rope(np.ones((2, 1, 4), np.float32), np.ones((2, 2), np.float32), np.ones((2, 2), np.float32))
