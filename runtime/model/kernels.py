"""Compiled matrix products of the toy model for a die's few rows (numba).

Why: a decode step gives each die one row per request, often 2-3, and numpy hands `x @ W` of
2-3 rows to the BLAS GEMM, whose fixed cost is that of 8 rows; numpy's ~5-20 calls per phase
were likewise a fixed cost per call that made 4 dies of 2 rows run at half the speed of one model
of 8 rows. So `mm` uses this kernel for 2 to `SMALL_ROWS` rows and BLAS otherwise, and RMSNorm,
RoPE, the attention's projections (`mla_in`, `attn_out`), SwiGLU and the gate's top-k choice
(`topk_choice`) take one call each. What they cost: docs/benchmarks.md (the figures this
docstring carried: docs/results/2026-11-25-model-kernels.md).

Numerics: the products accumulate over the inner dimension in ascending order in float64 (every
product exact) and round once: a row's result does not depend on the other rows of the call, and
it is closer to the exact product than BLAS's float32 sums. It is not bit-equal to BLAS; the pod
and its references call the same `mm` on the same rows per die, so `--check` and the schedule
replays stay bit-equal. `mla_in` and `attn_out` run `_mm`, `_rms_norm` and `_rope` in the numpy
path's order (the same bits); `swiglu`'s silu goes through libm's expf (within an ulp of numpy's
SIMD exp); `topk_choice` is numpy's stable argsort bit for bit.
"""

from __future__ import annotations

import numba
import numpy as np

SMALL_ROWS = 3  # rows up to which the kernel beats BLAS on the machines xpod runs on

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


def mm(x: np.ndarray, w: np.ndarray, invariant: bool = False) -> np.ndarray:
    """`x @ w` for float32 x `[m, k]` (or `[h, m, k]` with w `[h, k, n]`): the kernel for 2 to
    SMALL_ROWS rows of C-contiguous float32 weights, BLAS otherwise (one row is BLAS's GEMV,
    which is as fast). `invariant` (batch-invariant mode): the kernel for any row count, so a
    row's result never depends on how many rows came with it."""
    rows_ok = x.shape[-2] >= 1 if invariant else 2 <= x.shape[-2] <= SMALL_ROWS
    if invariant and x.dtype == np.float32 and w.dtype == np.float32:
        w = np.ascontiguousarray(w)
    if not rows_ok or x.dtype != np.float32 or w.dtype != np.float32 or (
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


# -- a die's attention of 2-3 rows, its projections in two compiled calls --------------------------


_RO_F32_1C = _RO_F32_1D
_MLA_IN_SIG = numba.types.void(_RO_F32_2D, _RO_F32_1C, numba.types.float32, _RO_F32_2D,
                               _RO_F32_1C, _RO_F32_2D, _RO_F32_2D, _RO_F32_1C, _RO_F32_3D,
                               _RO_F32_2D, _RO_F32_2D, _F32_3D, _F32_2D)  # fmt: skip


@numba.njit(_MLA_IN_SIG, cache=True, nogil=True, boundscheck=False)
def _mla_in(h, attn_norm, eps, wq_a, q_norm, wq_b, wkv_a, kv_norm, w_uk, cos, sin, q_cat,
            kv_rows):  # pragma: no cover - compiled  # fmt: skip
    """The query and the cached row of every row, as `runtime.model`'s numpy path computes them
    for 2-3 rows (each step the same kernel and order: `_rms_norm`, `_mm`, `_rope`), so the two
    paths give the same bits: x = rms_norm(h); q = (rms_norm(x @ wq_a) @ wq_b or x @ wq_b when
    wq_a is empty); q_cat[h] = [q_nope[:, h] @ w_uk[h], rope(q_pe[:, h])];
    kv_rows = [rms_norm(kv[:, :R]), rope(kv[:, R:])] with kv = x @ wkv_a."""
    n, hidden = h.shape
    nh, nope, r = w_uk.shape
    p = kv_rows.shape[1] - r
    x = np.empty((n, hidden), np.float32)
    _rms_norm(h, attn_norm, eps, x)
    if wq_a.shape[0]:
        t = np.empty((n, wq_a.shape[1]), np.float32)
        _mm(x, wq_a, t)
        xq = np.empty_like(t)
        _rms_norm(t, q_norm, eps, xq)
    else:
        xq = x
    q = np.empty((n, wq_b.shape[1]), np.float32)
    _mm(xq, wq_b, q)
    q3 = q.reshape(n, nh, nope + p)
    qn = np.empty((n, nope), np.float32)
    ql = np.empty((n, r), np.float32)
    qpe = np.empty((n, 1, p), np.float32)
    for hd in range(nh):
        for i in range(n):
            for c in range(nope):
                qn[i, c] = q3[i, hd, c]
        _mm(qn, w_uk[hd], ql)
        _rope(q3[:, hd : hd + 1, nope:], cos, sin, qpe)
        for i in range(n):
            for c in range(r):
                q_cat[hd, i, c] = ql[i, c]
            for c in range(p):
                q_cat[hd, i, r + c] = qpe[i, 0, c]
    kv = np.empty((n, r + p), np.float32)
    _mm(x, wkv_a, kv)
    lat = np.empty((n, r), np.float32)
    _rms_norm(kv[:, :r], kv_norm, eps, lat)
    kpe = np.empty((n, 1, p), np.float32)
    _rope(kv.reshape(n, 1, r + p)[:, :, r:], cos, sin, kpe)
    for i in range(n):
        for c in range(r):
            kv_rows[i, c] = lat[i, c]
        for c in range(p):
            kv_rows[i, r + c] = kpe[i, 0, c]


def mla_in(h, attn_norm, eps, wq_a, q_norm, wq_b, wkv_a, kv_norm, w_uk, cos, sin):
    """(q_cat float32 `[H, n, R+P]`, kv_rows float32 `[n, R+P]`) of 2-3 rows h (see `_mla_in`);
    wq_a / q_norm None when the query is not compressed (wq_b is then W_Q)."""
    n = h.shape[0]
    nh, _, r = w_uk.shape
    width = wkv_a.shape[1]
    q_cat = np.empty((nh, n, width), np.float32)
    kv_rows = np.empty((n, width), np.float32)
    if wq_a is None:
        wq_a, q_norm = _NONE_2D, _NONE_1D
    _mla_in(h, attn_norm, np.float32(eps), wq_a, q_norm, wq_b, wkv_a, kv_norm, w_uk, cos, sin,
            q_cat, kv_rows)  # fmt: skip
    return q_cat, kv_rows


_NONE_2D, _NONE_1D = np.zeros((0, 0), np.float32), np.zeros(0, np.float32)


@numba.njit(numba.types.void(_RO_F32_3D, _RO_F32_3D, _RO_F32_2D, _RO_F32_2D, _F32_2D),
            cache=True, nogil=True, boundscheck=False)  # fmt: skip
def _attn_out(o_lat, w_uv, wo, h, out):  # pragma: no cover - compiled
    """out = h + (o_lat[h] @ w_uv[h] per head, heads side by side) @ wo: the numpy path's
    `mm` calls on 2-3 rows (`_bmm`, then `_mm`) and its float32 residual add."""
    nh, n, _ = o_lat.shape
    v = w_uv.shape[2]
    o = np.empty((nh, n, v), np.float32)
    _bmm(o_lat, w_uv, o)
    flat = np.empty((n, nh * v), np.float32)
    for i in range(n):
        for hd in range(nh):
            for c in range(v):
                flat[i, hd * v + c] = o[hd, i, c]
    y = np.empty((n, wo.shape[1]), np.float32)
    _mm(flat, wo, y)
    for i in range(n):
        for c in range(y.shape[1]):
            out[i, c] = h[i, c] + y[i, c]


def attn_out(o_lat, w_uv, wo, h):
    """h + the attention output of 2-3 rows (see `_attn_out`), float32 `[n, hidden]`."""
    out = np.empty(h.shape, np.float32)
    _attn_out(o_lat, w_uv, wo, h, out)
    return out


# -- a die's FFNs and routing of 2-3 rows ------------------------------------------------------


@numba.njit(numba.types.void(_RO_F32_2D, _RO_F32_2D, _RO_F32_2D, _RO_F32_2D, _F32_2D),
            cache=True, nogil=True, boundscheck=False)  # fmt: skip
def _swiglu(x, w_gate, w_up, w_down, out):  # pragma: no cover - compiled
    """out = (silu(x @ w_gate) * (x @ w_up)) @ w_down with `_mm` products; silu(g) =
    g / (1 + exp(-g)) in float32 (libm's expf: within an ulp of numpy's SIMD exp, not its bits;
    an overflowing exp gives -0.0 as in numpy)."""
    n = x.shape[0]
    inter = w_gate.shape[1]
    g = np.empty((n, inter), np.float32)
    u = np.empty((n, inter), np.float32)
    _mm(x, w_gate, g)
    _mm(x, w_up, u)
    one = np.float32(1.0)
    for i in range(n):
        for c in range(inter):
            a = g[i, c]
            g[i, c] = (a / (one + np.exp(-a))) * u[i, c]
    _mm(g, w_down, out)


def swiglu(x: np.ndarray, w_gate: np.ndarray, w_up: np.ndarray, w_down: np.ndarray) -> np.ndarray:
    """SwiGLU of 2-3 float32 rows in one compiled call (numpy's was 8 calls; see `_swiglu`)."""
    out = np.empty((x.shape[0], w_down.shape[1]), np.float32)
    _swiglu(x, w_gate, w_up, w_down, out)
    return out


@numba.njit(numba.types.void(_RO_F32_2D, numba.types.int64, numba.types.int64,
                             numba.types.int64[:, ::1]), cache=True, nogil=True,
            boundscheck=False)  # fmt: skip
def _topk_choice(choice, n_group, topk_group, idx):  # pragma: no cover - compiled
    """idx[r] = the top-k of choice[r] as `runtime.model.route_topk` picks them, bit for bit:
    with a group limit (n_group > 1, topk_group < n_group) a group's score is its top-2
    choices summed in float32 (top-1 for groups of one), the best topk_group groups are kept
    (ties: the lower group) and the other groups' experts are out; then the experts by
    descending choice, ties to the lower id, NaN after every number (numpy's stable argsort
    of -choice)."""
    n, e = choice.shape
    k_n = idx.shape[1]
    size = e // n_group
    limited = n_group > 1 and topk_group < n_group
    gscore = np.empty(n_group, np.float32)
    kept = np.empty(n_group, np.bool_)
    val = np.empty(e, np.float32)  # the choice, -inf for a dropped group's experts
    taken = np.empty(e, np.bool_)
    for r in range(n):
        row = choice[r]
        for j in range(e):
            val[j] = row[j]
            taken[j] = False
        if limited:
            for g in range(n_group):
                b1 = np.float32(-np.inf)
                b2 = np.float32(-np.inf)
                for j in range(g * size, (g + 1) * size):
                    v = row[j]
                    if v > b1:
                        b2 = b1
                        b1 = v
                    elif v > b2:
                        b2 = v
                gscore[g] = b1 + b2 if size > 1 else b1
                kept[g] = False
            for _ in range(topk_group):
                best = -1
                for g in range(n_group):
                    if not kept[g] and (best < 0 or gscore[g] > gscore[best]):
                        best = g
                kept[best] = True
            for g in range(n_group):
                if not kept[g]:
                    for j in range(g * size, (g + 1) * size):
                        val[j] = -np.inf
        for k in range(k_n):
            best = -1
            for j in range(e):  # the largest number left, the lower id on ties
                if not taken[j] and val[j] == val[j] and (best < 0 or val[j] > val[best]):
                    best = j
            if best < 0:  # only NaN left: in id order
                for j in range(e):
                    if not taken[j]:
                        best = j
                        break
            idx[r, k] = best
            taken[best] = True


def topk_choice(choice: np.ndarray, n_group: int, topk_group: int, topk: int) -> np.ndarray:
    """int64 `[n, topk]`: the routed experts of biased scores `choice` float32 `[n, E]` in one
    compiled pass (see `_topk_choice`; numpy's sort, argsort, put_along_axis and where were
    ~12 calls)."""
    idx = np.empty((choice.shape[0], topk), np.int64)
    _topk_choice(np.ascontiguousarray(choice), n_group, topk_group, idx)
    return idx


_F32_3W = numba.types.Array(numba.types.float32, 3, "A")


@numba.njit(numba.types.void(_RO_F32_3A, _RO_F32_2A, numba.types.int64, numba.types.float32,
                             _F32_3W), cache=True, nogil=True, boundscheck=False)  # fmt: skip
def attend_rows(q, cache, start, scale, out):  # pragma: no cover - compiled
    """Batch-invariant latent attention of one segment: row i (position start + i) of head h
    scores exactly cache rows 0..start+i (`(q . row)` summed in float64 over ascending k, rounded
    once, times `scale`), softmax in float32 with the sum in float64 over ascending t, and the
    weighted sum of the rows' first `out.shape[2]` columns in float64 over ascending t. Every
    row's bits depend on its own query and context only (not on s, T or the other rows).

    q: float32 `[H, s, R+P]`; cache: float32 `[T, R+P]` (T >= start + s); out: `[H, s, R]`."""
    n_h, s, kk = q.shape
    r = out.shape[2]
    sc = np.empty(cache.shape[0], np.float32)
    acc = np.empty(r, np.float64)
    for h in range(n_h):
        for i in range(s):
            t_n = start + i + 1
            mx = np.float32(-np.inf)
            for t in range(t_n):
                a = 0.0
                for k in range(kk):
                    a += np.float64(q[h, i, k]) * np.float64(cache[t, k])
                v = np.float32(a) * scale
                sc[t] = v
                if v > mx:
                    mx = v
            tot = 0.0
            for t in range(t_n):
                e = np.float32(np.exp(np.float32(sc[t] - mx)))
                sc[t] = e
                tot += np.float64(e)
            for c in range(r):
                acc[c] = 0.0
            for t in range(t_n):
                p = np.float64(np.float32(np.float64(sc[t]) / tot))
                row = cache[t]
                for c in range(r):
                    acc[c] += p * np.float64(row[c])
            for c in range(r):
                out[h, i, c] = np.float32(acc[c])


def warm() -> None:
    """Compile or load the kernels (a pod calls it before its dies fork)."""
    mm(np.zeros((2, 4), np.float32), np.zeros((4, 3), np.float32))
    mm(np.zeros((2, 2, 4), np.float32), np.zeros((2, 4, 3), np.float32))
    rms_norm(np.ones((2, 4), np.float32), np.ones(4, np.float32), 1e-6)
    rope(np.ones((2, 1, 4), np.float32), np.ones((2, 2), np.float32), np.ones((2, 2), np.float32))
    f = np.ones
    # 2 heads of nope 2, rope 2, latent 4, value 3; hidden 8
    mla_in(f((2, 8), np.float32), f(8, np.float32), 1e-6, None, None, f((8, 8), np.float32),
           f((8, 6), np.float32), f(4, np.float32), f((2, 2, 4), np.float32),
           f((2, 1), np.float32), f((2, 1), np.float32))  # fmt: skip
    attn_out(f((2, 2, 4), np.float32), f((2, 4, 3), np.float32), f((6, 8), np.float32),
             f((2, 8), np.float32))  # fmt: skip
    swiglu(f((2, 8), np.float32), f((8, 4), np.float32), f((8, 4), np.float32),
           f((4, 8), np.float32))  # fmt: skip
    topk_choice(f((2, 8), np.float32), 2, 1, 2)
    attend_rows(f((2, 2, 6), np.float32), f((3, 6), np.float32), 1, np.float32(0.5),
                np.empty((2, 2, 4), np.float32))  # fmt: skip
