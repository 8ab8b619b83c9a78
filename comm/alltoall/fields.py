"""The field and flag protocol that the pull, fused and A2E paths share (docs/protocols.md §6-8).

Pull fields: in every die's meta area, `pull[kind][half][src]` (kind 0 dispatch, 1 combine),
written only by `src`: | event_id | off (row) | count | seq |, seq (the per-kind operation
number, the same on every die) stored LAST (`publish`, polled by `poll_fields`). Fused and A2E
flags: event id, count, quant code, then the operation number LAST (`publish_flag`). A die that
refuses its input publishes count = REFUSED (`comm.alltoall.refuse`). To a die on another host
the words before the polled one are pushed and the polled one is published (`comm.fabric`).
"""

from __future__ import annotations

from comm.endpoint import Endpoint
from comm.fabric import Fabric
from memory import layout as L
from memory.errors import PeerRefused, ProtocolError

DISPATCH, COMBINE = 0, 1
F_EVENT, F_OFF, F_COUNT, F_SEQ = L.PULL_EVENT, L.PULL_OFF, L.PULL_COUNT, L.PULL_SEQ
G_EVENT, G_COUNT, G_SEQ, G_QUANT = L.FLAG_EVENT, L.FLAG_COUNT, L.FLAG_SEQ, L.FLAG_QUANT
QUANT_CODE = {None: 0, "int8": 1}  # what the rows of a dispatch hold, carried in its fields
DEDUP_CODE = 2  # added to the quant code: one row per (token, destination die), §6.3
QUANT_NAME = {0: "float32", 1: "int8", 2: "float32 dedup", 3: "int8 dedup"}
OFF_BITS = 48  # a pull field's off word: row offset | code << OFF_BITS
OP_CODE_MASK = (1 << 15) - 1  # a combine's code: its dispatch's operation number mod 2**15
REFUSED = L.COUNT_REFUSED
BAD_EVENT = -1  # the event_id word published by a die whose own event_id was invalid


def publish(ep: Endpoint, kind: int, half: int, dst: int, event_id: int, off: int, count: int,
            seq: int, code: int = 0) -> None:  # fmt: skip
    """Step 4: offset (with `code`: the rows' quant code in a dispatch, the reversed dispatch's
    operation number mod 2**15 in a combine) and count, then seq LAST, into dst's field for
    this source."""
    w = ep.words[dst]
    f = ep.layout.pull_field_word(kind, half, ep.die_id)
    w[f + F_EVENT] = event_id
    w[f + F_OFF] = off | code << OFF_BITS
    w[f + F_COUNT] = count
    fab = ep.fab
    if fab.any_remote and fab.remote[dst]:  # another host: the payload words, then seq
        fab.push_words(dst, f, F_SEQ)
        fab.publish(dst, f + F_SEQ, seq)
        return
    w[f + F_SEQ] = seq


def poll_fields(ep: Endpoint, kind: int, half: int, op: int, event_id: int, code: int) -> list:
    """Step 5: wait for every source's field of this operation; (off, count) per source.

    Every source is waited for before any problem is raised (`comm.alltoall.pull`: reuse of a
    half)."""
    lw = ep.words[ep.die_id]
    lo = ep.layout
    out, problems = [], []
    name = "dispatch" if kind == DISPATCH else "combine"
    for src in range(ep.num_dies):
        f = lo.pull_field_word(kind, half, src)
        ep.acquire(lw, f + F_SEQ, op, src, f"pull.{name}[{half}].seq")
        if lw[f + F_SEQ] != op:
            raise ProtocolError(
                f"die {ep.die_id}: pull {name} field of die {src} carries operation"
                f" {lw[f + F_SEQ]}, expected {op} (dispatch/combine calls out of step)"
            )
        count, off = lw[f + F_COUNT], lw[f + F_OFF]
        if count == REFUSED:
            problems.append(refused(ep, src, f"pull {name}", op))
        else:
            bad = mispaired(ep, f"pull {name}", src, event_id, lw[f + F_EVENT], code,
                            off >> OFF_BITS)  # fmt: skip
            if bad is not None:
                problems.append(bad)
        out.append((off & ((1 << OFF_BITS) - 1), count))
    if problems:
        raise problems[0]
    return out


def mispaired(
    ep: Endpoint, what: str, src: int, event_id: int, got_event: int, code: int, got_code: int
) -> ProtocolError | None:
    """A ProtocolError if a source's operation names another event id or code than ours (a
    dispatch: the rows' quant; a combine: the dispatch it reverses)."""
    if got_event != event_id:
        return ProtocolError(
            f"die {ep.die_id}: {what} from die {src}: expected event_id {event_id}, the source"
            f" published {got_event} (calls mis-paired)"
        )
    if got_code == code:
        return None
    if "combine" in what:
        return ProtocolError(
            f"die {ep.die_id}: {what} from die {src}: it reverses dispatch operation"
            f" {got_code} (mod 2**15), this die {code} (handles of different dispatches)"
        )
    return ProtocolError(
        f"die {ep.die_id}: {what} from die {src}: the source sent"
        f" {QUANT_NAME.get(got_code, got_code)} rows, this die asked for"
        f" {QUANT_NAME.get(code, code)} (quant differs between the dies' calls)"
    )


def refused(ep: Endpoint, src: int, what: str, op: int) -> PeerRefused:
    return PeerRefused(
        f"die {ep.die_id}: die {src} refused its input to {what} operation {op} (its own error"
        " says why); this die's part was discarded, the pod stays in step"
    )


def publish_flag(
    ep: Endpoint, dst: int, f: int, event_word: int, count: int, op: int, code: int = 0
) -> None:
    """A fused / a2e flag: event id, count, quant code, then the operation number LAST."""
    w = ep.words[dst]
    w[f + G_EVENT] = event_word
    w[f + G_COUNT] = count
    w[f + G_QUANT] = code
    fab = ep.fab
    if fab.any_remote and fab.remote[dst]:
        carry_flag(fab, dst, f, op)
        return
    w[f + G_SEQ] = op


def carry_flag(fab: Fabric, peer: int, f: int, op: int) -> None:
    """A flag at word f of a die on another host, written in its mirror but for the seq
    word: the payload words (event id, count, quant code) pushed, then seq published LAST."""
    fab.push_words(peer, f, G_SEQ)  # event id, count
    fab.push_words(peer, f + G_QUANT)
    fab.publish(peer, f + G_SEQ, op)
