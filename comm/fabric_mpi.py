"""The fabric of a pod over several hosts: MPI-4 one-sided RMA (MULTIHOST.md §3).

Every die exposes its OWN region as one MPI window (`Win.Create` over the region's mapping,
`disp_unit=1`, so a window displacement is a region byte offset) and holds a passive-target
epoch on every rank for the pod's life (`Lock_all(MODE_NOCHECK)`). Same-host dies stay real
mappings; a die on another host is a `comm.fabric.Mirror` that this die writes and reads as a
mapping, then carries over:

    push(peer, off, n)        Put of mirror bytes [off, off + n) into peer's region
    pull(peer, off, n)        Get of peer's bytes into the mirror, completed (Flush)
    publish(peer, word, v)    Flush the pushes before it, then an 8-byte Accumulate(REPLACE):
                              atomic per word (a Put may tear); not flushed after it: two
                              accumulates of one word from one origin land in order (MPI's
                              default accumulate_ordering), the guard lands while both sides
                              progress, and its origin buffer is kept until the next flush
    fetch_add(peer, word, v)  Fetch_and_op(SUM) + Flush, for every peer, this die included
                              (rule R7: every writer of such a word goes through the window)
    progress()                Win.Sync(): over osc/rdma + btl/tcp a remote store lands in this
                              die's region only while this die is inside MPI

Two ways to carry pushes and guards (`mode`):

- "store" (the default, `PodConfig.fabric="mpi"`): **store messages**. Pushes of up to
  `STORE_INLINE` bytes and guard words are records (region offset, bytes) appended to a
  per-peer batch; a publish appends its guards and sends the batch as ONE two-sided message
  (`Isend`, never blocking). A larger push sends the batch so far, then a header record and
  the bytes as the next message, which the target receives straight into its region. The
  target applies records in order in its `progress()`, with an aligned 8-byte store for a
  guard word (atomic on x86-64). MPI's non-overtaking order between one pair makes "data
  before guard" free: no flush, no lock round trip. Measured on this machine (2 ranks, btl/tcp
  over loopback): an 8-byte `Accumulate` blocks its caller ~45 us (osc/rdma emulates the
  atomic with a lock round trip), `Put` + `Flush` ~37 us; so an RMA publish costs two round
  trips and an RMA chunk of p2p about four.
- "rma" (`PodConfig.fabric="mpi-rma"`): one-sided, as MULTIHOST.md §3 designed it: `Put`,
  then `Flush` and `Accumulate(REPLACE)` per publish. Kept for comparison (`xpod bench p2p
  --hosts 1,1 --fabric mpi-rma`).

Pulls (`Get` + `Flush`) and atomics (`Fetch_and_op`) are one-sided in both modes.

Thread safety: MPI runs at THREAD_MULTIPLE (mpi4py's default), so the DMA engine's thread may
push while the die's thread publishes. A publish clears the peer's dirty mark *before* it
flushes: a push racing it either completes in that flush or leaves the mark set for the next
publish. Flush completes every RMA operation of the process to that target, whichever thread
issued it.
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Sequence

import numpy as np
from mpi4py import MPI

from comm.fabric import Fabric, Mirror
from memory import layout as L
from memory.errors import PodError

INFLIGHT_GUARDS = 64  # unflushed guard accumulates per peer before a flush
_REC2, _REC3 = struct.Struct("<qq"), struct.Struct("<qqq")
STORE_TAG = 0x5870  # the tag of store messages (the pod's own communicator)
STORE_INLINE = 64 << 10  # pushes up to this go inline in the batch; larger: a message each
BIG = -1  # a record's size word: "the next message holds `off`'s bytes, this many"


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
        mode: "store" (two-sided store messages, the default) or "rma" (module docstring).
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
        mode: str = "store",
    ):
        if mode not in ("store", "rma"):
            raise ValueError(f"MpiFabric mode {mode!r}: store or rma")
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
        self.inflight: list[list] = [[] for _ in range(n)]  # guards' origin buffers, unflushed
        self.fetch_adds = 0
        self.mode = mode
        self.stores = mode == "store"
        self.own_bytes = own.bytes
        self.own_words = own.words
        self.batch: list[list] = [[] for _ in range(n)]  # store records not yet sent, per peer
        self.sending: list = []  # (request, buffers) of store messages in flight
        self.lock = threading.RLock()  # the DMA / KV threads send and apply too
        self.applied = 0  # store messages this die applied
        self.comm = world.Dup()  # store messages never match a user's or the launcher's
        self._status = MPI.Status()
        self.win = MPI.Win.Create(own._mmap, disp_unit=1, comm=world)
        self.win.Lock_all(MPI.MODE_NOCHECK)

    # -- the data path --------------------------------------------------------------------------

    def push(self, peer: int, off: int, nbytes: int) -> None:
        if self.remote[peer] and nbytes > 0 and self.stores:
            self._store(peer, off, nbytes)
            return
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
            self.inflight[peer].clear()
            self.pulls += 1
            self.pull_bytes += nbytes

    def _flush_dirty(self, peer: int) -> None:
        if self.dirty[peer]:
            self.dirty[peer] = False  # before the flush: see the module docstring
            self.win.Flush(peer)
            self.inflight[peer].clear()

    def _put_word(self, peer: int, word: int, value: int) -> None:
        w = np.array([value], dtype=np.int64)  # fresh: kept in inflight until a Flush
        self.win.Accumulate(
            [w, MPI.INT64_T], peer, target=(word * L.WORD, 1, MPI.INT64_T), op=MPI.REPLACE
        )
        pending = self.inflight[peer]
        pending.append(w)
        if len(pending) > INFLIGHT_GUARDS:  # bound the buffers kept alive
            self.win.Flush(peer)
            pending.clear()

    def publish(self, peer: int, word: int, value: int) -> None:
        self.words[peer][word] = value  # the mirror: this die's shadow of what it alone writes
        if self.remote[peer] and self.stores:
            with self.lock:
                self.batch[peer].append((word * L.WORD, value))
                self._send_batch(peer)
            self.publishes += 1
        elif self.remote[peer]:
            self._flush_dirty(peer)
            self._put_word(peer, word, value)
            self.publishes += 1

    def publish_many(self, peer: int, words: Sequence[int], values: Sequence[int]) -> None:
        w = self.words[peer]
        pairs = list(zip(words, values, strict=True))
        for i, v in pairs:
            w[i] = v
        if self.remote[peer] and pairs and self.stores:
            with self.lock:
                self.batch[peer].extend((i * L.WORD, v) for i, v in pairs)
                self._send_batch(peer)
            self.publishes += len(pairs)
        elif self.remote[peer] and pairs:
            self._flush_dirty(peer)
            for i, v in pairs:
                self._put_word(peer, i, v)
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
            for pending in self.inflight:
                pending.clear()
        elif self.remote[peer]:
            self.dirty[peer] = False
            self.win.Flush(peer)
            self.inflight[peer].clear()

    def progress(self) -> None:
        if self.stores:
            self._receive()
        else:
            self.win.Sync()

    # -- store messages -------------------------------------------------------------------------

    @property
    def cheap_guards(self) -> bool:
        """Guards cost nothing extra in store messages (they ride in the batch); in RMA mode
        each is a lock round trip (the small-message path then takes the general one)."""
        return self.stores

    def push_from(self, peer: int, off: int, data) -> None:
        """Carry `data` (any buffer) to bytes [off, off + len) of `peer`'s region, without
        writing the mirror (the small-message path sends the caller's buffer as it is)."""
        n = len(data)
        if not (self.remote[peer] and n):
            return
        if self.stores:
            with self.lock:
                if n <= STORE_INLINE:
                    self.batch[peer].append((off, bytes(data)))
                else:  # the batch so far, then `data` itself as the next message (zero-copy:
                    # the caller keeps it until its ack, which comes after the receive)
                    self.batch[peer].append((off, BIG, n))
                    self._send_batch(peer)
                    req = self.comm.Isend([data, MPI.BYTE], peer, STORE_TAG)
                    self.sending.append((req, data))
            self.pushes += 1
            self.push_bytes += n
            return
        self.bytes[peer][off : off + n] = data
        self.push(peer, off, n)

    def _store(self, peer: int, off: int, nbytes: int) -> None:
        """A push as a store record (copied now: the mirror may change before the send)."""
        with self.lock:
            if nbytes <= STORE_INLINE:
                self.batch[peer].append((off, bytes(self.bytes[peer][off : off + nbytes])))
            else:  # the batch so far, then the bytes as a message of their own (zero-copy)
                self.batch[peer].append((off, BIG, nbytes))
                self._send_batch(peer)
                view = self.bytes[peer][off : off + nbytes]
                req = self.comm.Isend([view, MPI.BYTE], peer, STORE_TAG)
                self.sending.append((req, view))
            self.pushes += 1
            self.push_bytes += nbytes

    def _send_batch(self, peer: int) -> None:
        """Send `peer`'s pending records as one message: int64 words [off, n, data...] per
        record (n = 0: a guard, one value word; n = BIG: the next message holds the bytes)."""
        recs = self.batch[peer]
        if not recs:
            return
        parts = []
        for rec in recs:
            if len(rec) == 3:  # (off, BIG, nbytes)
                parts.append(_REC3.pack(rec[0], BIG, rec[2]))
            elif isinstance(rec[1], int):  # a guard word
                parts.append(_REC3.pack(rec[0], 0, rec[1]))
            else:
                data = rec[1]
                parts.append(_REC2.pack(rec[0], len(data)))
                parts.append(data)
                pad = -len(data) % L.WORD
                if pad:
                    parts.append(bytes(pad))
        recs.clear()
        buf = b"".join(parts)
        req = self.comm.Isend([buf, MPI.BYTE], peer, STORE_TAG)
        self.sending.append((req, buf))
        if len(self.sending) > 64:
            self._reap()

    def _reap(self) -> None:
        self.sending = [(r, b) for r, b in self.sending if not r.Test()]

    def _receive(self) -> None:
        """Apply every store message that has arrived, in order (this die's own region)."""
        status = self._status
        with self.lock:
            if self.sending:
                self._reap()
            try:
                while self.comm.Iprobe(MPI.ANY_SOURCE, STORE_TAG, status):
                    src, n = status.Get_source(), status.Get_count(MPI.BYTE)
                    buf = bytearray(n)
                    self.comm.Recv([buf, MPI.BYTE], src, STORE_TAG)
                    self._apply(src, memoryview(buf))
                    self.applied += 1
            except MPI.Exception as e:  # a peer's process failed (ULFM): the pod is lost
                raise PodError(
                    f"die {self.me}: the fabric lost a peer ({e.Get_error_string()})"
                ) from None

    def _apply(self, src: int, buf: memoryview) -> None:
        words = buf.cast("q")
        own_b, own_w = self.own_bytes, self.own_words
        i, n = 0, len(words)
        while i < n:
            off, size = words[i], words[i + 1]
            if size == 0:  # a guard: one aligned 8-byte store
                own_w[off // L.WORD] = words[i + 2]
                i += 3
            elif size == BIG:
                nbytes = words[i + 2]
                self.comm.Recv([own_b[off : off + nbytes], MPI.BYTE], src, STORE_TAG)
                i += 3
            else:
                a = (i + 2) * L.WORD
                own_b[off : off + size] = buf[a : a + size]
                i += 2 + (size + L.WORD - 1) // L.WORD

    # -- bookkeeping ----------------------------------------------------------------------------

    def counters(self) -> dict[str, int]:
        return {**super().counters(), "fetch_adds": self.fetch_adds, "applied": self.applied}

    def close(self) -> None:
        """End the epoch and free the window (collective over `world`: every die closes at
        once, at a normal stop), then unmap the mirrors. Safe to call more than once."""
        win, self.win = self.win, None
        if win is not None and self.stores:  # every store message out (peers apply theirs)
            with self.lock:
                for peer in range(len(self.batch)):
                    self._send_batch(peer)
            while self.sending:
                self._receive()
            self.comm.Barrier()  # then nobody sends: apply what is left, free the communicator
            self._receive()
            self.comm.Free()
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
