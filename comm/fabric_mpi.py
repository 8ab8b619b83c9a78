"""The fabric of a pod over several hosts: MPI-4 one-sided RMA (MULTIHOST.md §3).

Every die exposes its OWN region as one MPI window (`Win.Create` over the region's mapping,
`disp_unit=1`, so a window displacement is a region byte offset) and holds a passive-target
epoch on every rank for the pod's life (`Lock_all(MODE_NOCHECK)`). Same-host dies stay real
mappings; a die on another host is a `comm.fabric.Mirror` that this die writes and reads as a
mapping, then carries over:

    push(peer, off, n)        Put of mirror bytes [off, off + n) into peer's region
    pull(peer, off, n)        Get of peer's bytes into the mirror, completed (Flush)
    publish(peer, word, v)    Flush the pushes before it, then an 8-byte Accumulate(REPLACE):
                              atomic per word (a Put may tear), completed (Flush)
    fetch_add(peer, word, v)  Fetch_and_op(SUM) + Flush, for every peer, this die included
                              (rule R7: every writer of such a word goes through the window)
    progress()                Win.Sync(): over osc/rdma + btl/tcp a remote store lands in this
                              die's region only while this die is inside MPI

Thread safety: MPI runs at THREAD_MULTIPLE (mpi4py's default), so the DMA engine's thread may
push while the die's thread publishes. A publish clears the peer's dirty mark *before* it
flushes: a push racing it either completes in that flush or leaves the mark set for the next
publish. Flush completes every RMA operation of the process to that target, whichever thread
issued it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from mpi4py import MPI

from comm.fabric import Fabric, Mirror
from memory import layout as L


class MpiFabric(Fabric):
    """A die's fabric in a multi-host pod (made inside the die process, after MPI init).

    Arguments:
        me: this die's id (its rank in `world`).
        world: the pod's communicator (rank = die id); `Win.Create` is collective over it.
        own: this die's Region (the window's memory).
        regions: by die id, the Region of every same-host die (this one included); entries of
            other hosts' dies are ignored (None is fine).
        hosts: the host of every die.
        layout: the region layout (the size of a mirror).
        poison: fill mirrors' data areas with `comm.fabric.POISON` (a missing pull reads it).
    """

    kind = "mpi"
    needs_progress = True  # over osc/rdma + btl/tcp a remote store lands only inside MPI

    def __init__(
        self,
        me: int,
        world,
        own,
        regions: Sequence,
        hosts: Sequence[int],
        layout: L.RegionLayout,
        poison: bool = False,
    ):
        hosts = [int(h) for h in hosts]
        n = world.Get_size()
        if len(hosts) != n or len(regions) != n:
            raise ValueError(f"MpiFabric: {len(hosts)} hosts, {len(regions)} regions, {n} ranks")
        views = []
        for d in range(n):
            if d == me:
                views.append(own)
            elif hosts[d] == hosts[me]:
                if regions[d] is None:
                    raise ValueError(f"MpiFabric: die {d} shares host {hosts[d]} but is not mapped")
                views.append(regions[d])
            else:
                views.append(Mirror(d, layout, poison))
        super().__init__(me, views)
        self.hosts = hosts
        self.world = world
        self.dirty = [False] * n
        self.fetch_adds = 0
        self.win = MPI.Win.Create(own._mmap, disp_unit=1, comm=world)
        self.win.Lock_all(MPI.MODE_NOCHECK)

    # -- the data path --------------------------------------------------------------------------

    def push(self, peer: int, off: int, nbytes: int) -> None:
        if self.remote[peer] and nbytes > 0:
            src = self.bytes[peer][off : off + nbytes]
            self.win.Put([src, MPI.BYTE], peer, target=(off, nbytes, MPI.BYTE))
            self.dirty[peer] = True
            self.pushes += 1
            self.push_bytes += nbytes

    def pull(self, peer: int, off: int, nbytes: int) -> None:
        if self.remote[peer] and nbytes > 0:
            dst = self.bytes[peer][off : off + nbytes]
            self.win.Get([dst, MPI.BYTE], peer, target=(off, nbytes, MPI.BYTE))
            self.win.Flush(peer)
            self.pulls += 1
            self.pull_bytes += nbytes

    def _flush_dirty(self, peer: int) -> None:
        if self.dirty[peer]:
            self.dirty[peer] = False  # before the flush: see the module docstring
            self.win.Flush(peer)

    def _put_word(self, peer: int, word: int, value: int) -> None:
        w = np.array([value], dtype=np.int64)  # fresh: alive until the Flush that follows
        self.win.Accumulate(
            [w, MPI.INT64_T], peer, target=(word * L.WORD, 1, MPI.INT64_T), op=MPI.REPLACE
        )

    def publish(self, peer: int, word: int, value: int) -> None:
        self.words[peer][word] = value  # the mirror: this die's shadow of what it alone writes
        if self.remote[peer]:
            self._flush_dirty(peer)
            self._put_word(peer, word, value)
            self.win.Flush(peer)
            self.publishes += 1

    def publish_many(self, peer: int, words: Sequence[int], values: Sequence[int]) -> None:
        w = self.words[peer]
        pairs = list(zip(words, values, strict=True))
        for i, v in pairs:
            w[i] = v
        if self.remote[peer] and pairs:
            self._flush_dirty(peer)
            for i, v in pairs:
                self._put_word(peer, i, v)
            self.win.Flush(peer)
            self.publishes += len(pairs)

    def fetch_add(self, peer: int, word: int, value: int) -> int:
        """Atomically add `value` to word `word` of `peer`'s region (any die, this one
        included, through the window); return the word's previous value."""
        origin = np.array([value], dtype=np.int64)
        result = np.zeros(1, dtype=np.int64)
        self.win.Fetch_and_op(
            [origin, MPI.INT64_T], [result, MPI.INT64_T], peer, word * L.WORD, MPI.SUM
        )
        self.win.Flush(peer)
        self.fetch_adds += 1
        return int(result[0])

    def flush(self, peer: int | None = None) -> None:
        if peer is None:
            self.dirty = [False] * len(self.dirty)
            self.win.Flush_all()
        elif self.remote[peer]:
            self.dirty[peer] = False
            self.win.Flush(peer)

    def progress(self) -> None:
        self.win.Sync()

    # -- bookkeeping ----------------------------------------------------------------------------

    def counters(self) -> dict[str, int]:
        return {**super().counters(), "fetch_adds": self.fetch_adds}

    def close(self) -> None:
        """End the epoch and free the window (collective over `world`: every die closes at
        once, at a normal stop), then unmap the mirrors. Safe to call more than once."""
        win, self.win = self.win, None
        if win is not None:
            try:
                win.Unlock_all()
            finally:
                win.Free()
        for d, r in enumerate(self.regions):
            if isinstance(r, Mirror) and r.array is not None:
                r.close()
                self.regions[d] = None


__all__ = ["MpiFabric"]
