"""What the all-to-all carries over the fabric to dies on other hosts (MULTIHOST §4, `comm.fabric`).

On one host every region is mapped and none of this runs: each caller tests
`ep.fab.any_remote` first. A die on another host is a mirror: the paths write it as they
write a mapping (the numba kernels through its address), then call these to carry over what
they wrote, data and payload words by `push`, then the polled word by `publish` (rule R3);
the pull paths `pull` a source's rows before reading them (R4). A push never covers a guard
word, nor bytes another die writes in that region: combine rows go as runs of consecutive
(slot, k) rows, since the other k of a slot come from other dies.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from comm.capture import tokens_of
from comm.endpoint import Endpoint, shifted
from comm.fabric import Fabric
from memory import layout as L


def push_runs(fab: Fabric, peer: int, base: int, stride: int, lin: np.ndarray, nbytes: int) -> None:
    """Push rows lin (indices, any order, distinct) of an area at byte `base` of peer's
    region, rows `stride` bytes apart, `nbytes` written at the start of each: one push per
    run of consecutive rows (a run also carries the unused tail of its rows but its last)."""
    if not len(lin):
        return
    s = np.sort(lin)
    cut = np.flatnonzero(np.diff(s) != 1) + 1
    firsts = s[np.concatenate(([0], cut))].tolist()
    lasts = s[np.concatenate((cut - 1, [len(s) - 1]))].tolist()
    for a, b in zip(firsts, lasts, strict=True):
        fab.push(peer, base + a * stride, (b - a) * stride + nbytes)


def push_combine(ep: Endpoint, peer: int, lin: np.ndarray, op: int, refusal: bool = False,
                 words: bool = True) -> None:  # fmt: skip
    """A fused combine (or E2A) to a remote peer, after its rows were written in the mirror:
    this die's event id word (and its refusal word, `refusal`), the rows at lin (none for a
    refusal), then their completion words LAST (`words`; else the caller publishes them with
    `publish_slots` once it carried every peer's rows)."""
    fab, lo, me = ep.fab, ep.layout, ep.die_id
    fab.push_words(peer, lo.fused_cevent_off // L.WORD + me)
    if refusal:
        fab.push_words(peer, lo.fused_refuse_off // L.WORD + me)
    else:
        row = lo.a2a_hidden * lo.a2a_combine_bytes
        if ep.cap is not None:  # a capture pod: the rows (in place already) as one put
            ep.cap.rows(peer, len(lin), tokens_of(lin // lo.a2a_topk), lo.pull_comb_stride)
            ep.cap.put(peer, len(lin) * lo.pull_comb_stride, "fused_comb")
        else:
            push_runs(fab, peer, lo.fused_comb_off, lo.pull_comb_stride, lin, row)
    if words:
        publish_slots(ep, peer, lin, op)


def publish_slots(ep: Endpoint, peer: int, lin: np.ndarray, op: int) -> None:
    """The completion words of the combine rows at lin of a remote peer, after the rows."""
    base = ep.layout.fused_cflag_off // L.WORD
    words = (lin + base).tolist()
    ep.fab.publish_many(peer, words, [op] * len(words))


def pull_blocks(ep: Endpoint, base: int, stride: int, where: Sequence[tuple[int, int]]) -> None:
    """Bring every remote source's rows [off, off + count) of its area at byte `base` (rows
    `stride` bytes apart) into its mirror, before they are read; where[src] = (off, count),
    already checked against the area."""
    fab, cap = ep.fab, ep.cap
    for src in shifted(ep, range(len(where))):
        off, count = where[src]
        if count > 0 and fab.remote[src]:
            if cap is not None:
                cap.rows(src, count, 0, stride)
            fab.pull(src, base + off * stride, count * stride)
