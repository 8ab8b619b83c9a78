"""One POSIX shared-memory segment per die: create / attach / unlink, header check, field views.

Segment names carry the pod id: `/xpod.<pod_id>.d<die_id>` (the control segment of a pod is
`/xpod.<pod_id>.ctl`, owned by `runtime/`). Segments are created owner-only (0600) and only their
creator (the pod launcher) unlinks them, in `try/finally`, never in `__del__`.

The header (first page, dtype `layout.HEADER`) is written once by the creator; `attach()` checks
magic, layout version and the layout hash, so a die never reads a region laid out for another
configuration.
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass

import numpy as np
import posix_ipc

from memory import layout as L
from memory.errors import ProtocolError, ShmError

_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)
_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)


def region_name(pod_id: str, die_id: int) -> str:
    return f"/xpod.{pod_id}.d{die_id}"


@dataclass(frozen=True)
class RegionHandle:
    """Everything another process needs to attach a region."""

    name: str
    die_id: int


class Region:
    """A mapped HBM region. Build with `Region.create` (owner) or `Region.attach` (everyone).

    Attributes:
        name, die_id, layout: identity and layout.
        array: uint8 view of the whole region.
        words: memoryview cast to int64 over the whole region (hot-path flag access).
        app / meta / managed: uint8 views of the three areas.
        base_addr: virtual address of byte 0 in this process (to find a view's offset).
    """

    def __init__(self, name: str, die_id: int, layout: L.RegionLayout, mm: mmap.mmap):
        self.name = name
        self.die_id = die_id
        self.layout = layout
        self._mmap = mm
        self.array = np.frombuffer(mm, dtype=np.uint8)
        self.words = memoryview(mm).cast("q")
        self.bytes = memoryview(mm)
        self.base_addr = self.array.ctypes.data
        lo = layout
        self.app = self.array[lo.app_off : lo.app_off + lo.app_bytes]
        self.meta = self.array[lo.meta_off : lo.meta_off + lo.meta_bytes]
        self.managed = self.array[lo.managed_off : lo.managed_off + lo.managed_bytes]

    # -- lifecycle ------------------------------------------------------------------------------

    @classmethod
    def create(cls, name: str, die_id: int, layout: L.RegionLayout) -> Region:
        """Create the segment (fails if it exists), size it and write the header."""
        try:
            shm = posix_ipc.SharedMemory(
                name, flags=posix_ipc.O_CREX, mode=0o600, size=layout.region_bytes
            )
        except (posix_ipc.Error, OSError, ValueError) as e:
            raise ShmError(f"shm_open({name}, O_CREX, {layout.region_bytes} B): {e}") from e
        try:
            mm = mmap.mmap(shm.fd, layout.region_bytes)
        except OSError as e:
            _unlink_quietly(name)
            raise ShmError(f"mmap({name}, {layout.region_bytes} B): {e}") from e
        finally:
            shm.close_fd()
        region = cls(name, die_id, layout, mm)
        region._write_header()
        return region

    @classmethod
    def attach(cls, handle: RegionHandle, layout: L.RegionLayout) -> Region:
        """Map an existing segment and check its header against `layout`."""
        try:
            shm = posix_ipc.SharedMemory(handle.name)
        except (posix_ipc.Error, OSError) as e:
            raise ShmError(f"shm_open({handle.name}): {e}") from e
        try:
            if shm.size < layout.region_bytes:
                raise ShmError(
                    f"attach({handle.name}): segment has {shm.size} bytes,"
                    f" layout needs {layout.region_bytes}"
                )
            mm = mmap.mmap(shm.fd, layout.region_bytes)
        except OSError as e:
            raise ShmError(f"mmap({handle.name}): {e}") from e
        finally:
            shm.close_fd()
        region = cls(handle.name, handle.die_id, layout, mm)
        region._check_header()
        return region

    def close(self) -> None:
        """Unmap. Views handed out (allocator arrays) keep the mapping alive until dropped."""
        self.app = self.meta = self.managed = self.array = None  # type: ignore[assignment]
        self.words.release()
        self.bytes.release()
        try:
            self._mmap.close()
        except BufferError:
            # A user still holds a numpy view of this region; the mapping goes with the last view.
            self._mmap = None  # type: ignore[assignment]

    def unlink(self) -> None:
        unlink_segment(self.name)

    def prefault(self, off: int, nbytes: int, write: bool = True) -> bool:
        """Fill this process's page tables for bytes [off, off + nbytes) of the region without
        touching the bytes (MADV_POPULATE_WRITE / _READ, Linux 5.14+): a process that will
        copy into (or read) a peer's memory pays no page fault per 4 KiB page then (measured:
        a 1.5 MB KV copy into a peer's pool at 1.2 GB/s cold, ~18 warm). False if the kernel
        cannot (the faults then happen on first use, as before)."""
        lo = off - off % mmap.PAGESIZE
        advice = _POPULATE_WRITE if write else _POPULATE_READ
        try:
            self._mmap.madvise(advice, lo, min(nbytes + off - lo, len(self._mmap) - lo))
        except (OSError, ValueError):
            return False
        return True

    # -- header ---------------------------------------------------------------------------------

    def header(self) -> np.ndarray:
        return np.frombuffer(self._mmap, dtype=L.HEADER, count=1)[0]

    def _write_header(self) -> None:
        lo = self.layout
        h = np.frombuffer(self._mmap, dtype=L.HEADER, count=1)
        for key, value in (
            ("layout_version", L.LAYOUT_VERSION),
            ("layout_hash", lo.layout_hash),
            ("die_id", self.die_id),
            ("num_dies", lo.num_dies),
            ("lanes", lo.lanes),
            ("ring_slots", lo.ring_slots),
            ("slot_bytes", lo.slot_bytes),
            ("app_off", lo.app_off),
            ("app_bytes", lo.app_bytes),
            ("meta_off", lo.meta_off),
            ("meta_bytes", lo.meta_bytes),
            ("managed_off", lo.managed_off),
            ("managed_bytes", lo.managed_bytes),
            ("region_bytes", lo.region_bytes),
            ("creator_pid", os.getpid()),
        ):
            h[key] = value
        # Magic last: a reader that sees the magic sees a complete header.
        h["magic"] = L.MAGIC

    def _check_header(self) -> None:
        h = self.header()
        if int(h["magic"]) != L.MAGIC:
            raise ProtocolError(f"attach({self.name}): bad magic {int(h['magic']):#x}")
        if int(h["layout_version"]) != L.LAYOUT_VERSION:
            raise ProtocolError(
                f"attach({self.name}): layout version {int(h['layout_version'])},"
                f" this code speaks {L.LAYOUT_VERSION}"
            )
        if int(h["layout_hash"]) != self.layout.layout_hash or int(h["die_id"]) != self.die_id:
            raise ProtocolError(
                f"attach({self.name}): region was laid out for die {int(h['die_id'])} of"
                f" {int(h['num_dies'])} dies, lanes {int(h['lanes'])}, slots"
                f" {int(h['ring_slots'])}x{int(h['slot_bytes'])}; expected die {self.die_id} of"
                f" {self.layout.num_dies}"
            )

    # -- views ----------------------------------------------------------------------------------

    def field(self, kind: str, peer: int, lane: int) -> np.void:
        """Structured numpy view of one 32-byte field ("desc", "ack", "rdv"), for tests/debug."""
        off = self.layout.field_off(kind, peer, lane)
        return np.frombuffer(self._mmap, dtype=L.FIELD_KINDS[kind], count=1, offset=off)[0]

    def fields(self, kind: str) -> np.ndarray:
        """All fields of a kind as a [num_dies, lanes] structured array view."""
        lo = self.layout
        off = lo.field_off(kind, 0, 0)
        n = lo.num_dies * lo.lanes
        arr = np.frombuffer(self._mmap, dtype=L.FIELD_KINDS[kind], count=n, offset=off)
        return arr.reshape(lo.num_dies, lo.lanes)

    def offset_of(self, arr: np.ndarray) -> int:
        """Byte offset of `arr`'s first element in this region; ValueError if outside."""
        off = arr.ctypes.data - self.base_addr
        if off < 0 or off + arr.nbytes > self.layout.region_bytes:
            raise ValueError(f"array at {arr.ctypes.data:#x} is not inside region {self.name}")
        return off


def unlink_segment(name: str) -> bool:
    """Unlink a segment by name; False if it was already gone."""
    try:
        posix_ipc.unlink_shared_memory(name)
    except posix_ipc.ExistentialError:
        return False
    return True


def _unlink_quietly(name: str) -> None:
    unlink_segment(name)
