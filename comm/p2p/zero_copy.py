"""Zero-copy: the sender lane, the receiver's rendezvous (clear-to-send), the probe that turns
away a zero-copy announcement a plain fast receive would otherwise wait out (docs/protocols.md
§4.2.2)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from comm.endpoint import Endpoint
from comm.p2p.message import (
    BAD_VARIANT,
    RDV_REJECT,
    SEQ_SHIFT,
    STATUS_TEXT,
    ZC,
    check_ack,
    copy_bytes,
    stripes,
    trace_done,
    unpack_info,
)
from comm.p2p.mismatch import reject
from comm.trace import now_ns
from memory import layout as L
from memory.errors import ProtocolError


class TxZeroCopy:
    """Sender lane of zero-copy: wait for the receiver's rendezvous of THIS message (rdv.seq ==
    seq), write straight into its app area, publish the descriptor."""

    __slots__ = (
        "ep", "dst", "lane", "src", "lo", "hi", "seq", "event_id", "info", "dw", "desc",
        "aw", "ack", "rdv", "sent", "t_wait", "fin", "fab", "sid", "t_acq",
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
        self.sid, self.t_acq = -1, 0  # a capture pod: this lane's stream
        fab = self.fab = ep.fab if ep.fab.remote[dst] else None
        if lane == 0:
            # Ready-to-send: event id, msg_info, then chunk_id LAST, tail_ptr untouched. The
            # receiver starts its receive on the new seq and answers with a rendezvous tagged
            # with it (or a rejection). The previous message of the pair is acked on every lane
            # already, so nobody reads these words now.
            dw, desc = self.dw, self.desc
            dw[desc + L.DESC_EVENT] = event_id
            dw[desc + L.DESC_INFO] = info
            if fab is not None:  # payload words, then chunk_id as the guard (§11)
                fab.push_words(dst, desc + L.DESC_EVENT)
                fab.push_words(dst, desc + L.DESC_INFO)
                fab.publish(dst, desc + L.DESC_CHUNK, seq << SEQ_SHIFT)
            else:
                dw[desc + L.DESC_CHUNK] = seq << SEQ_SHIFT

    def pump(self) -> bool:
        if self.sent:
            return False
        ep, aw, rdv = self.ep, self.aw, self.rdv
        tag = aw[rdv + L.RDV_SEQ]
        if tag < self.seq:
            return False  # a rendezvous of an earlier message, or none yet
        if self.sid >= 0:
            with ep.cap.on(self.sid):
                ep.cap.acq((rdv + L.RDV_SEQ,), (self.seq,), (self.dst,), "rdv.seq", self.t_wait)
                return self._send()
        return self._send()

    def _send(self) -> bool:
        """The rendezvous of this message is in: check it, write the stripe, publish."""
        ep, aw, rdv = self.ep, self.aw, self.rdv
        tag = aw[rdv + L.RDV_SEQ]
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
        if self.fab is not None:  # another host: straight from the source (no mirror copy)
            self.fab.push_from(self.dst, off, self.src[self.lo : self.hi])
        else:
            copy_bytes(ep.bytes[self.dst][off : off + n], self.src[self.lo : self.hi])
        if tr:
            tr.rec(t0, now_ns() - t0, "zc_send", 2, self.dst, self.lane, self.event_id, n)
        # Payload first, descriptor next, tail_ptr LAST (the word the receiver lane polls).
        dw, desc = self.dw, self.desc
        dw[desc + L.DESC_EVENT] = self.event_id
        dw[desc + L.DESC_INFO] = self.info
        fab = self.fab
        if fab is not None:  # (the stripe went above), payload words, guards
            fab.push_words(self.dst, desc + L.DESC_EVENT)
            fab.push_words(self.dst, desc + L.DESC_INFO)
            fab.publish_many(self.dst, (desc + L.DESC_CHUNK, desc + L.DESC_TAIL),
                             (self.seq << SEQ_SHIFT, dw[desc + L.DESC_TAIL] + 1))  # fmt: skip
        else:
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
            if self.sent and self.sid >= 0:
                self.t_acq = self.t_acq or now_ns()
            return False
        self.fin = True
        if self.sid >= 0:  # step 8: this lane's last guarded step
            cap = self.ep.cap
            with cap.on(self.sid):
                cap.acq((self.ack + L.ACK_DONE,), (self.seq,), (self.dst,), "ack.done",
                        self.t_acq or now_ns())  # fmt: skip
        trace_done(self.ep, "zc_send", self.dst, self.lane, self.event_id, self.hi - self.lo)
        return True

    def check(self) -> None:
        """Raise the receiver's refusal of this lane (call once every lane is finished)."""
        check_ack(self.ep, self.aw, self.ack, self.dst, self.event_id)


def app_offset(ep: Endpoint, buf: np.ndarray, nbytes: int) -> int:
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


def post_rendezvous(ep: Endpoint, buf: np.ndarray, mv: memoryview, src: int, seq: int,
                    event_id: int, cores: int) -> None:  # fmt: skip
    """Zero-copy step 0 (clear-to-send): tell each sender lane where its stripe of `buf` lives.

    Posted only after the sender announced message `seq` and the receiver checked it, and tagged
    with `seq`: a sender lane takes exactly the rendezvous of its own message, never one left
    over from an earlier (completed, rejected or aborted) transfer.
    """
    base = app_offset(ep, buf, len(mv))
    sw = ep.words[src]
    tr = ep.trace if ep.trace.enabled else None
    fab = ep.fab if ep.fab.remote[src] else None
    for i, (a, b) in enumerate(stripes(len(mv), cores)):
        f = ep.tables.rdv[ep.die_id][i]
        sw[f + L.RDV_EVENT] = event_id
        sw[f + L.RDV_OFF] = base + a
        sw[f + L.RDV_NBYTES] = b - a
        if fab is not None:  # event, offset, size as payload, then the tag (§11)
            fab.push_words(src, f + L.RDV_EVENT, 3)
            fab.publish(src, f + L.RDV_SEQ, seq)
        else:
            sw[f + L.RDV_SEQ] = seq  # LAST
        if tr:
            tr.rec(now_ns(), 0, "zc_recv", 0, src, i, event_id, b - a)


def zc_probe(ep: Endpoint, src: int, event_id: int) -> Callable[[], None]:
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
        reject(ep, src, seq, got, lw[desc + L.DESC_EVENT], event_id, BAD_VARIANT)
        raise ProtocolError(
            f"die {me} recv from die {src} (event_id {event_id}): {STATUS_TEXT[BAD_VARIANT]}:"
            " the sender announced a zero-copy send, this recv is not zero-copy; rejected"
        )

    return probe
