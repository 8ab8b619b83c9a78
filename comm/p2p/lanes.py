"""Lane state machines of the ring variants (mte, dma) and of every receive.

pump() moves as far as possible without blocking and says if it moved; blocked() names the one
word the lane waits for; finished() is true once the lane is complete. The zero-copy sender
lane is `comm.p2p.zero_copy.TxZeroCopy`; a request (`comm.p2p.request`) or the DMA engine
(`comm.dma`) drives them.
"""

from __future__ import annotations

from collections.abc import Sequence

from comm.endpoint import Endpoint
from comm.p2p.message import DMA, MTE, OK, SEQ_SHIFT, ZC, check_ack, copy_bytes, trace_done
from comm.trace import now_ns
from memory import layout as L
from memory.errors import ProtocolError


class TxRing:
    """Sender lane of the ring variants (mte, dma)."""

    __slots__ = (
        "ep", "dst", "lane", "src", "lo", "hi", "k", "nchunks", "seq", "event_id", "info",
        "dw", "desc", "aw", "ack", "ring", "ring_off", "tail", "dma", "op", "fin", "fab", "sid",
        "t_acq",
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
        self.tail = self.dw[self.desc + L.DESC_TAIL]  # (a remote dst: the mirror, our shadow)
        self.fin = False
        # A die on another host (docs/protocols.md §11): the slot and the payload words go
        # over the fabric, then chunk_id and tail_ptr are published after them.
        self.fab = ep.fab if ep.fab.remote[dst] else None
        self.sid, self.t_acq = -1, 0  # a capture pod: this lane's stream (`lane_streams`)

    def pump(self) -> bool:
        k, nch = self.k, self.nchunks
        if k == nch:
            return False
        if self.sid >= 0:
            return self._pump_captured()
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
                copy_bytes(self.ring[off : off + b - a], self.src[a:b])
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
            chunk = self.seq << SEQ_SHIFT | (k + run - 1)
            tail += run
            if self.fab is not None:
                _publish_chunk(self.fab, self.dst, off, b - a, desc, chunk, tail)
            else:
                dw[desc + L.DESC_CHUNK] = chunk
                dw[desc + L.DESC_TAIL] = tail
            if tr:
                tr.rec(now_ns(), 0, self.op, 3, self.dst, self.lane, self.event_id, b - a)
            k += run
            moved = True
            head = aw[ack + L.ACK_HEAD]
        self.k, self.tail = k, tail
        return moved

    def _pump_captured(self) -> bool:
        """`pump` in a capture pod, canonical (docs/projection.md): a chunk at a time (dma: a
        run of half the ring or to its end), each once its credit is in, recorded as its
        guarded step, the slot's put and the descriptor's publish, whatever credits the host
        happened to have."""
        ep, cap = self.ep, self.ep.cap
        lo_ = ep.layout
        slots, C = lo_.ring_slots, lo_.slot_bytes
        moved = False
        with cap.on(self.sid):
            while self.k < self.nchunks:
                k, tail = self.k, self.tail
                run = min(self.nchunks - k, slots - tail % slots, slots // 2) if self.dma else 1
                need = tail + run - slots  # head_ptr this chunk's credit needs
                if self.aw[self.ack + L.ACK_HEAD] < need:
                    self.t_acq = self.t_acq or now_ns()
                    return moved
                cap.acq((self.ack + L.ACK_HEAD,), (need,), (self.dst,), "ack.head_ptr",
                        self.t_acq or now_ns())  # fmt: skip
                self.t_acq = 0
                a = self.lo + k * C
                b = min(self.hi, a + run * C)
                off = self.ring_off + (tail % slots) * C
                if self.dma:
                    copy_bytes(self.ring[off : off + b - a], self.src[a:b])
                else:
                    self._mte(a, b, off, k, None)
                self.dw[self.desc + L.DESC_EVENT] = self.event_id
                self.dw[self.desc + L.DESC_INFO] = self.info
                self.tail = tail + run
                chunk = self.seq << SEQ_SHIFT | (k + run - 1)
                _publish_chunk(self.fab, self.dst, off, b - a, self.desc, chunk, self.tail)
                self.k = k + run
                moved = True
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
            if self.sid >= 0 and self.k == self.nchunks:
                self.t_acq = self.t_acq or now_ns()
            return False
        self.fin = True
        if self.sid >= 0:  # step 8, the ack: this lane's last guarded step
            cap = self.ep.cap
            with cap.on(self.sid):
                cap.acq((self.ack + L.ACK_DONE,), (self.seq,), (self.dst,), "ack.done",
                        self.t_acq or now_ns())  # fmt: skip
        trace_done(self.ep, self.op, self.dst, self.lane, self.event_id, self.hi - self.lo)
        return True

    def check(self) -> None:
        """Raise the receiver's refusal of this lane (call once every lane is finished)."""
        check_ack(self.ep, self.aw, self.ack, self.dst, self.event_id)


def _publish_chunk(fab, dst: int, off: int, nbytes: int, desc: int, chunk: int, tail: int):
    """A ring chunk to a die on another host: the slot bytes and the descriptor's payload words
    (event id, msg_info), then chunk_id and tail_ptr as guards after one flush. The two guards
    may land in either order: the receiver takes "tail moved, chunk_id of an earlier message"
    as not yet (`Rx.pump`)."""
    fab.push(dst, off, nbytes)
    fab.push_words(dst, desc + L.DESC_EVENT)
    fab.push_words(dst, desc + L.DESC_INFO)
    fab.publish_many(dst, (desc + L.DESC_CHUNK, desc + L.DESC_TAIL), (chunk, tail))


def publish_ack(fab, src: int, ack: int, head: int, done: int | None) -> None:
    """A receiver lane's credit (and its ack, if `done`) to a sender on another host: ack's
    event id and status as payload, then head_ptr and done as guards."""
    if done is None:
        fab.publish(src, ack + L.ACK_HEAD, head)
        return
    fab.push_words(src, ack + L.ACK_EVENT)
    fab.push_words(src, ack + L.ACK_STATUS)
    fab.publish_many(src, (ack + L.ACK_HEAD, ack + L.ACK_DONE), (head, done))


class Rx:
    """Receiver lane: consume ring chunks (mte via UB, dma direct, or drain) or zero-copy.

    Every chunk it takes must carry the message's seq, event id and msg_info in this lane's
    descriptor (the sender stores them before tail_ptr): a lane holding another message's data
    is a ProtocolError, never a silent success."""

    __slots__ = (
        "ep", "src", "lane", "dst", "lo", "hi", "k", "nchunks", "seq", "event_id", "info", "mode",
        "status", "ack_event", "lw", "desc", "rw", "ack", "ring", "ring_off", "head", "acked",
        "t_wait", "op", "fab", "sid", "t_acq",
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
        self.head = self.rw[self.ack + L.ACK_HEAD]  # (a remote src: our shadow in its mirror)
        self.acked = False
        self.t_wait = now_ns()
        self.fab = ep.fab if ep.fab.remote[src] else None
        self.sid, self.t_acq = -1, 0  # a capture pod: this lane's stream (`lane_streams`)

    def pump(self) -> bool:
        if self.acked:
            return False
        if self.sid >= 0:
            return self._pump_captured()
        ep = self.ep
        lw, desc = self.lw, self.desc
        tail = lw[desc + L.DESC_TAIL]
        head, k, nch = self.head, self.k, self.nchunks
        if head >= tail:
            return False
        got_seq = lw[desc + L.DESC_CHUNK] >> SEQ_SHIFT
        if got_seq < self.seq and self.fab is not None:
            return False  # a remote sender's tail_ptr landed before its chunk_id: not yet
        if (
            got_seq != self.seq
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
                    copy_bytes(self.dst[a:b], self.ring[off : off + b - a])
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
        elif self.fab is not None:
            publish_ack(self.fab, self.src, ack, head, None)  # one credit per pump
        return True

    def _pump_captured(self) -> bool:
        """`pump` in a capture pod, canonical: a chunk at a time (dma: the sender's runs, the
        same function of the ring position), each recorded as its guarded step (tail_ptr),
        its copy out of the ring (none for zero-copy) and its credit, the last one the ack."""
        ep, cap = self.ep, self.ep.cap
        lo_ = ep.layout
        slots, C = lo_.ring_slots, lo_.slot_bytes
        lw, desc, mode = self.lw, self.desc, self.mode
        moved = False
        with cap.on(self.sid):
            while self.k < self.nchunks:
                head, k = self.head, self.k
                run = min(self.nchunks - k, slots - head % slots, slots // 2) if mode == DMA else 1
                if lw[desc + L.DESC_TAIL] < head + run or (
                    lw[desc + L.DESC_CHUNK] >> SEQ_SHIFT < self.seq
                ):
                    self.t_acq = self.t_acq or now_ns()
                    return moved
                if (
                    lw[desc + L.DESC_CHUNK] >> SEQ_SHIFT != self.seq
                    or lw[desc + L.DESC_EVENT] != self.event_id
                    or lw[desc + L.DESC_INFO] != self.info
                ):
                    raise self._foreign()
                cap.acq((desc + L.DESC_TAIL,), (head + run,), (self.src,), "desc.tail_ptr",
                        self.t_acq or now_ns())  # fmt: skip
                self.t_acq = 0
                if mode in (MTE, DMA):
                    a = self.lo + k * C
                    b = min(self.hi, a + run * C)
                    off = self.ring_off + (head % slots) * C
                    t0 = now_ns()
                    if mode == DMA:
                        copy_bytes(self.dst[a:b], self.ring[off : off + b - a])
                    else:
                        self._mte(a, b, off, k)
                    cap.copy(b - a, t0)
                self.head, self.k = head + run, k + run
                self.rw[self.ack + L.ACK_HEAD] = self.head
                if self.k == self.nchunks:
                    self._ack(None)
                else:
                    publish_ack(self.fab, self.src, self.ack, self.head, None)
                moved = True
        return moved

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
        if self.fab is not None:
            publish_ack(self.fab, self.src, ack, self.head, self.seq)
        else:
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


def lane_streams(ep: Endpoint, lanes: Sequence, tx: bool, peer: int, sid: int,
                 seq: int) -> None:  # fmt: skip
    """A capture pod: give each lane its stream (`p2p.tx.D.L`, `p2p.rx.S.L`; the DMA engine's:
    `dma.*`), starting after event `seq` of stream `sid` (its call's begin, or where the
    receive learned of the message)."""
    cap = ep.cap
    for ln in lanes:
        kind = "dma" if getattr(ln, "dma", False) or getattr(ln, "mode", 0) == DMA else "p2p"
        ln.sid = cap.stream(f"{kind}.{'tx' if tx else 'rx'}.{peer}.{ln.lane}")
        if ln.sid != sid:
            cap.after(ln.sid, sid, seq)


def check_lanes(lanes: Sequence) -> None:
    """Raise the first lane's refusal, once EVERY lane is acked: a sender that gave up at the
    first refused lane would start its next message while the receiver still drains the other
    lanes, whose rings would then hold a chunk of each message (the next receive takes the
    refused message's chunk for its own: wrong bytes, acked)."""
    for ln in lanes:
        ln.check()


def run_lanes(lanes: Sequence, ep: Endpoint) -> None:
    """Drive lanes to completion (the DMA engine's loop, and the drain of a bad message)."""
    while True:
        for ln in lanes:
            ln.pump()
        pending = [ln for ln in lanes if not ln.finished()]
        if not pending:
            check_lanes(lanes)
            return
        words, idx, target, peer, field = pending[0].blocked()
        ep.wait_ge(words, idx, target, peer, field)
