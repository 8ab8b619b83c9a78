"""How a die reaches the other dies' regions: the seam under `comm/` (docs/protocols.md §11).

A pod on one host maps every region (`LocalFabric`): a store into a peer's region is a store,
and every method below is a no-op or a plain store. A pod over several hosts (`MpiFabric`,
`comm.fabric_mpi`) maps only its own host's regions; a die on another host is a private
**mirror** of its region, and the code writes it exactly as it writes a mapping, then says
what to carry over:

    fab.push(peer, off, nbytes)            # bytes written in the mirror -> the peer (Put)
    fab.pull(peer, off, nbytes)            # the peer's bytes -> the mirror (Get, completed)
    fab.publish(peer, word, value)         # the guard word: every push before it lands
    fab.publish_many(peer, words, values)  #   first (flush), then each word atomically
    fab.progress()                         # every wait loop calls it (MPI's target progress)

The protocol rules that make this enough (MULTIHOST §4): a die polls only its own region; it
never reads back a word it wrote in a peer's region except from its own mirror (the mirror is
its shadow of the words it alone writes); data and payload words go before their guard word;
a read of a peer's data is a `pull`; compiled kernels write mirrors and their callers push.

`MirrorFabric` keeps those rules honest on one host without MPI: the dies named remote get
mirrors filled with a poison pattern, `push` / `pull` copy between a mirror and the peer's
real region. A missing pull reads poison, a missing push never arrives: the conformance
tests then fail, and `remote_polls` counts waits on a mirror (a poll of a word the die does
not own: must stay 0).
"""

from __future__ import annotations

import mmap
from collections.abc import Sequence

import numpy as np

from memory import layout as L

POISON = 0xA5  # every byte of a poisoned mirror's data areas (a float32 of -2.9e-16, an
# int64 of -6.5e18: wrong wherever it is read)


class Mirror:
    """A remote die's region as this die sees it: private memory of the region's size, with
    the attributes of a `memory.Region` the protocols use (array, words, bytes, base_addr,
    app / meta / managed, layout). Pages exist only where code writes or pulls."""

    remote = True

    def __init__(self, die_id: int, layout: L.RegionLayout, poison: bool = False):
        self.die_id = die_id
        self.layout = layout
        self.name = f"mirror of die {die_id}"
        n = layout.region_bytes
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0)
        self._mmap = mmap.mmap(-1, n, flags=flags)
        self.array = np.frombuffer(self._mmap, dtype=np.uint8)
        self.words = memoryview(self._mmap).cast("q")
        self.bytes = memoryview(self._mmap)
        self.base_addr = self.array.ctypes.data
        lo = layout
        self.app = self.array[lo.app_off : lo.app_off + lo.app_bytes]
        self.meta = self.array[lo.meta_off : lo.meta_off + lo.meta_bytes]
        self.managed = self.array[lo.managed_off : lo.managed_off + lo.managed_bytes]
        if poison:
            # Data areas only: the meta area starts as the peer's does (zero), since the die
            # reads its own words there back from the mirror (its shadow, rule R2).
            self.array[: lo.meta_off] = POISON
            self.array[lo.meta_off + lo.meta_bytes :] = POISON

    def prefault(self, off: int, nbytes: int, write: bool = True) -> bool:
        return False

    def close(self) -> None:
        self.app = self.meta = self.managed = self.array = None  # type: ignore[assignment]
        self.words.release()
        self.bytes.release()
        try:
            self._mmap.close()
        except BufferError:
            self._mmap = None  # type: ignore[assignment]

    def unlink(self) -> None:
        """A mirror has no segment."""


class Fabric:
    """The single-host fabric (and the interface): every region is mapped, so pushes, pulls,
    flushes and progress are no-ops and a publish is a store (x86-64 TSO orders it after the
    stores before it, docs/protocols.md §3.2).

    Attributes:
        me: this die's id; regions: every die's Region (or Mirror), by id.
        remote: per die, True if it is reached through a mirror; any_remote: any of them.
        words / bytes: per die, int64 and byte memoryviews (the mapping or the mirror).
        counters: pushes, push_bytes, pulls, pull_bytes, publishes, remote_polls.
    """

    kind = "local"
    needs_progress = False  # True: remote stores land only while this die calls progress()
    cheap_guards = True  # a guard word costs no more than a payload word (no round trip)

    def __init__(self, me: int, regions: Sequence):
        self.me = me
        self.regions = list(regions)
        self.remote = [bool(getattr(r, "remote", False)) for r in self.regions]
        self.any_remote = any(self.remote)
        self.words = [r.words for r in self.regions]
        self.bytes = [r.bytes for r in self.regions]
        self.hosts: list[int] = [0] * len(self.regions)
        self.pushes = self.push_bytes = self.pulls = self.pull_bytes = 0
        self.publishes = self.remote_polls = 0

    # -- the data path --------------------------------------------------------------------------

    def push(self, peer: int, off: int, nbytes: int) -> None:
        """Carry bytes [off, off + nbytes) that this die wrote in `peer`'s mirror to `peer`."""

    def push_words(self, peer: int, word: int, count: int = 1) -> None:
        """`push` of `count` int64 words from word index `word` (payload words, never guards)."""
        if self.remote[peer]:
            self.push(peer, word * L.WORD, count * L.WORD)

    def push_from(self, peer: int, off: int, data) -> None:
        """Carry `data` (any buffer) to bytes [off, off + len(data)) of `peer`'s region (a
        mapped peer: a copy; a remote one: from `data` itself, the mirror left as it was)."""
        self.bytes[peer][off : off + len(data)] = data

    def pull(self, peer: int, off: int, nbytes: int) -> None:
        """Bring bytes [off, off + nbytes) of `peer`'s region into its mirror, completed."""

    def publish(self, peer: int, word: int, value: int) -> None:
        """Store guard word `word` of `peer`'s region after everything pushed to it before."""
        self.words[peer][word] = value

    def publish_many(self, peer: int, words: Sequence[int], values: Sequence[int]) -> None:
        """`publish` of several guard words after one flush (each word lands atomically; two
        guards may land in either order, so each reader waits on its own guard)."""
        w = self.words[peer]
        for i, v in zip(words, values, strict=True):
            w[i] = v

    def flush(self, peer: int | None = None) -> None:
        """Complete every push to `peer` (every peer: None)."""

    def progress(self) -> None:
        """Let the fabric move other dies' writes into this die's region (MPI target
        progress); every wait loop calls it while any peer is remote."""

    # -- bookkeeping ----------------------------------------------------------------------------

    def is_mirror(self, words: memoryview) -> bool:
        """True if `words` is a remote die's mirror (a poll of it reads nobody's stores)."""
        return self.any_remote and any(
            rem and words is w for rem, w in zip(self.remote, self.words, strict=True)
        )

    def view(self, dies: Sequence[int]) -> Fabric:
        """The fabric of a group of dies (`comm.group_view`): rank i is die dies[i]."""
        return _GroupFabric(self, dies)

    def counters(self) -> dict[str, int]:
        return {
            "pushes": self.pushes,
            "push_bytes": self.push_bytes,
            "pulls": self.pulls,
            "pull_bytes": self.pull_bytes,
            "publishes": self.publishes,
            "remote_polls": self.remote_polls,
        }

    def close(self) -> None:
        """Release what the fabric made (mirrors, windows); the regions stay the caller's."""


LocalFabric = Fabric


class MirrorFabric(Fabric):
    """Remote dies emulated on one host (tests, `PodConfig.fabric="mirror"`): the dies that
    `hosts` puts on another host than this die are mirrors; push / pull copy between a mirror
    and that die's real region, publish stores the guard after them. No MPI."""

    kind = "mirror"

    def __init__(self, me: int, regions: Sequence, hosts: Sequence[int], poison: bool = True):
        hosts = [int(h) for h in hosts]
        if len(hosts) != len(regions):
            raise ValueError(f"hosts {hosts}: {len(hosts)} entries for {len(regions)} dies")
        self.real = list(regions)
        views = [
            Mirror(d, r.layout, poison) if hosts[d] != hosts[me] else r
            for d, r in enumerate(regions)
        ]
        super().__init__(me, views)
        self.hosts = hosts
        self.real_words = [r.words for r in self.real]
        self.real_bytes = [r.bytes for r in self.real]

    def push(self, peer: int, off: int, nbytes: int) -> None:
        if self.remote[peer] and nbytes > 0:
            self.real_bytes[peer][off : off + nbytes] = self.bytes[peer][off : off + nbytes]
            self.pushes += 1
            self.push_bytes += nbytes

    def push_from(self, peer: int, off: int, data) -> None:
        if not self.remote[peer]:
            self.bytes[peer][off : off + len(data)] = data
        elif len(data):
            self.real_bytes[peer][off : off + len(data)] = data
            self.pushes += 1
            self.push_bytes += len(data)

    def pull(self, peer: int, off: int, nbytes: int) -> None:
        if self.remote[peer] and nbytes > 0:
            self.bytes[peer][off : off + nbytes] = self.real_bytes[peer][off : off + nbytes]
            self.pulls += 1
            self.pull_bytes += nbytes

    def publish(self, peer: int, word: int, value: int) -> None:
        self.words[peer][word] = value
        if self.remote[peer]:
            self.real_words[peer][word] = value
            self.publishes += 1

    def publish_many(self, peer: int, words: Sequence[int], values: Sequence[int]) -> None:
        for i, v in zip(words, values, strict=True):
            self.publish(peer, i, v)

    def close(self) -> None:
        for r in self.regions:
            if isinstance(r, Mirror):
                r.close()


class _GroupFabric(Fabric):
    """A group's ranks over its parent's fabric (ids translated, counters shared)."""

    def __init__(self, parent: Fabric, dies: Sequence[int]):
        self.parent = parent
        self.dies = [int(d) for d in dies]
        self.me = self.dies.index(parent.me)
        self.kind = parent.kind
        self.needs_progress = parent.needs_progress
        self.cheap_guards = parent.cheap_guards
        self.regions = [parent.regions[d] for d in self.dies]
        self.remote = [parent.remote[d] for d in self.dies]
        self.any_remote = any(self.remote)
        self.words = [parent.words[d] for d in self.dies]
        self.bytes = [parent.bytes[d] for d in self.dies]
        self.hosts = [parent.hosts[d] for d in self.dies]

    def __getattr__(self, name: str):  # counters live in the parent
        return getattr(self.parent, name)

    def push(self, peer: int, off: int, nbytes: int) -> None:
        self.parent.push(self.dies[peer], off, nbytes)

    def push_from(self, peer: int, off: int, data) -> None:
        self.parent.push_from(self.dies[peer], off, data)

    def pull(self, peer: int, off: int, nbytes: int) -> None:
        self.parent.pull(self.dies[peer], off, nbytes)

    def publish(self, peer: int, word: int, value: int) -> None:
        self.parent.publish(self.dies[peer], word, value)

    def publish_many(self, peer: int, words: Sequence[int], values: Sequence[int]) -> None:
        self.parent.publish_many(self.dies[peer], words, values)

    def flush(self, peer: int | None = None) -> None:
        self.parent.flush(None if peer is None else self.dies[peer])

    def progress(self) -> None:
        self.parent.progress()

    def view(self, dies: Sequence[int]) -> Fabric:
        return _GroupFabric(self.parent, [self.dies[d] for d in dies])

    def close(self) -> None:
        """The parent owns the mirrors."""


def hosts_of(spec: str | Sequence[int], num_dies: int | None = None) -> list[int]:
    """The host of every die from a `--hosts` spec: "2,2" (counts of consecutive dies) or
    "nodeA:8,nodeB:8" (names with counts); a list of counts works too."""
    if isinstance(spec, str):
        counts = []
        for part in spec.split(","):
            part = part.strip()
            if not part:
                raise ValueError(f"--hosts {spec!r}: an empty entry")
            count = part.rsplit(":", 1)[-1]
            if not count.isdigit() or int(count) < 1:
                raise ValueError(
                    f"--hosts {spec!r}: {part!r} is not a die count >= 1 (or host:count)"
                )
            counts.append(int(count))
    else:
        counts = [int(c) for c in spec]
        if any(c < 1 for c in counts):
            raise ValueError(f"hosts {list(spec)}: every host needs >= 1 die")
    if not counts:
        raise ValueError("hosts: at least one host")
    hosts = [h for h, k in enumerate(counts) for _ in range(k)]
    if num_dies is not None and len(hosts) != num_dies:
        raise ValueError(f"hosts {spec!r}: {len(hosts)} dies, the pod has {num_dies}")
    return hosts


def host_names_of(spec: str) -> list[str]:
    """The host names of a `--hosts` spec ("nodeA:8,nodeB:8" -> ["nodeA", "nodeB"]); [] for
    counts alone ("2,2": emulated hosts on this machine). Names must be all or none."""
    parts = [p.strip() for p in spec.split(",")]
    names = [p.rsplit(":", 1)[0] if ":" in p else "" for p in parts]
    if any(names) and not all(names):
        raise ValueError(f"--hosts {spec!r}: name every host (host:count) or none")
    return names if all(names) else []


__all__ = [
    "POISON", "Fabric", "LocalFabric", "Mirror", "MirrorFabric", "host_names_of", "hosts_of",
]  # fmt: skip
