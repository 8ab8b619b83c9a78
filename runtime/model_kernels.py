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


def warm() -> None:
    """Compile or load the kernels (a pod calls it before its dies fork)."""
    mm(np.zeros((2, 4), np.float32), np.zeros((4, 3), np.float32))
    mm(np.zeros((2, 2, 4), np.float32), np.zeros((2, 4, 3), np.float32))
