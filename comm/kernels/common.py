"""What the kernel modules share: numba types for their signatures, and `describe`."""

from __future__ import annotations

import numba
import numpy as np


def ro(dtype: numba.types.Type, ndim: int) -> numba.types.Array:
    """A read-only C-contiguous array type: kernel inputs are declared so, which takes
    writeable arrays too (numba converts), while a writeable-only signature refuses a caller's
    read-only array (valid input) with a TypeError."""
    return numba.types.Array(dtype, ndim, "C", readonly=True)


def describe(a: object) -> str:
    """dtype and shape of an array (type name otherwise), for error messages."""
    if isinstance(a, np.ndarray):
        return f"{a.dtype} {list(a.shape)}"
    return type(a).__name__


RO_I64 = numba.types.Array(numba.types.int64, 1, "C", readonly=True)
RO_I32 = numba.types.Array(numba.types.int32, 1, "C", readonly=True)
RO_F32 = numba.types.Array(numba.types.float32, 1, "C", readonly=True)
I64_1D = numba.types.int64[::1]
