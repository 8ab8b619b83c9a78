"""The expert-parallel job a user would write on MPI instead of xpod: the fair peer of
`xpod bench alltoall` (issue 11.4), `protocol: "ep"` beside the raw `"alltoallv"` bytes.

Each rank does what an xpod die's `comm.dispatch` + `comm.combine` do, with the same numpy and
comm building blocks and one all-to-all call per phase:

dispatch: the routing's canonical send layout (`comm.routing.get_dispatch_layout`), INT8
  quantization per token (`comm.quant.quantize_int8`, with --quant int8), one packed row per
  (token, expert) message in the send order (payload, then scale, slot, k, local expert: the
  xpod row layout), an all-to-all of the row counts, then of the rows (`Alltoallv`), and the
  received rows grouped by local expert, then (src, slot, k): the `DispatchOut` order;
combine: each expert row back to its token's rank in the order that rank sent it, rounded to
  bfloat16 on the way (the pod's default; `comm.kernels.to_bfloat16`, gathered in the same
  pass) or float32, one `Alltoallv`, and the weighted sum in ascending k in float32
  (`comm.alltoall.weighted_sum`, the order of `comm.reference.combine_ref`).

The inputs are `bench.alltoall`'s (tokens, routing, expert outputs of ones), so the work and the
bytes are those of the xpod rows. As xpod's dies have pre-allocated areas, the job keeps its
buffers between steps (a user would too): no step pays for allocating and first-touching them.
`check` compares the last step's dispatch output and combine output with `comm.reference`
(dispatch_ref, combine_ref), bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from bench.alltoall import Point, routing, tokens
from comm.alltoall import weighted_sum
from comm.kernels import to_bfloat16
from comm.quant import BF16, combine_dtype, quantize_int8
from comm.reference import combine_ref, dispatch_ref
from comm.routing import Placement, get_dispatch_layout

META = 16  # bytes after a row's payload: scale f32, slot i32, k i32, local expert i32

# alltoallv(send uint8, send bytes per rank, recv bytes per rank) -> recv uint8
AllToAllV = Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]
# alltoall of one int64 per rank: counts[p] to rank p -> what each rank sent this one
AllToAll = Callable[[np.ndarray], np.ndarray]


class EPJob:
    """One rank's dispatch / combine of `xpod bench alltoall`'s EP point over a transport."""

    def __init__(self, point: dict, quant: str, rank: int, num_ranks: int):
        self.pt = pt = Point(**point)
        if pt.attention_dies or pt.dies != num_ranks:
            raise ValueError(f"an EP job needs {pt.dies} ranks and no attention dies: {pt}")
        self.rank, self.n, self.quant = rank, num_ranks, quant
        self.x = tokens(pt, rank)
        self.idx, self.w = routing(pt, rank)
        self.placement = Placement.default(pt.num_experts, tuple(range(num_ranks)))
        self.cdt = combine_dtype(pt.combine_dtype)
        self.pb = pt.hidden if quant == "int8" else 4 * pt.hidden  # payload bytes of a row
        self.out = None
        self.got = None
        self._bufs: dict = {}

    def buf(self, name: str, shape: tuple, dtype) -> np.ndarray:
        """A buffer kept between steps (grown when a step needs more)."""
        dt = np.dtype(dtype)
        n = int(np.prod(shape)) * dt.itemsize
        b = self._bufs.get(name)
        if b is None or b.size < n:
            b = self._bufs[name] = np.empty(max(n, 64), np.uint8)
        return b[:n].view(dt).reshape(shape)

    # -- dispatch ---------------------------------------------------------------------------

    def dispatch(self, alltoall: AllToAll, alltoallv: AllToAllV) -> None:
        pt, pb = self.pt, self.pb
        lay = get_dispatch_layout(self.idx, self.placement)
        if self.quant == "int8":
            q, scale = quantize_int8(self.x)
            payload = q.view(np.uint8)
        else:
            payload, scale = self.x.view(np.uint8), np.ones(len(self.x), np.float32)
        row = pb + META
        send = self.buf("send", (lay.num_msgs, row), np.uint8)
        np.take(payload, lay.msg_slot, axis=0, out=send[:, :pb])  # pack, in the send order
        meta = send[:, pb:].view(np.int32)
        meta[:, 0] = scale[lay.msg_slot].view(np.int32)
        meta[:, 1] = lay.msg_slot
        meta[:, 2] = lay.msg_k
        meta[:, 3] = lay.msg_local_expert
        sent = lay.num_tokens_per_die.astype(np.int64)
        got = alltoall(sent)  # rows each rank sends this one
        recv = alltoallv(send.reshape(-1), sent * row, got * row).reshape(-1, row)
        rmeta = recv[:, pb:].view(np.int32)
        src = np.repeat(np.arange(self.n), got)
        order = np.lexsort((rmeta[:, 2], rmeta[:, 1], src, rmeta[:, 3]))  # by expert, src, slot, k
        grouped = self.buf("grouped", recv.shape, np.uint8)
        np.take(recv, order, axis=0, out=grouped)  # the dispatch output, grouped by local expert
        self.lay, self.sent, self.got, self.order = lay, sent, got, order
        self.d_x = grouped[:, :pb].view(np.int8 if self.quant == "int8" else np.float32)
        gm = grouped[:, pb:].view(np.int32)
        self.d_scales = gm[:, 0].view(np.float32)
        self.d_src, self.d_slot, self.d_k, self.d_local = src[order], gm[:, 1], gm[:, 2], gm[:, 3]
        if self._bufs.get("eout") is None:  # what the bench's experts return (kept, as xpod's)
            self._bufs["eout"] = np.ones((max(len(order), 1), pt.hidden), np.float32)
        elif len(self._bufs["eout"]) < len(order):
            self._bufs["eout"] = np.ones((len(order), pt.hidden), np.float32)
        self.eout = self._bufs["eout"][: len(order)]

    # -- combine ----------------------------------------------------------------------------

    def combine(self, alltoallv: AllToAllV) -> None:
        pt, cdt = self.pt, self.cdt
        rb = cdt.itemsize * pt.hidden
        back = np.empty(len(self.order), np.int64)
        back[self.order] = np.arange(len(self.order))  # expert row of each received message
        # bfloat16: rounded once, gathered back into the receive order in the same pass
        send = self.buf("csend", (len(back), pt.hidden), cdt)
        if cdt == BF16:
            to_bfloat16(self.eout, send, back)
        else:
            np.take(self.eout, back, axis=0, out=send)
        recv = alltoallv(send.view(np.uint8).reshape(-1), self.got * rb, self.sent * rb)
        rows = recv.view(cdt).reshape(-1, pt.hidden)  # this rank's messages, in its send order
        contrib = self.buf("contrib", (*self.idx.shape, pt.hidden), cdt)
        contrib[self.lay.msg_slot, self.lay.msg_k] = rows
        self.out = weighted_sum(contrib, self.idx, self.w)

    # -- check ------------------------------------------------------------------------------

    def check(self, transport: str) -> None:
        """The last step against comm.reference, bit for bit; RuntimeError naming the field."""
        pt = self.pt
        xs = [tokens(pt, r) for r in range(self.n)]
        routes = [routing(pt, r) for r in range(self.n)]
        quant = "int8" if self.quant == "int8" else None
        ref = dispatch_ref(xs, [r[0] for r in routes], self.placement, quant=quant)
        mine = ref[self.rank]
        fields = {"x": self.d_x, "src_rank": self.d_src, "batch_slot": self.d_slot,
                  "k_index": self.d_k, "local_expert": self.d_local}  # fmt: skip
        if quant:
            fields["scales"] = self.d_scales
        for name, got in fields.items():
            if not np.array_equal(got, getattr(mine, name)):
                raise RuntimeError(f"{transport} ep: rank {self.rank}: dispatch {name} differs")
        eouts = {d: np.ones((o.num_rows, pt.hidden), np.float32) for d, o in ref.items()}
        want = combine_ref(eouts, ref, [r[0] for r in routes], [r[1] for r in routes],
                           combine_dtype=pt.combine_dtype)[self.rank]  # fmt: skip
        if not np.array_equal(self.out, want):
            raise RuntimeError(f"{transport} ep: rank {self.rank}: combine output differs")
