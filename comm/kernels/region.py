"""Any die's region inside a compiled kernel: `region(addrs, d, nbytes, like)`.

`addrs` is int64 [dies]: where every region of the pod is mapped in this process
(`comm.alltoall.state.region_addrs`, made once per die), `nbytes` a region's size; `region`
makes a flat array of any dtype (that of `like`, one of the LIKE_* arrays) over die d's region,
so one call writes into every destination instead of a Python loop of calls per die (~5-15 us
per destination at decode sizes). (Numba typed lists of views did the same, but compiling their
machinery cost every launcher ~1 s.)
"""

from __future__ import annotations

import numba
import numba.extending
import numpy as np


@numba.extending.intrinsic
def _as_ptr(typingctx, addr, like):  # pragma: no cover - compiled into its callers
    """A pointer to `like`'s dtype at the integer address `addr` (an LLVM inttoptr)."""
    if not isinstance(addr, numba.types.Integer) or not isinstance(like, numba.types.Array):
        return None
    ptype = numba.types.CPointer(like.dtype)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(ptype))

    return ptype(addr, like), codegen


@numba.njit(inline="always")
def region(addrs, d, nbytes, like):  # pragma: no cover - compiled into its callers
    """Die d's whole region as a flat array of `like`'s dtype (the mapping outlives every call:
    an endpoint unmaps its regions only when its die ends)."""
    return numba.carray(_as_ptr(addrs[d], like), nbytes // like.itemsize)


LIKE_U8, LIKE_U16, LIKE_I32, LIKE_I64 = (
    np.zeros(0, t) for t in (np.uint8, np.uint16, np.int32, np.int64)
)
