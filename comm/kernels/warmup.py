"""`warm()`: load (or compile once) every kernel and run it, for the types the protocols pass."""

from __future__ import annotations

import numpy as np

from comm.kernels.bf16 import scatter_rows, to_bfloat16
from comm.kernels.copy import scatter_copy
from comm.kernels.fused import (
    fused_assemble,
    fused_cflags,
    fused_counts,
    fused_pack,
    fused_scatter,
    fused_seq,
)
from comm.kernels.int8 import quantize_int8
from comm.kernels.layout import dedup_layout, dispatch_layout
from comm.kernels.packets import (
    assemble_count,
    assemble_place,
    dedup_count,
    dedup_place,
    pack_dedup_rows,
    pack_rows,
)
from comm.kernels.plan import dedup_plan, first_bad_source, first_pending, group_by_dest
from comm.kernels.reduce import pull_reduce, reduce_groups, weighted_sum, weighted_sum_flat
from comm.kernels.region import LIKE_I32, LIKE_U16
from comm.quant import BF16


def warm() -> None:
    """Load every kernel (compiled at import from the on-disk cache, or compiled there once)
    and run it once, so that a die forked afterwards starts with it ready."""
    to_bfloat16(np.zeros((2, 64), np.float32), np.empty((2, 96), BF16)[:, :64])
    idx, w = np.zeros((1, 2), np.int64), np.ones((1, 2), np.float32)
    weighted_sum(np.zeros((1, 2, 8), BF16), idx, w)
    weighted_sum(np.zeros((1, 2, 8), np.float32), idx, w)
    weighted_sum_flat(np.zeros(16, np.uint16), 8, idx, w, 8)
    weighted_sum_flat(np.zeros(16, np.float32), 8, idx, w, 8)
    z = np.zeros(1, np.int64)
    first_pending(z, z, z, 1, 0)
    first_bad_source(z, z, z, 0, 0)
    _warm_fused()
    quantize_int8(np.ones((2, 8), np.float32))
    buf = np.zeros(8, np.uint8)
    scatter_copy(buf.ctypes.data, buf.ctypes.data, np.array([[0, 4, 4]], np.int64))
    one, b16, b32 = np.zeros(1, np.int64), np.zeros((2, 16), BF16), np.zeros((2, 16), np.float32)
    scatter_rows(np.zeros((1, 8), np.float32), one, b16, one)
    scatter_rows(np.zeros((1, 8), BF16), one, b16, one)
    scatter_rows(np.zeros((1, 8), np.float32), one, b32, one)
    ro = np.zeros(1, np.int64)
    ro.flags.writeable = False
    pack_rows(np.zeros((1, 8), np.int8), np.ones(1, np.float32), ro, ro, ro,
              np.zeros((1, 64), np.uint8))  # fmt: skip
    two = np.array([0, 1], np.int64)
    pack_dedup_rows(np.zeros((1, 8), np.int8), np.ones(1, np.float32), ro, two, ro, ro,
                    np.ones(1, np.float32), np.zeros((1, 64), np.uint8), 8)  # fmt: skip
    reduce_groups(np.zeros((1, 8), np.float32), one, two, np.ones(1, np.float32), 0, b16, one)
    reduce_groups(np.zeros((1, 8), np.float32), one, two, np.ones(1, np.float32), 0, b32, one)
    packed = np.zeros((1, 64), np.uint8)
    pack_dedup_rows(np.zeros((1, 8), np.int8), np.ones(1, np.float32), ro, two, ro, ro,
                    np.ones(1, np.float32), packed, 8)  # fmt: skip
    flat, counts = packed.reshape(-1), np.zeros(1, np.int64)
    dedup_count(flat, 1, 64, 8, 3, 1, counts)
    i64 = [np.zeros(1, np.int64) for _ in range(8)]
    dedup_place(flat, 1, 64, 8, 0, np.zeros(1, np.int64), 0, np.zeros((1, 8), np.uint8),
                np.zeros((2, 1), np.int32), np.zeros((5, 1), np.int64), np.zeros((3, 1), np.int64),
                np.zeros(2, np.int64))  # fmt: skip
    tables = np.zeros(2, np.int64), np.zeros(2, np.int64), np.zeros(2, np.int64)
    group_by_dest(*tables, 1, 1, 2, np.zeros(2, np.int64), np.zeros(2, np.int64),
                  np.zeros(2, np.int64))  # fmt: skip
    dedup_plan(*tables, 1, 1, 2, np.zeros(2, np.int64), np.zeros(2, np.int64))
    dispatch_layout(np.zeros((1, 2), np.int64) - 1, *tables, 1)
    dedup_layout(np.zeros((1, 2), np.int64) - 1, np.ones((1, 2), np.float32), *tables[:2], 1)
    assemble_count(packed.reshape(-1).view(np.int32), 1, 64, counts)
    assemble_place(flat, flat.view(np.int32), 0, 64, 8, 0, np.zeros(1, np.int64),
                   np.zeros((1, 8), np.uint8), np.zeros(1, np.int32), *i64[:4])  # fmt: skip


def _warm_fused() -> None:
    """The fused protocol's many-region kernels, for the types the protocol passes (region
    addresses; read-only layout arrays; writeable payloads and outputs)."""
    region = np.zeros(4096, np.uint8)
    addrs = np.array([region.ctypes.data], np.int64)
    nbytes = len(region)
    ro = np.zeros(2, np.int64)
    ro.flags.writeable = False
    one = np.zeros(1, np.int64)
    fused_pack(addrs, nbytes, one, ro, 0, np.zeros((1, 16), np.uint8), np.zeros(1, np.int32),
               ro, ro, ro, 32)  # fmt: skip
    fused_counts(addrs, nbytes, one, ro, ro, one, np.zeros(2, np.int64), 0, 8, 0, 0)
    fused_seq(addrs, nbytes, 10, 0)
    counts = np.zeros(1, np.int64)
    fused_assemble(region, region.view(np.int32), region.view(np.int64), one,
                   np.zeros(1, np.int64), 0, 64, 16, 1, 32, 16, counts,
                   np.zeros((1, 16), np.uint8), np.zeros(1, np.int32), one.copy(), one.copy(),
                   one.copy(), one.copy())  # fmt: skip
    starts = np.array([0, 0], np.int64)
    for rows, like in ((np.zeros((1, 4), np.uint32), LIKE_U16),
                       (np.zeros((1, 4), np.uint16), LIKE_U16),
                       (np.zeros((1, 4), np.int32), LIKE_I32)):  # fmt: skip
        fused_scatter(rows, one, one, starts, addrs, nbytes, like, 0, 8, 0, 0, 0)
    fused_cflags(addrs, nbytes, one, starts, 0, 0)
    idx, w, out = np.full((1, 1), -1), np.ones((1, 1), np.float32), np.zeros((1, 4), np.float32)
    for like in (LIKE_U16, np.zeros(0, np.float32)):
        pull_reduce(addrs, nbytes, like, one, ro, one, 0, 8, ro, ro, idx, w, out)
