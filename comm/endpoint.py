"""A die's view of the pod for `comm/`: every region mapped, hot-path indices precomputed.

`runtime.Die` extends this class, so every `comm` function takes a die as its first argument
(`comm.send(die, buf, dst, event_id)`). The only Python-side state kept here is what the die
alone writes and would otherwise re-read from shared memory: per-peer message counters.
"""

from __future__ import annotations

import numpy as np

from comm.dma import DmaEngine
from comm.fabric import Fabric
from comm.trace import Trace, now_ns
from comm.wait import WaitContext, WaitPolicy, wait_ge
from memory import layout as L
from memory.region import Region


class Endpoint:
    """Per-die communication state.

    Arguments:
        die_id: this die.
        regions: every die's Region, indexed by die id (this die's own included).
        policy: the wait policy for every poll of this die.
        ub_bytes: unified-buffer bytes per lane (ping-pong halves of ub_bytes // 2).
        trace: the die's trace buffer.
        abort: optional (words, index, value): waits raise PodAborted once words[index] != value.
        fabric: how the die reaches its peers (`comm.fabric`); default every region mapped.
            With a fabric, `regions` may hold only this host's regions (the fabric's are used).
    """

    def __init__(
        self,
        die_id: int,
        regions: list[Region],
        policy: WaitPolicy,
        ub_bytes: int = 192 * 1024,
        trace: Trace | None = None,
        abort: tuple | None = None,
        fabric: Fabric | None = None,
    ):
        self.die_id = die_id
        self.fab = fabric if fabric is not None else Fabric(die_id, regions)
        regions = self.regions = self.fab.regions
        self.num_dies = len(regions)
        self.local = regions[die_id]
        self.layout: L.RegionLayout = self.local.layout
        self.lanes = self.layout.lanes
        self.policy = policy
        self.ctx = WaitContext(die_id, abort)
        if self.fab.any_remote and self.fab.needs_progress:
            self.ctx.progress = self.fab.progress
        # wait_ge's per-peer progress period (None: no fabric progress) and the mirrors' words
        self._progress_every = None
        self._calls = 0  # progress() calls: a same-host request drives the fabric every 64
        self._mirror_ids = {id(w) for rem, w in zip(self.fab.remote, self.fab.words, strict=True)
                            if rem}  # fmt: skip
        if self.fab.any_remote:
            self._progress_every = [1 if rem else policy.check_every for rem in self.fab.remote]
        # a capture pod's event log (comm.capture), None otherwise: the protocols record their
        # guarded steps, rows, copies and ops into it
        self.cap = getattr(self.fab, "cap", None)
        self.trace = trace if trace is not None else Trace(die_id)
        self.words = self.fab.words
        self.bytes = self.fab.bytes
        self.ub_bytes = ub_bytes
        self._ub: list[tuple[memoryview, memoryview]] = []
        self._dma: DmaEngine | None = None
        n = self.num_dies
        # Messages this die has sent to dst (one cell per peer, shared by every lane and by the
        # fast path's closure); every lane of a message carries it, the receiver echoes it into
        # ack.done.
        self.tx_seq = [[0] for _ in range(n)]
        # Outstanding async requests per peer, in issue order (a pair carries one message at once).
        self.tx_queue: list[list] = [[] for _ in range(n)]
        self.rx_queue: list[list] = [[] for _ in range(n)]
        self.active: list = []  # every outstanding comm.p2p Request, advanced by progress()
        self.sync_count = 0
        self.a2a = None  # comm.alltoall.state.A2AState, made by the first all-to-all call
        self.tables = _Tables(self.layout)
        # The small-message fast path sends one chunk through half of lane 0's UB.
        self.ub0 = self.ub(0)[0]
        self.small_bytes = min(self.layout.slot_bytes, len(self.ub0))
        # Per-peer fast-path closures, keyed by peer id: comm.p2p.sendrecv makes a peer's on
        # the first small message to or from it.
        self.small_tx: dict = {}
        self.small_rx: dict = {}

    # -- resources ------------------------------------------------------------------------------

    def ub(self, lane: int) -> tuple[memoryview, memoryview]:
        """The ping-pong halves of `lane`'s unified buffer (private memory, never shared)."""
        while len(self._ub) <= lane:
            half = self.ub_bytes // 2
            buf = memoryview(bytearray(2 * half))
            self._ub.append((buf[:half], buf[half:]))
        return self._ub[lane]

    @property
    def dma(self) -> DmaEngine:
        if self._dma is None:
            self._dma = DmaEngine(self.die_id, self.policy.timeout_s, self.ctx.progress)
        return self._dma

    def close(self) -> None:
        """Stop the DMA engine (a new one starts on demand); the fabric stays."""
        if self._dma is not None:
            self._dma.close()
            self._dma = None

    def progress(self) -> bool:
        """Advance every outstanding request once; True if any moved. A multi-host die first
        lets the fabric land its peers' stores (a caller's `req.test()` loop is a wait too):
        at every call while a request to or from another host is outstanding, else every 64."""
        if self.ctx.progress is not None:
            self._calls += 1
            remote = self.fab.remote
            if self._calls % 64 == 0 or any(remote[r.peer] for r in self.active):
                self.ctx.progress()
        moved = False
        for req in list(self.active):
            moved |= req.advance()
        return moved

    # -- checks ---------------------------------------------------------------------------------

    def check_peer(self, peer: int, what: str) -> None:
        if not isinstance(peer, (int, np.integer)) or not 0 <= peer < self.num_dies:
            raise ValueError(
                f"die {self.die_id}: {what} {peer!r} is out of range [0, {self.num_dies - 1}]"
            )
        if peer == self.die_id:
            raise ValueError(f"die {self.die_id}: {what} {peer} is this die itself")

    def check_cores(self, cores: int) -> None:
        if not isinstance(cores, int) or not 1 <= cores <= self.lanes:
            raise ValueError(
                f"die {self.die_id}: cores {cores!r} is out of range [1, {self.lanes}]"
                " (PodConfig.lanes)"
            )

    # -- waiting --------------------------------------------------------------------------------

    def wait_ge(
        self, words: memoryview, idx: int, target: int, peer: int, field: str, probe=None
    ) -> int:
        every = self._progress_every
        if every is None:  # one host (or no progress to make): the plain wait
            return wait_ge(words, idx, target, self.policy, self.ctx, peer, field, probe)
        if id(words) in self._mirror_ids:
            self.fab.remote_polls += 1  # a poll of a word this die does not own (rule R1)
        # a same-host peer's word: the spin phase, and fabric progress with the deadline checks
        e = every[peer] if 0 <= peer < self.num_dies else 1
        return wait_ge(words, idx, target, self.policy, self.ctx, peer, field, probe, e)

    def acquire(self, words: memoryview, idx: int, target: int, peer: int, field: str,
                probe=None) -> None:  # fmt: skip
        """A guarded step (docs/protocols.md): go on once this die's own `words[idx]` >=
        `target`, the word written by die `peer` (`wait_ge` only if it is not there yet). A
        capture pod records the step whether or not it was already satisfied: the hardware may
        find it otherwise (docs/projection.md §1)."""
        cap = self.cap
        if cap is None:
            if words[idx] < target:
                self.wait_ge(words, idx, target, peer, field, probe)
            return
        t0 = now_ns()
        if words[idx] < target:
            self.wait_ge(words, idx, target, peer, field, probe)
        cap.acq((idx,), (target,), (peer,), field, t0)


def shifted(ep: Endpoint, dies) -> list[int]:
    """`dies` in the order that starts after this die and wraps around (this die last): an
    all-to-all's peers in a shifted schedule, so that at each step every die sends to a
    different die instead of all of them to the first one (no incast by construction)."""
    n, me = ep.num_dies, ep.die_id
    return sorted(dies, key=lambda d: (d - me - 1) % n)


class _Tables:
    """Word indices of every field and byte offsets of every ring, precomputed (hot-path lookups;
    `RegionLayout.field_word` builds a dict per call)."""

    __slots__ = (
        "desc0", "ack0", "ring0", "slots", "slot_bytes", "info_mte1", "desc", "ack", "rdv", "ring",
    )  # fmt: skip

    def __init__(self, lo: L.RegionLayout):
        n = lo.num_dies
        lanes = range(lo.lanes)
        # [peer][lane] word index of each field kind / byte offset of each ring
        self.desc = [[lo.field_word("desc", p, ln) for ln in lanes] for p in range(n)]
        self.ack = [[lo.field_word("ack", p, ln) for ln in lanes] for p in range(n)]
        self.rdv = [[lo.field_word("rdv", p, ln) for ln in lanes] for p in range(n)]
        self.ring = [[lo.ring_off(p, ln) for ln in lanes] for p in range(n)]
        self.desc0 = [lo.field_word("desc", p, 0) for p in range(n)]
        self.ack0 = [lo.field_word("ack", p, 0) for p in range(n)]
        self.ring0 = [lo.ring_off(p, 0) for p in range(n)]
        self.slots = lo.ring_slots
        self.slot_bytes = lo.slot_bytes
        self.info_mte1 = 1 << 40 | 1 << 56  # msg_info bits of a 1-lane mte message


def barrier(ep: Endpoint) -> None:
    """Wait until every die of the pod has entered the same number of barriers.

    Each die publishes its count into its own word of every peer's sync block (`sync[me]`,
    single writer) and polls the peers' words in its own region: a die polls only its own
    memory (docs/protocols.md §11, rule R1), so the barrier works across hosts. O(num_dies)
    stores and polls per die.
    """
    ep.sync_count += 1
    n = ep.sync_count
    base = ep.layout.sync_off // L.WORD
    me, fab = ep.die_id, ep.fab
    for peer in range(ep.num_dies):
        if peer != me:
            fab.publish(peer, base + me, n)
    own = ep.words[me]
    for peer in range(ep.num_dies):
        if peer != me:
            ep.acquire(own, base + peer, n, peer, "sync[peer]")
