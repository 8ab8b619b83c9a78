"""A receiver that finds the sender's message is not the one it asked for (docs/protocols.md
§4.5): the verdict, and the refusal that leaves the pair in step (drain the ring variants,
reject the zero-copy rendezvous, ack every lane with the status)."""

from __future__ import annotations

import numpy as np

from comm.endpoint import Endpoint
from comm.p2p.lanes import Rx, run_lanes
from comm.p2p.message import (
    BAD_DTYPE,
    BAD_EVENT,
    BAD_LANES,
    BAD_SIZE,
    BAD_VARIANT,
    OK,
    RDV_REJECT,
    STATUS_TEXT,
    VARIANT_NAMES,
    ZC,
    stripes,
    unpack_info,
)
from memory import layout as L
from memory.errors import ProtocolError


def verdict(expect: int, got: int, event_id: int, got_event: int) -> int:
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


def rx_error(ep: Endpoint, src: int, event_id: int, expect: int, got: int, got_event: int,
             status: int) -> ProtocolError:  # fmt: skip
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


def reject(ep: Endpoint, src: int, seq: int, got: int, got_event: int, event_id: int,
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
    fab = ep.fab if ep.fab.remote[src] else None
    for i in range(lanes):
        ack, rdv = t.ack[me][i], t.rdv[me][i]
        rw[ack + L.ACK_EVENT] = event_id
        rw[ack + L.ACK_STATUS] = status
        rw[rdv + L.RDV_EVENT] = RDV_REJECT
        if fab is not None:  # payload words, then done and the tag as guards (§11)
            for w in (ack + L.ACK_EVENT, ack + L.ACK_STATUS, rdv + L.RDV_EVENT):
                fab.push_words(src, w)
            fab.publish_many(src, (ack + L.ACK_DONE, rdv + L.RDV_SEQ), (seq, seq))
            continue
        rw[ack + L.ACK_DONE] = seq
        rw[rdv + L.RDV_SEQ] = seq  # LAST: wakes that sender lane, which then reads the ack


def _drain(ep: Endpoint, src: int, seq: int, got: int, got_event: int, event_id: int,
           status: int) -> None:  # fmt: skip
    """Consume and discard a ring sender's whole message (all its lanes), acking with `status`."""
    n, lanes, _, _ = unpack_info(got)
    slot = ep.layout.slot_bytes
    rx = []
    for i, (a, b) in enumerate(stripes(n, max(1, min(lanes, ep.lanes)))):
        nch = max(1, -(-(b - a) // slot))
        rx.append(Rx(ep, src, i, None, a, b, nch, seq, got_event, got, 0, status, event_id))
    run_lanes(rx, ep)
