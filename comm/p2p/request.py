"""Requests: one message between this die and one peer, over `cores` lanes (docs/protocols.md
§4.4); `isend` / `irecv` start every transfer but the small-message fast path; `resync`
discards them after a failed `pod.run`."""

from __future__ import annotations

import os
import time

import numpy as np

from comm.endpoint import Endpoint
from comm.p2p.lanes import Rx, TxRing, check_lanes, lane_streams, publish_ack
from comm.p2p.message import ABORTED, DMA, SEQ_SHIFT, ZC, check_args, pack_info, stripes
from comm.p2p.mismatch import reject, rx_error, verdict
from comm.p2p.zero_copy import TxZeroCopy, app_offset, post_rendezvous
from comm.trace import now_ns
from memory import layout as L
from memory.errors import PeerTimeout, PodAborted


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
        "begin",
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
        cap = ep.cap  # a capture pod: the call starts on the caller's stream (main)
        self.begin = -1 if cap is None else cap.begin("send" if is_send else "recv", event_id,
                                                       cap.main)  # fmt: skip

    def advance(self) -> bool:
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
                check_lanes(self._lanes)
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
        cap = self.ep.cap
        # the call ends once every lane has; a call that failed (aborted, a peer's error) has
        # no end: its log shows a call that began and never ended, which no replay accepts
        if cap is not None and self.begin >= 0 and error is None:
            joins = [(ln.sid, cap.last(ln.sid)) for ln in self._lanes or () if ln.sid >= 0]
            cap.end("send" if self.is_send else "recv", self.event_id, joins)

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
        if self.ep.ctx.progress is not None:
            self.ep.ctx.progress()
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


def isend(
    ep: Endpoint, buf: np.ndarray, dst: int, event_id: int, cores: int = 1, variant: str = "mte"
) -> Request:
    """Start sending `buf` to die `dst`; returns a Request (see `send` for the arguments).

    `variant="dma"` hands the whole transfer to the die's DMA engine, so the caller is free (no
    CPU spent) until `wait()`; mte and zero-copy advance whenever `test()` / `wait()` is called.
    """
    mv, var = check_args(ep, buf, dst, event_id, cores, variant, send=True)
    info = pack_info(len(mv), cores, buf.dtype.num, var)
    event_id = int(event_id)

    def start():
        spans = stripes(len(mv), cores)
        seq = ep.tx_seq[dst][0] = ep.tx_seq[dst][0] + 1  # one seq per message of the pair
        if var == ZC:
            lanes = [
                TxZeroCopy(ep, dst, i, mv, a, b, seq, event_id, info)
                for i, (a, b) in enumerate(spans)
            ]
            if ep.cap is not None:  # after lane 0's announcement (on the caller's stream)
                lane_streams(ep, lanes, True, dst, ep.cap.main, ep.cap.last(ep.cap.main))
            return lanes
        lanes = [
            TxRing(ep, dst, i, mv, a, b, seq, event_id, info, var == DMA)
            for i, (a, b) in enumerate(spans)
        ]
        if ep.cap is not None:
            lane_streams(ep, lanes, True, dst, ep.cap.main, req.begin)
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
    mv, var = check_args(ep, buf, src, event_id, cores, variant, send=False)
    event_id = int(event_id)
    expect = pack_info(len(mv), cores, buf.dtype.num, var)
    if var == ZC:
        app_offset(ep, buf, len(mv))  # refuse before anything is published
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
        cap = ep.cap
        if cap is not None:  # step 5's first guarded step: the message's start on lane 0
            sid0 = cap.stream(f"{'dma' if var == DMA else 'p2p'}.rx.{src}.0")
            cap.after(sid0, cap.main, req.begin)
            with cap.on(sid0):
                cap.acq((chunk0,), (seq << SEQ_SHIFT,), (src,), "desc.chunk_id", t_start)
        got, got_event = lw[chunk0 - L.DESC_CHUNK + L.DESC_INFO], lw[chunk0 - L.DESC_CHUNK]
        status = verdict(expect, got, event_id, got_event)
        if status:
            reject(ep, src, seq, got, got_event, event_id, status)
            raise rx_error(ep, src, event_id, expect, got, got_event, status)
        spans = stripes(len(mv), cores)
        if var == ZC and cap is not None:  # the rendezvous: lane 0's step 0
            with cap.on(sid0):
                post_rendezvous(ep, buf, mv, src, seq, event_id, cores)
        elif var == ZC:
            post_rendezvous(ep, buf, mv, src, seq, event_id, cores)
        slot = ep.layout.slot_bytes
        lanes = [
            Rx(
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
        if cap is not None:  # every lane after lane 0's start (the rendezvous posted on it)
            lane_streams(ep, lanes, False, src, sid0, cap.last(sid0))
        if var == DMA:
            req._job = ep.dma.submit(lanes)
        return lanes

    t_start = now_ns()
    req = Request(ep, src, False, event_id, start)
    req.test()
    return req


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
        rw = ep.words[peer]  # a remote peer: the mirror (our shadow of the words we write)
        fab = ep.fab if ep.fab.remote[peer] else None
        for lane in range(ep.lanes):
            desc, ack = t.desc[peer][lane], t.ack[me][lane]
            tail = lw[desc + L.DESC_TAIL]
            head, done = rw[ack + L.ACK_HEAD], rw[ack + L.ACK_DONE]
            if head < tail:
                rw[ack + L.ACK_HEAD] = head = tail
                dropped += 1
            seq = lw[desc + L.DESC_CHUNK] >> SEQ_SHIFT
            if done < seq:
                rw[ack + L.ACK_EVENT] = -1
                rw[ack + L.ACK_STATUS] = ABORTED
                rw[ack + L.ACK_DONE] = done = seq
            if fab is not None:
                publish_ack(fab, peer, ack, head, done)
    return dropped
