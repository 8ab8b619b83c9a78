"""The combine-side writes that the fused combine and E2A share: rows straight into each token
die's combine buffer at (batch slot, k), then their completion words LAST; and the wait for them.
A token die on another host gets its rows in its mirror, then pushed, then its completion words
published (`comm.alltoall.remote.push_combine`).
"""

from __future__ import annotations

import numpy as np

from comm.alltoall.areas import comb_dtype, comb_flat_elems, meta_words
from comm.alltoall.handles import DedupGroups
from comm.alltoall.remote import publish_slots, push_combine
from comm.alltoall.state import kernels, region_addrs
from comm.capture import tokens_of
from comm.endpoint import Endpoint, shifted
from comm.quant import BF16
from comm.trace import now_ns
from memory.errors import ProtocolError

_NO_BITS = {2: np.zeros(0, np.uint16), 4: np.zeros(0, np.int32)}  # their bits, by size


def write_slots_by_src(
    ep: Endpoint,
    rows: np.ndarray,
    dest: np.ndarray,
    slots: np.ndarray,
    ks: np.ndarray,
    op: int,
    event_id: int,
) -> None:
    """Steps 1-2 of a fused combine (and of E2A): per destination, this die's event id word,
    then row i straight into die dest[i]'s combine buffer at (slots[i], ks[i]), one row copy
    each and no gathered temporary, then the completion words of those (slot, k) LAST. Rows in
    float32 are rounded to bfloat16 in the same pass (a bfloat16 pod; bfloat16 rows, forwarded
    by a trampoline, go as they are). Three compiled calls: the send plan
    (`comm.kernels.group_by_dest`, which also proves every index in range), the event words and
    rows of every destination (`fused_scatter`), then every
    completion word (`fused_cflags`)."""
    n = len(dest)
    if not n:
        return
    lo = ep.layout
    k = kernels()
    topk, cap = lo.a2a_topk, lo.a2a_max_batch * lo.a2a_topk
    order, lin = np.empty((2, n), np.int64)
    starts = np.empty(ep.num_dies + 1, np.int64)
    if k.group_by_dest(dest, slots, ks, topk, ep.num_dies, cap, order, lin, starts):
        _bad_plan(ep, dest, slots, ks, cap)
    cdt = comb_dtype(ep)
    rows = np.ascontiguousarray(rows)
    if rows.dtype != cdt and not (rows.dtype == np.float32 and cdt == BF16):
        raise TypeError(f"rows {rows.dtype} cannot go into a {cdt} combine buffer")
    if not rows.flags.writeable:  # the kernels are compiled for writeable arrays only
        rows = rows.copy()
    mem = region_addrs(ep)
    item = cdt.itemsize
    args = (order, lin, starts)
    place = (lo.fused_comb_off // item, lo.pull_comb_stride // item, lo.fused_cevent_off // 8,
             ep.die_id, event_id)  # fmt: skip
    # float32 rows into a bfloat16 buffer are rounded on the way; other rows go as they are
    bits = np.uint32 if rows.dtype != cdt else (np.uint16 if item == 2 else np.int32)
    k.fused_scatter(rows.view(bits), *args, mem.addrs, mem.nbytes, _NO_BITS[item], *place)
    k.fused_cflags(mem.addrs, mem.nbytes, lin, starts, lo.fused_cflag_off // 8, op)  # LAST
    if ep.fab.any_remote:  # the kernels wrote the mirrors of other hosts' dies: carry them,
        ends = starts.tolist()  # every row first, then every die's completion words
        runs = [(d, lin[ends[d] : ends[d + 1]]) for d in shifted(ep, range(ep.num_dies))
                if ends[d] < ends[d + 1] and ep.fab.remote[d]]  # fmt: skip
        for d, part in runs:
            push_combine(ep, d, part, op, words=False)
        local_rows(ep, lin[ends[ep.die_id] : ends[ep.die_id + 1]])
        for d, part in runs:
            publish_slots(ep, d, part, op)


def local_rows(ep: Endpoint, lin: np.ndarray) -> None:
    """A capture pod: the combine rows this die wrote into its own buffer (at lin), a local
    put with their rows (the per-row work counts as a remote row's does)."""
    if ep.cap is None or not len(lin):
        return
    lo = ep.layout
    ep.cap.rows(ep.die_id, len(lin), tokens_of(lin // lo.a2a_topk), lo.pull_comb_stride)
    ep.cap.put(ep.die_id, len(lin) * lo.pull_comb_stride, "fused_comb")


def _bad_plan(ep: Endpoint, dest, slots, ks, cap: int) -> None:
    """Raise the ProtocolError of a combine send plan `group_by_dest` refused; nothing sent."""
    topk = ep.layout.a2a_topk
    lin = slots * topk + ks
    bad = (dest < 0) | (dest >= ep.num_dies) | (ks < 0) | (ks >= topk) | (lin < 0) | (lin >= cap)
    i = int(np.flatnonzero(bad)[0])
    raise ProtocolError(
        f"die {ep.die_id}: combine row for die {int(dest[i])} at (slot {int(slots[i])}, k"
        f" {int(ks[i])}): outside the pod's {ep.num_dies} dies or the combine area of {cap}"
        " rows; nothing written"
    )


def write_groups_by_src(
    ep: Endpoint, rows: np.ndarray, g: DedupGroups, op: int, event_id: int
) -> None:
    """The fused combine after a dedup dispatch: per source die (groups are in source order),
    this die's event id word, then each group's pre-reduced row (rounded in the same pass)
    straight into the source's combine buffer at (slot, first k of this die), then those
    completion words LAST. The send plan is one compiled pass (`comm.kernels.dedup_plan`,
    which proves every row inside its buffer), then one compiled reduce per destination
    (`reduce_groups_raw`)."""
    n = len(g.src)
    if not n:
        return
    lo = ep.layout
    k = kernels()
    cap = lo.a2a_max_batch * lo.a2a_topk
    lin = np.empty(n, np.int64)
    starts = np.empty(ep.num_dies + 1, np.int64)
    if k.dedup_plan(g.src, g.slot, g.kfirst, lo.a2a_topk, ep.num_dies, cap, lin, starts):
        _bad_dedup_plan(ep, g, cap)
    rows = np.ascontiguousarray(rows)
    stride = lo.pull_comb_stride // lo.a2a_combine_bytes
    starts = starts.tolist()
    remote = ep.fab.remote if ep.fab.any_remote else [False] * ep.num_dies
    sent = []  # the remote dies' rows: their completion words go after every row
    if ep.cap is not None:  # each group pre-reduced over its experts' rows (bf16 on hardware)
        h, e = lo.a2a_hidden, len(g.pos)
        ep.cap.op("reduce_groups", 2 * e * h, 2 * e * h, 2 * n * h, unit="aiv", rows=e, groups=n)
    for d in shifted(ep, range(ep.num_dies)):
        a, b = starts[d], starts[d + 1]
        if a == b:
            continue
        meta_words(ep, d, lo.fused_cevent_off, ep.num_dies)[ep.die_id] = event_id
        dst = comb_flat_elems(ep, d)
        if k.reduce_groups_raw(rows, g.pos, g.start, g.w, a, dst, lin[a:b], stride, cap):  # remote
            raise ProtocolError(
                f"die {ep.die_id}: dedup combine groups [{a}, {b}) for die {d}: an entry"
                f" range or row index outside this die's {len(rows)} expert rows; nothing"
                " written"
            )
        if remote[d]:  # another host: the event word and rows written in its mirror
            push_combine(ep, d, lin[a:b], op, words=False)
            sent.append((d, lin[a:b]))
        else:
            local_rows(ep, lin[a:b])
            meta_words(ep, d, lo.fused_cflag_off, cap)[lin[a:b]] = op  # LAST
    for d, part in sent:
        publish_slots(ep, d, part, op)


def _bad_dedup_plan(ep: Endpoint, g: DedupGroups, cap: int) -> None:
    """Raise the ProtocolError of a dedup send plan `dedup_plan` refused; nothing sent."""
    topk = ep.layout.a2a_topk
    lin = g.slot * topk + g.kfirst
    bad = (g.src < 0) | (g.src >= ep.num_dies) | (g.kfirst < 0) | (g.kfirst >= topk)
    bad |= (lin < 0) | (lin >= cap)
    bad[1:] |= g.src[1:] < g.src[:-1]
    i = int(np.flatnonzero(bad)[0])
    raise ProtocolError(
        f"die {ep.die_id}: dedup combine row for die {int(g.src[i])} at (slot"
        f" {int(g.slot[i])}, k {int(g.kfirst[i])}): outside the pod's {ep.num_dies} dies, out"
        f" of source order, or outside the combine area of {cap} rows; nothing written"
    )


def wait_slots(
    ep: Endpoint,
    slots: np.ndarray,
    ks: np.ndarray,
    op: int,
    what: str,
    owners: np.ndarray | None = None,
) -> None:
    """Wait until the completion word of every (slot, k) of this die carries `op`."""
    lo = ep.layout
    topk = lo.a2a_topk
    flags = meta_words(ep, ep.die_id, lo.fused_cflag_off, lo.a2a_max_batch * topk)
    base = lo.fused_cflag_off // 8
    slots = np.ascontiguousarray(slots, np.int64)
    ks = np.ascontiguousarray(ks, np.int64)
    pending = kernels().first_pending
    t0 = now_ns()
    while True:
        j = pending(flags, slots, ks, topk, op)
        if j < 0:
            break
        peer = -1 if owners is None else int(owners[j])
        i = int(slots[j] * topk + ks[j])
        ep.wait_ge(ep.words[ep.die_id], base + i, op, peer, f"{what}.cflag[{i}]")
    if ep.cap is not None and len(slots):  # one guarded step over every routed slot
        if owners is None:
            raise ProtocolError(f"die {ep.die_id}: {what}: a capture needs each slot's writer")
        words = (base + slots * topk + ks).tolist()
        ep.cap.acq(words, [op] * len(words), np.asarray(owners).tolist(), f"{what}.cflag", t0)
