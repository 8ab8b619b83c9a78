"""Compiled per-element kernels of the all-to-all (numba), like the AIV vector kernels of the paper.

numpy runs a pass that is one ufunc at memory speed, but a pass that needs several (a rounding
of float32 to bfloat16 is five integer ufuncs) costs several trips over the bytes; a numba
kernel does it in one. Every kernel is bit-equal to the numpy it replaces
(tests/unit/test_kernels.py); comm.reference keeps the numpy versions. What they cost:
docs/benchmarks.md (the figures this docstring carried are in
docs/results/2026-11-25-comm-kernels.md).

One module per piece of the protocols:

    bf16.py      bfloat16 rounding and widening in registers; rows rounded on the way
    int8.py      INT8 quantization per token
    packets.py   dispatch packets: written on the source, grouped by local expert on arrival
    layout.py    the dispatch layout (and its dedup form), one counting sort each
    plan.py      the combine's send plan and its completion checks
    reduce.py    the combine's reductions, in the order of comm.reference
    region.py    `region`: any die's region inside a kernel, by address
    fused.py     the fused protocol's steps over every die's region, one call each
    copy.py      a KV transfer's segments in one call without the GIL (comm.kvlink)
    warmup.py    `warm()`
    common.py    signature types the modules share

Kernels are compiled once and cached on disk next to their files (`cache=True`; `make` warms the
cache, so dies load it instead of compiling). `warm()` compiles or loads every kernel of the
pod's types. numba keys a kernel's cache by the kernel's own file only, while a kernel carries
the helpers it inlines from other files (bf16.py, region.py, `packets.packet`) in its cached
code: `cache.drop_stale_cache` empties the cache whenever any file of the package changed.
"""

from pathlib import Path

from comm.kernels.cache import drop_stale_cache

drop_stale_cache(Path(__file__).parent)  # before any kernel loads its cached code

# ruff: noqa: E402

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
    pack_dedup_rows_raw,
    pack_rows,
)
from comm.kernels.plan import dedup_plan, first_bad_source, first_pending, group_by_dest
from comm.kernels.reduce import (
    pull_reduce,
    reduce_groups,
    reduce_groups_raw,
    weighted_sum,
    weighted_sum_flat,
)
from comm.kernels.warmup import warm

__all__ = [
    "assemble_count",
    "assemble_place",
    "dedup_count",
    "dedup_layout",
    "dedup_plan",
    "dispatch_layout",
    "first_bad_source",
    "fused_assemble",
    "fused_cflags",
    "fused_counts",
    "fused_pack",
    "fused_scatter",
    "fused_seq",
    "first_pending",
    "group_by_dest",
    "dedup_place",
    "pack_dedup_rows",
    "pack_dedup_rows_raw",
    "pack_rows",
    "pull_reduce",
    "quantize_int8",
    "reduce_groups",
    "reduce_groups_raw",
    "scatter_copy",
    "scatter_rows",
    "to_bfloat16",
    "warm",
    "weighted_sum",
    "weighted_sum_flat",
]
