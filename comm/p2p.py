"""XCCL point-to-point send / recv over the dies' shared regions (docs/protocols.md §4, 001 §3.1).

Per (sender s, receiver r, lane l) there is one inbound descriptor `desc[s][l]` in r's meta area
(written by s), one ack `ack[r][l]` in s's meta area (written by r), one zero-copy rendezvous
`rdv[r][l]` in s's meta area (written by r) and one ring in r's managed area (written by s).

Steps (the trace records each by number, see `comm.trace.STEP_NAMES`):

```
 sender s                                         receiver r
 1 MTE2: stripe chunk app -> UB half (ping-pong)
 2 MTE3: UB -> ring slot tail % slots in r        5 poll desc[s][l].tail_ptr > head_ptr
   (wait for credit: tail - head < slots)
 3 publish desc: event_id, msg_info, chunk_id,    6 ring slot -> UB -> app; publish
   then tail_ptr LAST                               ack.head_ptr (the credit)
 4 poll own ack[r][l].done >= seq                 7 after the last chunk: ack.event_id,
 8 done on every lane: check ack.status             ack.status, then ack.done = seq LAST
```

Variants:
- `mte`: as drawn, staged through the lane's UB (two private copies around the ring).
- `dma`: the die's DMA engine thread runs the lane loop: app <-> ring directly, as many contiguous
  free slots per copy as credits allow, while the caller blocks without CPU (`comm.dma`).
- `zero-copy`: a rendezvous in the MPI manner (ready-to-send, clear-to-send). The sender
  announces the message on lane 0 (event_id, msg_info, then chunk_id = seq << 24 LAST, tail_ptr
  untouched); the receiver, once it sees the announcement and has checked it against its own
  call, publishes (step 0) on each lane `rdv`: event_id, region offset and size of that lane's
  stripe of its destination buffer, then `seq` = the message's seq LAST; each sender lane waits
  for `rdv.seq == seq` exactly, writes straight into the receiver's app area and publishes its
  descriptor; steps 3, 4, 7, 8 as above (one virtual chunk per lane, no ring slot). A rendezvous
  is tagged with the message it belongs to, so a lane can never write into another message's
  buffer; a rejected announcement is answered with `rdv.event_id = RDV_REJECT`, tagged the same.
- async: `isend` / `irecv` return a `Request`; `test()` advances without blocking, `wait()` blocks.

`msg_info` (descriptor word 3) = nbytes | lanes << 40 | dtype.num << 48 | variant << 56, so the
receiver checks size, lane count, dtype and variant of every message. `chunk_id` = seq << 24 |
chunk index, where seq counts the messages of the pair (sender, receiver), the same on every lane
of a message, and is what the receiver echoes into `ack.done` (a monotonic word; caller event ids
may repeat). A receive starts when lane 0's `chunk_id` carries a seq above its own `ack.done`;
every lane it completes must carry that seq, event id and msg_info (checked per chunk), so a lane
of another message can never be taken for this one.

A mismatch found by the receiver (event id, size, lanes, dtype, variant) is answered by draining
the sender's message (ring variants) or refusing its rendezvous (zero-copy) and acking every
lane with a non-zero `status`: both sides raise ProtocolError and the pair's counters stay
consistent, so the pod stays usable. The sender raises only after EVERY lane is acked (the
receiver may still be draining lane 3 when it acked lane 0).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

import numpy as np

from comm.endpoint import Endpoint
from comm.trace import now_ns
from memory import layout as L
from memory.errors import PeerTimeout, PodAborted, ProtocolError

MTE, DMA, ZC = 1, 2, 3
VARIANTS = {"mte": MTE, "dma": DMA, "zero-copy": ZC}
VARIANT_NAMES = {v: k for k, v in VARIANTS.items()}

OK, BAD_EVENT, BAD_SIZE, BAD_LANES, BAD_DTYPE, BAD_VARIANT = 0, 1, 2, 3, 4, 5
ABORTED = 99  # ack.status of a message discarded by resync
STATUS_TEXT = {
    ABORTED: "discarded by resync after a failed pod.run",
    BAD_EVENT: "event id mismatch",
    BAD_SIZE: "size mismatch",
    BAD_LANES: "lane-count (cores) mismatch",
    BAD_DTYPE: "dtype mismatch",
    BAD_VARIANT: "variant mismatch (zero-copy on one side only)",
}
RDV_REJECT = -(1 << 62)  # rdv.event_id: the receiver refused the announced zero-copy message

SEQ_SHIFT = 24
NBYTES_MASK = (1 << 40) - 1
BIG_COPY = 1 << 20  # from here numpy copies beat memoryview (20 vs 11 GB/s at 8 MiB here)
_INT = (int, np.integer)
EVENT_LIMIT = 1 << 62


def pack_info(nbytes: int, lanes: int, dtype_num: int, variant: int) -> int:
    return nbytes | lanes << 40 | dtype_num << 48 | variant << 56


def unpack_info(info: int) -> tuple[int, int, int, int]:
    """msg_info -> (nbytes, lanes, dtype.num, variant)."""
    return info & NBYTES_MASK, (info >> 40) & 0xFF, (info >> 48) & 0xFF, (info >> 56) & 0x7F


def stripes(nbytes: int, lanes: int) -> list[tuple[int, int]]:
    """Byte range [lo, hi) of each lane: equal 64-byte-aligned stripes, the last one shorter."""
    per = -(-nbytes // lanes)
    per = -(-per // 64) * 64
    return [(min(nbytes, i * per), min(nbytes, (i + 1) * per)) for i in range(lanes)]


def _copy(dst: memoryview, src: memoryview) -> None:
    if len(src) >= BIG_COPY:
        np.copyto(np.frombuffer(dst, np.uint8), np.frombuffer(src, np.uint8))
    else:
        dst[:] = src


def byte_view(buf: np.ndarray, what: str, writable: bool) -> memoryview:
    """Flat uint8 memoryview of a C-contiguous numpy array; clear errors otherwise.

    The common case is one `memoryview(buf).cast("B")` (~0.25 us); the checks that explain a
    refusal run only when that fails.
    """
    if type(buf) is np.ndarray:
        try:
            m = memoryview(buf)
            if m.format != "O" and (not writable or not m.readonly):
                return m.cast("B")
        except (TypeError, ValueError):
            pass  # not C-contiguous, or a dtype without a buffer format: explained below
    if not isinstance(buf, np.ndarray):
        raise TypeError(f"{what} must be a numpy array, got {type(buf).__name__}")
    if buf.dtype.hasobject:
        raise TypeError(f"{what} has dtype {buf.dtype}, which holds Python objects")
    if not buf.flags.c_contiguous:
        raise ValueError(
            f"{what} is not C-contiguous (strides {buf.strides}); pass np.ascontiguousarray(...)"
        )
    if writable and not buf.flags.writeable:
        raise ValueError(f"{what} is read-only")
    return memoryview(buf.reshape(-1).view(np.uint8))


# ------------------------------------------------------------------------------------------------
# Lane state machines. pump() moves as far as possible without blocking and says if it moved;
# blocked() names the one word the lane waits for; finished() is true once the lane is complete.
# ------------------------------------------------------------------------------------------------


class _TxRing:
    """Sender lane of the ring variants (mte, dma)."""

    __slots__ = (
        "ep", "dst", "lane", "src", "lo", "hi", "k", "nchunks", "seq", "event_id", "info",
        "dw", "desc", "aw", "ack", "ring", "ring_off", "tail", "dma", "op", "fin",
    )  # fmt: skip

    def __init__(self, ep, dst, lane, src, lo, hi, seq, event_id, info, dma):
        lo_ = ep.layout
        self.ep, self.dst, self.lane, self.src, self.lo, self.hi = ep, dst, lane, src, lo, hi
        self.k = 0
        self.nchunks = max(1, -(-(hi - lo) // lo_.slot_bytes))
        self.seq = seq
        self.event_id, self.info, self.dma = event_id, info, dma
        self.op = "dma_send" if dma else "send"
        t = ep.tables
        self.dw = ep.words[dst]
        self.desc = t.desc[ep.die_id][lane]
        self.aw = ep.words[ep.die_id]
        self.ack = t.ack[dst][lane]
        self.ring = ep.bytes[dst]
        self.ring_off = t.ring[ep.die_id][lane]
        self.tail = self.dw[self.desc + L.DESC_TAIL]
        self.fin = False

    def pump(self) -> bool:
        k, nch = self.k, self.nchunks
        if k == nch:
            return False
        ep = self.ep
        lo_ = ep.layout
        slots, C = lo_.ring_slots, lo_.slot_bytes
        aw, ack, dw, desc = self.aw, self.ack, self.dw, self.desc
        tr = ep.trace if ep.trace.enabled else None
        tail = self.tail
        head = aw[ack + L.ACK_HEAD]
        moved = False
        while k < nch and tail - head < slots:
            # DMA moves up to half the ring of contiguous free slots in one copy (so that the
            # receiver drains one half while the other fills); MTE one slot through the UB.
            if self.dma:
                run = min(nch - k, slots - (tail - head), slots - tail % slots, slots // 2)
            else:
                run = 1
            a = self.lo + k * C
            b = min(self.hi, a + run * C)
            off = self.ring_off + (tail % slots) * C
            if self.dma:
                t0 = now_ns() if tr else 0
                _copy(self.ring[off : off + b - a], self.src[a:b])
                if tr:
                    tr.rec(
                        t0, now_ns() - t0, "dma_send", 2, self.dst, self.lane, self.event_id, b - a
                    )
            else:
                self._mte(a, b, off, k, tr)
            # Payload first, descriptor next, tail_ptr LAST: the receiver reads the slot and the
            # descriptor only after it sees tail_ptr move (x86-64 TSO keeps store order).
            dw[desc + L.DESC_EVENT] = self.event_id
            dw[desc + L.DESC_INFO] = self.info
            dw[desc + L.DESC_CHUNK] = self.seq << SEQ_SHIFT | (k + run - 1)
            tail += run
            dw[desc + L.DESC_TAIL] = tail
            if tr:
                tr.rec(now_ns(), 0, self.op, 3, self.dst, self.lane, self.event_id, b - a)
            k += run
            moved = True
            head = aw[ack + L.ACK_HEAD]
        self.k, self.tail = k, tail
        return moved

    def _mte(self, a, b, off, k, tr):
        ub = self.ep.ub(self.lane)
        half = len(ub[0])
        ring, src = self.ring, self.src
        for p in range(a, max(b, a + 1), half):
            q = min(b, p + half)
            h = ub[k & 1]  # ping-pong halves
            o = off + p - a
            if tr:
                t0 = now_ns()
                h[: q - p] = src[p:q]
                t1 = now_ns()
                ring[o : o + q - p] = h[: q - p]
                t2 = now_ns()
                tr.rec(t0, t1 - t0, "send", 1, self.dst, self.lane, self.event_id, q - p)
                tr.rec(t1, t2 - t1, "send", 2, self.dst, self.lane, self.event_id, q - p)
            else:
                h[: q - p] = src[p:q]  # step 1, MTE2: app -> UB
                ring[o : o + q - p] = h[: q - p]  # step 2, MTE3: UB -> ring slot
            k += 1

    def blocked(self):
        if self.k < self.nchunks:
            slots = self.ep.layout.ring_slots
            return self.aw, self.ack + L.ACK_HEAD, self.tail - slots + 1, self.dst, "ack.head_ptr"
        return self.aw, self.ack + L.ACK_DONE, self.seq, self.dst, "ack.done"

    def finished(self) -> bool:
        """True once the receiver acked this lane (whatever its status: see `check`)."""
        if self.fin:
            return True
        if self.k < self.nchunks or self.aw[self.ack + L.ACK_DONE] < self.seq:
            return False
        self.fin = True
        _trace_done(self.ep, self.op, self.dst, self.lane, self.event_id, self.hi - self.lo)
        return True

    def check(self) -> None:
        """Raise the receiver's refusal of this lane (call once every lane is finished)."""
        _check_ack(self.ep, self.aw, self.ack, self.dst, self.event_id)


def _trace_done(ep: Endpoint, op: str, dst: int, lane: int, event_id: int, nbytes: int) -> None:
    """Steps 4 (poll ack, since the lane's last publish) and 8 (done) of a sender lane."""
    tr = ep.trace
    if tr.enabled:
        t = now_ns()
        last = next((r[0] for r in reversed(tr.records) if r[2] == op and r[5] == lane), t)
        tr.rec(last, t - last, op, 4, dst, lane, event_id, nbytes)
        tr.rec(t, 0, op, 8, dst, lane, event_id, nbytes)


class _TxZeroCopy:
    """Sender lane of zero-copy: wait for the receiver's rendezvous of THIS message (rdv.seq ==
    seq), write straight into its app area, publish the descriptor."""

    __slots__ = (
        "ep", "dst", "lane", "src", "lo", "hi", "seq", "event_id", "info", "dw", "desc",
        "aw", "ack", "rdv", "sent", "t_wait", "fin",
    )  # fmt: skip

    def __init__(self, ep, dst, lane, src, lo, hi, seq, event_id, info):
        self.ep, self.dst, self.lane, self.src, self.lo, self.hi = ep, dst, lane, src, lo, hi
        self.seq, self.event_id, self.info = seq, event_id, info
        t = ep.tables
        self.dw = ep.words[dst]
        self.desc = t.desc[ep.die_id][lane]
        self.aw = ep.words[ep.die_id]
        self.ack = t.ack[dst][lane]
        self.rdv = t.rdv[dst][lane]
        self.sent = self.fin = False
        self.t_wait = now_ns()
        if lane == 0:
            # Ready-to-send: event id, msg_info, then chunk_id LAST, tail_ptr untouched. The
            # receiver starts its receive on the new seq and answers with a rendezvous tagged
            # with it (or a rejection). The previous message of the pair is acked on every lane
            # already, so nobody reads these words now.
            dw, desc = self.dw, self.desc
            dw[desc + L.DESC_EVENT] = event_id
            dw[desc + L.DESC_INFO] = info
            dw[desc + L.DESC_CHUNK] = seq << SEQ_SHIFT

    def pump(self) -> bool:
        if self.sent:
            return False
        ep, aw, rdv = self.ep, self.aw, self.rdv
        tag = aw[rdv + L.RDV_SEQ]
        if tag < self.seq:
            return False  # a rendezvous of an earlier message, or none yet
        if tag > self.seq:
            raise ProtocolError(
                f"die {ep.die_id} send to die {self.dst} (event_id {self.event_id}), lane"
                f" {self.lane}: the receiver posted a rendezvous for message {tag}, this is"
                f" message {self.seq} (the pair is out of step); nothing written"
            )
        ev = aw[rdv + L.RDV_EVENT]
        if ev == RDV_REJECT:
            self.sent = True  # refused: ack.status (written before the tag) says why
            return True
        tr = ep.trace if ep.trace.enabled else None
        if tr:
            tr.rec(self.t_wait, now_ns() - self.t_wait, "zc_send", 0, self.dst, self.lane,
                   self.event_id, 0)  # fmt: skip
        off, nbytes = aw[rdv + L.RDV_OFF], aw[rdv + L.RDV_NBYTES]
        n = self.hi - self.lo
        lo_ = ep.layout
        in_app = lo_.app_off <= off and off + n <= lo_.app_off + lo_.app_bytes
        if ev != self.event_id or nbytes != n or not in_app:
            raise ProtocolError(
                f"die {ep.die_id} send to die {self.dst} (event_id {self.event_id}), lane"
                f" {self.lane}: the rendezvous of message {self.seq} names event_id {ev},"
                f" {nbytes} B at region offset {off}; this lane sends {n} B into the app area"
                f" [{lo_.app_off}, {lo_.app_off + lo_.app_bytes}); nothing written"
            )
        t0 = now_ns()
        _copy(ep.bytes[self.dst][off : off + n], self.src[self.lo : self.hi])
        if tr:
            tr.rec(t0, now_ns() - t0, "zc_send", 2, self.dst, self.lane, self.event_id, n)
        # Payload first, descriptor next, tail_ptr LAST (the word the receiver lane polls).
        dw, desc = self.dw, self.desc
        dw[desc + L.DESC_EVENT] = self.event_id
        dw[desc + L.DESC_INFO] = self.info
        dw[desc + L.DESC_CHUNK] = self.seq << SEQ_SHIFT
        dw[desc + L.DESC_TAIL] = dw[desc + L.DESC_TAIL] + 1  # LAST
        if tr:
            tr.rec(now_ns(), 0, "zc_send", 3, self.dst, self.lane, self.event_id, n)
        self.sent = True
        return True

    def blocked(self):
        if not self.sent:
            return self.aw, self.rdv + L.RDV_SEQ, self.seq, self.dst, "rdv.seq"
        return self.aw, self.ack + L.ACK_DONE, self.seq, self.dst, "ack.done"

    def finished(self) -> bool:
        """True once the receiver acked this lane (whatever its status: see `check`)."""
        if self.fin:
            return True
        if not self.sent or self.aw[self.ack + L.ACK_DONE] < self.seq:
            return False
        self.fin = True
        _trace_done(self.ep, "zc_send", self.dst, self.lane, self.event_id, self.hi - self.lo)
        return True

    def check(self) -> None:
        """Raise the receiver's refusal of this lane (call once every lane is finished)."""
        _check_ack(self.ep, self.aw, self.ack, self.dst, self.event_id)


def _check_ack(ep: Endpoint, aw, ack: int, dst: int, event_id: int) -> None:
    """Step 8: the receiver acked; raise if it rejected the message."""
    status = aw[ack + L.ACK_STATUS]
    if status:
        raise ProtocolError(
            f"die {ep.die_id} send to die {dst} (event_id {event_id}): the receiver rejected it:"
            f" {STATUS_TEXT.get(status, status)} (receiver expected event_id"
            f" {aw[ack + L.ACK_EVENT]}); message discarded"
        )


class _Rx:
    """Receiver lane: consume ring chunks (mte via UB, dma direct, or drain) or zero-copy.

    Every chunk it takes must carry the message's seq, event id and msg_info in this lane's
    descriptor (the sender stores them before tail_ptr): a lane holding another message's data
    is a ProtocolError, never a silent success."""

    __slots__ = (
        "ep", "src", "lane", "dst", "lo", "hi", "k", "nchunks", "seq", "event_id", "info", "mode",
        "status", "ack_event", "lw", "desc", "rw", "ack", "ring", "ring_off", "head", "acked",
        "t_wait", "op",
    )  # fmt: skip

    def __init__(
        self, ep, src, lane, dst, lo, hi, nchunks, seq, event_id, info, mode, status=OK,
        ack_event=None,
    ):  # fmt: skip
        self.ep, self.src, self.lane, self.dst, self.lo, self.hi = ep, src, lane, dst, lo, hi
        self.k, self.nchunks, self.seq = 0, nchunks, seq
        # The sender's event id and msg_info, as read from lane 0 when the receive started:
        # every chunk of every lane must carry them.
        self.event_id, self.info = event_id, info
        self.mode, self.status = mode, status  # mode: MTE, DMA, ZC, or 0 = drain
        # ack.event_id: what this receiver expected (a drain answers with its own event id)
        self.ack_event = event_id if ack_event is None else ack_event
        self.op = {DMA: "dma_recv", ZC: "zc_recv"}.get(mode, "recv")
        t = ep.tables
        self.lw = ep.words[ep.die_id]
        self.desc = t.desc[src][lane]
        self.rw = ep.words[src]
        self.ack = t.ack[ep.die_id][lane]
        self.ring = ep.bytes[ep.die_id]
        self.ring_off = t.ring[src][lane]
        self.head = self.rw[self.ack + L.ACK_HEAD]
        self.acked = False
        self.t_wait = now_ns()

    def pump(self) -> bool:
        if self.acked:
            return False
        ep = self.ep
        lw, desc = self.lw, self.desc
        tail = lw[desc + L.DESC_TAIL]
        head, k, nch = self.head, self.k, self.nchunks
        if head >= tail:
            return False
        if (
            lw[desc + L.DESC_CHUNK] >> SEQ_SHIFT != self.seq
            or lw[desc + L.DESC_EVENT] != self.event_id
            or lw[desc + L.DESC_INFO] != self.info
        ):
            raise self._foreign()
        tr = ep.trace if ep.trace.enabled else None
        if tr and k == 0:
            tr.rec(self.t_wait, now_ns() - self.t_wait, self.op, 5, self.src, self.lane,
                   self.event_id, 0)  # fmt: skip
        lo_ = ep.layout
        slots, C = lo_.ring_slots, lo_.slot_bytes
        rw, ack, mode = self.rw, self.ack, self.mode
        while head < tail and k < nch:
            run = min(tail - head, nch - k, slots - head % slots, slots // 2) if mode == DMA else 1
            if mode in (MTE, DMA):
                a = self.lo + k * C
                b = min(self.hi, a + run * C)
                off = self.ring_off + (head % slots) * C
                t0 = now_ns() if tr else 0
                if mode == DMA:
                    _copy(self.dst[a:b], self.ring[off : off + b - a])
                else:
                    self._mte(a, b, off, k)
                if tr:
                    tr.rec(t0, now_ns() - t0, self.op, 6, self.src, self.lane, self.event_id, b - a)
            head += run
            k += run
            rw[ack + L.ACK_HEAD] = head  # the credit: frees `run` slots for the sender
        self.head, self.k = head, k
        if k == nch:
            self._ack(tr)
        return True

    def _foreign(self) -> ProtocolError:
        lw, desc = self.lw, self.desc
        return ProtocolError(
            f"die {self.ep.die_id} recv from die {self.src}: lane {self.lane} holds message"
            f" {lw[desc + L.DESC_CHUNK] >> SEQ_SHIFT} (event_id {lw[desc + L.DESC_EVENT]}, info"
            f" {lw[desc + L.DESC_INFO]:#x}), not message {self.seq} (event_id {self.event_id},"
            f" info {self.info:#x}) that lane 0 started: lanes out of step, nothing acked"
        )

    def _mte(self, a, b, off, k):
        ub = self.ep.ub(self.lane)
        half = len(ub[0])
        ring, dst = self.ring, self.dst
        for p in range(a, b, half):
            q = min(b, p + half)
            h = ub[k & 1]
            o = off + p - a
            h[: q - p] = ring[o : o + q - p]  # MTE2: ring -> UB
            dst[p:q] = h[: q - p]  # MTE3: UB -> app
            k += 1

    def _ack(self, tr) -> None:
        # Step 7: event id and status first, done (the word the sender polls) LAST.
        rw, ack = self.rw, self.ack
        rw[ack + L.ACK_EVENT] = self.ack_event
        rw[ack + L.ACK_STATUS] = self.status
        rw[ack + L.ACK_DONE] = self.seq
        self.acked = True
        if tr:
            tr.rec(now_ns(), 0, self.op, 7, self.src, self.lane, self.event_id, self.hi - self.lo)

    def blocked(self):
        return self.lw, self.desc + L.DESC_TAIL, self.head + 1, self.src, "desc.tail_ptr"

    def finished(self) -> bool:
        return self.acked

    def check(self) -> None:
        """A receiver lane's errors are raised by `pump`."""


# ------------------------------------------------------------------------------------------------
# Requests: one message between this die and one peer, over `cores` lanes.
# ------------------------------------------------------------------------------------------------


class Request:
    """An outstanding send or receive (returned by `isend` / `irecv`).

    `test()` advances every outstanding request of the die as far as it can without blocking (an
    MPI-style progress engine: a large isend to one peer must keep streaming while the caller
    waits on a receive from another) and returns True once this one is complete; `wait()` blocks,
    with the pod's wait policy, until then. Both raise the transfer's error (ProtocolError,
    PeerTimeout) if it failed. Requests to or from the same peer complete in issue order: a pair
    carries one message at a time, as in XCCL.
    """

    __slots__ = (
        "ep", "peer", "is_send", "event_id", "_start", "_lanes", "_job", "_queue", "done", "error",
    )  # fmt: skip

    def __init__(self, ep: Endpoint, peer: int, is_send: bool, event_id: int, start):
        self.ep, self.peer, self.is_send, self.event_id = ep, peer, is_send, event_id
        self._start = start  # () -> list of lanes, or None while it cannot start yet
        self._lanes: list | None = None
        self._job = None
        self._queue = (ep.tx_queue if is_send else ep.rx_queue)[peer]
        self._queue.append(self)
        ep.active.append(self)
        self.done = False
        self.error: BaseException | None = None

    def _advance(self) -> bool:
        """Move as far as possible without blocking; True if anything moved. Errors are kept in
        `self.error` (raised by this request's own test/wait), never raised here."""
        if self.done or self._queue[0] is not self:
            return False
        try:
            moved = False
            if self._lanes is None:
                self._lanes = self._start()
                if self._lanes is None:
                    return False
                moved = True
            if self._job is not None:
                if self._job.done.is_set():
                    self._finish(self._job.error)
                    return True
                return moved
            for ln in self._lanes:
                moved |= ln.pump()
            if all(ln.finished() for ln in self._lanes):
                _check_lanes(self._lanes)
                self._finish(None)
                return True
            return moved
        except Exception as e:  # noqa: BLE001 - stored, raised by this request's test/wait
            self._finish(e)
            return True

    def _finish(self, error: BaseException | None) -> None:
        self.done = True
        self.error = error
        self._queue.remove(self)
        self.ep.active.remove(self)

    def _result(self) -> bool:
        if self.error is not None:
            err, self.error = self.error, None
            raise err
        return True

    def test(self) -> bool:
        """Advance all outstanding requests; True once this one is complete."""
        if not self.done:
            self.ep.progress()
        return self._result() if self.done else False

    def wait(self) -> None:
        """Block until complete (advancing the die's other outstanding requests meanwhile)."""
        ep = self.ep
        idle = _Idler(ep)
        while True:
            moved = ep.progress()
            if self.done:
                self._result()
                return
            alone = len(ep.active) == 1
            if self._job is not None and alone:
                self._job.wait(0.05)  # blocked on an Event: the engine gets the CPU and the GIL
                idle.check_abort(self)
            elif moved:
                idle.reset()
            elif alone:
                words, idx, target, peer, field = self.blocked()
                ep.wait_ge(words, idx, target, peer, field)
            else:
                idle.idle(self)

    def blocked(self):
        """(words, index, target, peer, field) this request waits for next."""
        if self._lanes is None:
            if self._queue[0] is not self:
                return self._queue[0].blocked()
            ep = self.ep
            done = ep.words[self.peer][ep.tables.ack[ep.die_id][0] + L.ACK_DONE]
            chunk = ep.tables.desc[self.peer][0] + L.DESC_CHUNK
            field = f"desc.chunk_id (message {done + 1} << {SEQ_SHIFT})"
            return ep.words[ep.die_id], chunk, (done + 1) << SEQ_SHIFT, self.peer, field
        for ln in self._lanes:
            if not ln.finished():
                return ln.blocked()
        return self._lanes[0].blocked()


class _Idler:
    """The wait policy for a wait on several words at once (one request among many)."""

    __slots__ = ("ep", "polls", "start")

    def __init__(self, ep: Endpoint):
        self.ep, self.polls, self.start = ep, 0, 0

    def reset(self) -> None:
        self.polls = 0

    def idle(self, req: Request) -> None:
        pol = self.ep.policy
        self.polls += 1
        if self.polls <= pol.spin_polls:
            return
        if self.polls == pol.spin_polls + 1:
            self.start = now_ns()
        waited = now_ns() - self.start
        if waited > pol.backoff_after_s * 1e9:
            time.sleep(pol.sleep_s)
        elif self.polls % pol.yield_every == 0:
            os.sched_yield()
        if self.polls % pol.check_every == 0:
            if waited > pol.timeout_s * 1e9:
                words, idx, target, peer, field = req.blocked()
                raise PeerTimeout(
                    f"die {self.ep.die_id}: timed out after {pol.timeout_s:g} s waiting for die"
                    f" {peer} {field} >= {target} (seen {words[idx]})"
                )
            self.check_abort(req)

    def check_abort(self, req: Request) -> None:
        ab = self.ep.ctx.abort
        if ab is not None and ab[0][ab[1]] != ab[2]:
            raise PodAborted(
                f"die {self.ep.die_id}: aborted by the launcher during a transfer with die"
                f" {req.peer}"
            )


def _check_lanes(lanes: Sequence) -> None:
    """Raise the first lane's refusal, once EVERY lane is acked: a sender that gave up at the
    first refused lane would start its next message while the receiver still drains the other
    lanes, whose rings would then hold a chunk of each message (the next receive takes the
    refused message's chunk for its own: wrong bytes, acked)."""
    for ln in lanes:
        ln.check()


def _run_lanes(lanes: Sequence, ep: Endpoint) -> None:
    """Drive lanes to completion (the DMA engine's loop, and the drain of a bad message)."""
    while True:
        for ln in lanes:
            ln.pump()
        pending = [ln for ln in lanes if not ln.finished()]
        if not pending:
            _check_lanes(lanes)
            return
        words, idx, target, peer, field = pending[0].blocked()
        ep.wait_ge(words, idx, target, peer, field)


# ------------------------------------------------------------------------------------------------
# Public API
# ------------------------------------------------------------------------------------------------


def _args(ep: Endpoint, buf, peer: int, event_id: int, cores: int, variant: str, send: bool):
    ep.check_peer(peer, "destination" if send else "source")
    ep.check_cores(cores)
    if variant not in VARIANTS:
        raise ValueError(f"variant {variant!r}: choose one of {', '.join(VARIANTS)}")
    if not isinstance(event_id, _INT) or not 0 <= event_id < (1 << 62):
        raise ValueError(f"event_id {event_id!r} must be an int in [0, 2**62)")
    mv = byte_view(buf, "send buffer" if send else "recv buffer", writable=not send)
    if len(mv) > NBYTES_MASK:
        raise ValueError(f"message of {len(mv)} bytes exceeds the 1 TiB limit of msg_info")
    return mv, VARIANTS[variant]


def isend(
    ep: Endpoint, buf: np.ndarray, dst: int, event_id: int, cores: int = 1, variant: str = "mte"
) -> Request:
    """Start sending `buf` to die `dst`; returns a Request (see `send` for the arguments).

    `variant="dma"` hands the whole transfer to the die's DMA engine, so the caller is free (no
    CPU spent) until `wait()`; mte and zero-copy advance whenever `test()` / `wait()` is called.
    """
    mv, var = _args(ep, buf, dst, event_id, cores, variant, send=True)
    info = pack_info(len(mv), cores, buf.dtype.num, var)
    event_id = int(event_id)

    def start():
        spans = stripes(len(mv), cores)
        seq = ep.tx_seq[dst][0] = ep.tx_seq[dst][0] + 1  # one seq per message of the pair
        if var == ZC:
            return [
                _TxZeroCopy(ep, dst, i, mv, a, b, seq, event_id, info)
                for i, (a, b) in enumerate(spans)
            ]
        lanes = [
            _TxRing(ep, dst, i, mv, a, b, seq, event_id, info, var == DMA)
            for i, (a, b) in enumerate(spans)
        ]
        if var == DMA:
            req._job = ep.dma.submit(lanes)
        return lanes

    req = Request(ep, dst, True, event_id, start)
    req.test()
    return req


def irecv(
    ep: Endpoint, buf: np.ndarray, src: int, event_id: int, cores: int = 1, variant: str = "mte"
) -> Request:
    """Start receiving into `buf` from die `src`; returns a Request (see `recv`)."""
    mv, var = _args(ep, buf, src, event_id, cores, variant, send=False)
    event_id = int(event_id)
    expect = pack_info(len(mv), cores, buf.dtype.num, var)
    if var == ZC:
        _app_offset(ep, buf, len(mv))  # refuse before anything is published
    t, me = ep.tables, ep.die_id
    lw, rw = ep.words[me], ep.words[src]
    chunk0, done0 = t.desc[src][0] + L.DESC_CHUNK, t.ack[me][0] + L.ACK_DONE

    def start():
        # Step 5: a message starts when lane 0's chunk_id carries a seq above the last one this
        # die acked (a ring sender's first chunk, or a zero-copy sender's announcement); its
        # event id and msg_info were stored before chunk_id, so they are visible now.
        seq = lw[chunk0] >> SEQ_SHIFT
        if seq <= rw[done0]:
            return None
        got, got_event = lw[chunk0 - L.DESC_CHUNK + L.DESC_INFO], lw[chunk0 - L.DESC_CHUNK]
        status = _verdict(expect, got, event_id, got_event)
        if status:
            _reject(ep, src, seq, got, got_event, event_id, status)
            raise _rx_error(ep, src, event_id, expect, got, got_event, status)
        spans = stripes(len(mv), cores)
        if var == ZC:
            _post_rendezvous(ep, buf, mv, src, seq, event_id, cores)
        slot = ep.layout.slot_bytes
        lanes = [
            _Rx(
                ep,
                src,
                i,
                mv,
                a,
                b,
                1 if var == ZC else max(1, -(-(b - a) // slot)),
                seq,
                event_id,
                got,
                var,
            )  # fmt: skip
            for i, (a, b) in enumerate(spans)
        ]
        if var == DMA:
            req._job = ep.dma.submit(lanes)
        return lanes

    req = Request(ep, src, False, event_id, start)
    req.test()
    return req


def send(
    ep: Endpoint, buf: np.ndarray, dst: int, event_id: int, cores: int = 1, variant: str = "mte"
) -> None:
    """Send `buf` to die `dst` and return once the receiver has acknowledged it (steps 1-8).

    Arguments:
        ep: the sending die (a `runtime.Die` or `comm.Endpoint`).
        buf: C-contiguous numpy array of any non-object dtype and shape; `nbytes` may exceed the
            ring (it streams through it under credit flow control).
        dst: receiving die id, in [0, num_dies), not this die.
        event_id: int in [0, 2**62) naming this transfer; the matching `recv` must pass the same.
        cores: lanes (emulated AIV cores) to stripe the message over, 1..PodConfig.lanes; the
            receiver must use the same number.
        variant: "mte" (UB-staged, default), "dma" (DMA engine, both copies), or "zero-copy"
            (the receiver's buffer must be in its app area, and its recv must say zero-copy too).
    Raises:
        TypeError / ValueError for bad arguments (before anything is written), ProtocolError if
        the receiver rejected the message (mismatched event id, size, dtype, cores or variant),
        PeerTimeout if the receiver did not answer within the wait policy's deadline.
    """
    if cores == 1 and variant == "mte" and type(dst) is int:
        fast = ep.small_tx.get(dst)  # None for self and out-of-range ids: the checks below
        if fast is not None and fast(buf, event_id):
            return
    isend(ep, buf, dst, event_id, cores, variant).wait()


def recv(
    ep: Endpoint, buf: np.ndarray, src: int, event_id: int, cores: int = 1, variant: str = "mte"
) -> np.ndarray:
    """Receive the message `src` sends with `event_id` into `buf` (steps 5-7); returns `buf`.

    Arguments are those of `send`, seen from the receiver: `buf` must be writable, C-contiguous
    and of the sender's dtype and byte size. Raises ProtocolError on any mismatch with the sender
    (after draining the sender's message, so both sides fail cleanly and the pair stays usable).
    """
    if cores == 1 and variant == "mte" and type(src) is int:
        fast = ep.small_rx.get(src)
        if fast is not None and fast(buf, event_id):
            return buf
    irecv(ep, buf, src, event_id, cores, variant).wait()
    return buf


def _verdict(expect: int, got: int, event_id: int, got_event: int) -> int:
    """Compare a receiver's expectation with a descriptor; return OK or a status code."""
    e_n, e_lanes, e_dt, e_var = unpack_info(expect)
    g_n, g_lanes, g_dt, g_var = unpack_info(got)
    if got_event != event_id:
        return BAD_EVENT
    if g_n != e_n:
        return BAD_SIZE
    if g_lanes != e_lanes:
        return BAD_LANES
    if g_dt != e_dt:
        return BAD_DTYPE
    if (g_var == ZC) != (e_var == ZC):
        return BAD_VARIANT
    return OK


def _rx_error(ep, src, event_id, expect, got, got_event, status) -> ProtocolError:
    e, g = unpack_info(expect), unpack_info(got)
    return ProtocolError(
        f"die {ep.die_id} recv from die {src}: {STATUS_TEXT[status]}: expected event_id"
        f" {event_id}, {e[0]} B, cores {e[1]}, dtype {_dtype_of(e[2])},"
        f" {VARIANT_NAMES.get(e[3])}; the sender's message carries event_id {got_event},"
        f" {g[0]} B, cores {g[1]}, dtype {_dtype_of(g[2])},"
        f" {VARIANT_NAMES.get(g[3])} (send/recv mis-paired); message discarded"
    )


def _dtype_of(num: int) -> str:
    for code in np.typecodes["All"]:
        try:
            dt = np.dtype(code)
        except TypeError:
            continue
        if dt.num == num:
            return str(dt)
    return f"dtype#{num}"


def _reject(ep: Endpoint, src: int, seq: int, got: int, got_event: int, event_id: int,
            status: int) -> None:  # fmt: skip
    """Refuse message `seq` of `src` on all of its lanes with `status`, leaving the pair in step.

    A ring sender has written (or is writing) its chunks: drain them and ack every lane. A
    zero-copy sender only announced it and waits for rendezvous that will never come: ack every
    lane, then answer each lane's rendezvous wait with RDV_REJECT tagged with `seq`."""
    _, lanes, _, var = unpack_info(got)
    lanes = max(1, min(lanes, ep.lanes))
    if var != ZC:
        _drain(ep, src, seq, got, got_event, event_id, status)
        return
    t, me, rw = ep.tables, ep.die_id, ep.words[src]
    for i in range(lanes):
        ack, rdv = t.ack[me][i], t.rdv[me][i]
        rw[ack + L.ACK_EVENT] = event_id
        rw[ack + L.ACK_STATUS] = status
        rw[ack + L.ACK_DONE] = seq
        rw[rdv + L.RDV_EVENT] = RDV_REJECT
        rw[rdv + L.RDV_SEQ] = seq  # LAST: wakes that sender lane, which then reads the ack


def _drain(ep: Endpoint, src: int, seq: int, got: int, got_event: int, event_id: int,
           status: int) -> None:  # fmt: skip
    """Consume and discard a ring sender's whole message (all its lanes), acking with `status`."""
    n, lanes, _, _ = unpack_info(got)
    slot = ep.layout.slot_bytes
    rx = []
    for i, (a, b) in enumerate(stripes(n, max(1, min(lanes, ep.lanes)))):
        nch = max(1, -(-(b - a) // slot))
        rx.append(_Rx(ep, src, i, None, a, b, nch, seq, got_event, got, 0, status, event_id))
    _run_lanes(rx, ep)


def _app_offset(ep: Endpoint, buf: np.ndarray, nbytes: int) -> int:
    """Region offset of a zero-copy receive buffer, which must lie in this die's app area."""
    lo_ = ep.layout
    try:
        base = ep.local.offset_of(buf)
    except ValueError:
        base = -1
    if base < lo_.app_off or base + nbytes > lo_.app_off + lo_.app_bytes:
        raise ValueError(
            f"die {ep.die_id}: a zero-copy recv buffer must live in this die's app area"
            " (allocate it with die.alloc(...))"
        )
    return base


def _post_rendezvous(ep, buf, mv, src, seq, event_id, cores) -> None:
    """Zero-copy step 0 (clear-to-send): tell each sender lane where its stripe of `buf` lives.

    Posted only after the sender announced message `seq` and the receiver checked it, and tagged
    with `seq`: a sender lane takes exactly the rendezvous of its own message, never one left
    over from an earlier (completed, rejected or aborted) transfer.
    """
    base = _app_offset(ep, buf, len(mv))
    sw = ep.words[src]
    tr = ep.trace if ep.trace.enabled else None
    for i, (a, b) in enumerate(stripes(len(mv), cores)):
        f = ep.tables.rdv[ep.die_id][i]
        sw[f + L.RDV_EVENT] = event_id
        sw[f + L.RDV_OFF] = base + a
        sw[f + L.RDV_NBYTES] = b - a
        sw[f + L.RDV_SEQ] = seq  # LAST
        if tr:
            tr.rec(now_ns(), 0, "zc_recv", 0, src, i, event_id, b - a)


def _zc_probe(ep: Endpoint, src: int, event_id: int):
    """For the fast path's plain receive waiting on `src`'s tail_ptr: raise ProtocolError,
    after refusing it, if `src` announced a zero-copy send of the next message (a zero-copy
    sender never moves tail_ptr before it has a rendezvous, so the wait would only time out)."""
    t, me = ep.tables, ep.die_id
    lw, rw = ep.words[me], ep.words[src]
    desc, ack = t.desc[src][0], t.ack[me][0]

    def probe() -> None:
        # chunk_id FIRST, then msg_info: every sender stores msg_info before chunk_id, so a
        # chunk_id of a new message guarantees its msg_info is visible too (TSO). In the other
        # order a plain sender caught between its two stores would look like a zero-copy one.
        seq = lw[desc + L.DESC_CHUNK] >> SEQ_SHIFT
        got = lw[desc + L.DESC_INFO]
        if seq <= rw[ack + L.ACK_DONE] or unpack_info(got)[3] != ZC:
            return
        _reject(ep, src, seq, got, lw[desc + L.DESC_EVENT], event_id, BAD_VARIANT)
        raise ProtocolError(
            f"die {me} recv from die {src} (event_id {event_id}): {STATUS_TEXT[BAD_VARIANT]}:"
            " the sender announced a zero-copy send, this recv is not zero-copy; rejected"
        )

    return probe


# ------------------------------------------------------------------------------------------------
# Small-message fast path: one lane, one chunk, mte. The same fields, steps and publish order as
# the general path, without the Request and lane objects, whose set-up costs more than an 8-byte
# transfer. One closure per peer and direction keeps every index and view in a local cell, and
# the last buffer's flat view, length and msg_info are cached (a ping-pong reuses its buffers):
# at ~0.03-0.2 us per Python operation, every lookup saved is visible at 8 bytes.
# ------------------------------------------------------------------------------------------------


def _fill_cache(c: list, buf, writable: bool, limit: int, ub, slot_views) -> bool:
    """Cache a new buffer's views for the fast path; False if the message is not small."""
    if type(buf) is not np.ndarray or buf.nbytes > limit:
        return False
    mv = byte_view(buf, "recv buffer" if writable else "send buffer", writable)
    n = len(mv)
    info = n | 1 << 40 | buf.dtype.num << 48 | MTE << 56
    c[:] = [buf, mv, ub[:n], [v[:n] for v in slot_views], info]
    return True


def _small_tx(ep: Endpoint, dst: int):
    """The fast send to `dst`: returns False (nothing done) when the message is not small."""
    me = ep.die_id
    t = ep.tables
    dw, aw = ep.words[dst], ep.words[me]
    desc, ack = t.desc0[me], t.ack0[dst]
    d_chunk, d_tail, d_info = desc + 1, desc + 2, desc + 3
    a_head, a_done, a_status = ack + 1, ack + 2, ack + 3
    slots = t.slots
    slot_views = [
        ep.bytes[dst][t.ring0[me] + k * t.slot_bytes :][: t.slot_bytes] for k in range(slots)
    ]
    ub = ep.ub0
    limit = ep.small_bytes
    seqs = ep.tx_seq[dst]
    queued = ep.tx_queue[dst]
    trace = ep.trace
    # cache: buffer object, its flat view, UB view of its length, slot views of its length, info
    c = [None, None, None, None, 0]

    def tx(buf, event_id) -> bool:
        if queued:  # an isend to dst is outstanding: keep issue order via the general path
            return False
        if buf is not c[0] and not _fill_cache(c, buf, False, limit, ub, slot_views):
            return False
        if type(event_id) is not int or not 0 <= event_id < EVENT_LIMIT:
            _args(ep, buf, dst, event_id, 1, "mte", send=True)  # raises the precise error
        seq = seqs[0] + 1
        seqs[0] = seq
        tail = dw[d_tail]
        if tail - aw[a_head] >= slots:  # no credit (cannot happen between whole messages)
            ep.wait_ge(aw, a_head, tail - slots + 1, dst, "ack.head_ptr")
        if trace.enabled:
            return _small_tx_traced(ep, dst, c, seq, tail, event_id, dw, aw, desc, ack, slots)
        h = c[2]
        h[:] = c[1]  # step 1, MTE2: app -> UB
        c[3][tail % slots][:] = h  # step 2, MTE3: UB -> ring slot in the receiver
        dw[desc] = event_id  # step 3: descriptor words, tail_ptr LAST
        dw[d_info] = c[4]
        dw[d_chunk] = seq << SEQ_SHIFT
        dw[d_tail] = tail + 1
        if aw[a_done] < seq:  # step 4: poll own ack
            ep.wait_ge(aw, a_done, seq, dst, "ack.done")
        if aw[a_status]:  # step 8: a non-zero status is a rejection
            _check_ack(ep, aw, ack, dst, event_id)
        return True

    return tx


def _small_tx_traced(ep, dst, c, seq, tail, event_id, dw, aw, desc, ack, slots) -> bool:
    tr, n = ep.trace, len(c[1])
    t0 = now_ns()
    c[2][:] = c[1]
    t1 = now_ns()
    c[3][tail % slots][:] = c[2]
    t2 = now_ns()
    dw[desc] = event_id
    dw[desc + 3] = c[4]
    dw[desc + 1] = seq << SEQ_SHIFT
    dw[desc + 2] = tail + 1
    t3 = now_ns()
    if aw[ack + 2] < seq:
        ep.wait_ge(aw, ack + 2, seq, dst, "ack.done")
    t4 = now_ns()
    for t_ns, dur, step in (
        (t0, t1 - t0, 1),
        (t1, t2 - t1, 2),
        (t3, 0, 3),
        (t3, t4 - t3, 4),
        (t4, 0, 8),
    ):
        tr.rec(t_ns, dur, "send", step, dst, 0, event_id, n)
    if aw[ack + 3]:
        _check_ack(ep, aw, ack, dst, event_id)
    return True


def _small_rx(ep: Endpoint, src: int):
    """The fast receive from `src`: returns False (nothing done) when the message is not small."""
    me = ep.die_id
    t = ep.tables
    lw, rw = ep.words[me], ep.words[src]
    desc, ack = t.desc0[src], t.ack0[me]
    d_chunk, d_tail, d_info = desc + 1, desc + 2, desc + 3
    a_head, a_done, a_status = ack + 1, ack + 2, ack + 3
    slots = t.slots
    slot_views = [
        ep.bytes[me][t.ring0[src] + k * t.slot_bytes :][: t.slot_bytes] for k in range(slots)
    ]
    ub = ep.ub0
    limit = ep.small_bytes
    queued = ep.rx_queue[src]
    trace = ep.trace
    c = [None, None, None, None, 0]

    def rx(buf, event_id) -> bool:
        if queued:
            return False
        if buf is not c[0] and not _fill_cache(c, buf, True, limit, ub, slot_views):
            return False
        if type(event_id) is not int or not 0 <= event_id < EVENT_LIMIT:
            _args(ep, buf, src, event_id, 1, "mte", send=False)  # raises the precise error
        head = rw[a_head]
        t0 = now_ns() if trace.enabled else 0
        if lw[d_tail] <= head:  # step 5: poll the inbound descriptor
            ep.wait_ge(lw, d_tail, head + 1, src, "desc.tail_ptr", _zc_probe(ep, src, event_id))
        if lw[d_info] != c[4] or lw[desc] != event_id:
            return _small_rx_mismatch(ep, buf, src, event_id, c[4], lw[d_info], lw[desc])
        t1 = now_ns() if trace.enabled else 0
        h = c[2]
        h[:] = c[3][head % slots]  # step 6: ring -> UB -> app, then the credit
        c[1][:] = h
        rw[a_head] = head + 1
        rw[ack] = event_id  # step 7: event id, status, done LAST
        rw[a_status] = 0
        rw[a_done] = lw[d_chunk] >> SEQ_SHIFT
        if trace.enabled:
            t2 = now_ns()
            n = len(h)
            trace.rec(t0, t1 - t0, "recv", 5, src, 0, event_id, 0)
            trace.rec(t1, t2 - t1, "recv", 6, src, 0, event_id, n)
            trace.rec(t2, 0, "recv", 7, src, 0, event_id, n)
        return True

    return rx


def _small_rx_mismatch(ep, buf, src, event_id, expect, got, got_event) -> bool:
    status = _verdict(expect, got, event_id, got_event)
    if status:
        seq = ep.words[ep.die_id][ep.tables.desc0[src] + L.DESC_CHUNK] >> SEQ_SHIFT
        _reject(ep, src, seq, got, got_event, event_id, status)
        raise _rx_error(ep, src, event_id, expect, got, got_event, status)
    # compatible but not the fast shape (a dma sender, say): take the general path
    irecv(ep, buf, src, event_id).wait()
    return True


# ------------------------------------------------------------------------------------------------
# Recovery
# ------------------------------------------------------------------------------------------------


def resync(ep: Endpoint) -> int:
    """Discard every in-flight message and outstanding request of this die; return how many.

    Run on every die while the whole pod is idle (the launcher does so after a `pod.run` that
    raised): as a receiver, each inbound ring is emptied (head_ptr = tail_ptr) and any unacked
    message is acked with status ABORTED (a zero-copy rendezvous is tagged with its message, so a
    stale one can never be taken for a later message);
    outstanding requests fail with PodAborted and the DMA engine is restarted. Counters only move
    forward, so the monotonic-flag rule still holds.
    """
    dropped = 0
    for req in list(ep.active):
        req._finish(PodAborted(f"die {ep.die_id}: request to/from die {req.peer} discarded"))
        dropped += 1
    for q in ep.tx_queue + ep.rx_queue:
        q.clear()
    ep.close()  # the DMA engine fails its jobs and exits; a new one starts on demand
    t, me, lw = ep.tables, ep.die_id, ep.words[ep.die_id]
    for peer in range(ep.num_dies):
        if peer == me:
            continue
        rw = ep.words[peer]
        for lane in range(ep.lanes):
            desc, ack = t.desc[peer][lane], t.ack[me][lane]
            tail = lw[desc + L.DESC_TAIL]
            if rw[ack + L.ACK_HEAD] < tail:
                rw[ack + L.ACK_HEAD] = tail
                dropped += 1
            seq = lw[desc + L.DESC_CHUNK] >> SEQ_SHIFT
            if rw[ack + L.ACK_DONE] < seq:
                rw[ack + L.ACK_EVENT] = -1
                rw[ack + L.ACK_STATUS] = ABORTED
                rw[ack + L.ACK_DONE] = seq
    return dropped
