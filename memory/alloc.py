"""App-area allocator: first fit over a sorted free list, coalescing on free.

Arrays it returns are numpy views into the die's region, so a peer can address them by offset
(zero-copy receive targets, KV-cache blocks). The bookkeeping is plain Python in the owning process;
nothing of it lives in shared memory. O(free blocks) per call, which is a handful in practice.
"""

from __future__ import annotations

import bisect
import math

import numpy as np

from memory.errors import PodError


class AllocError(PodError, MemoryError):
    """The app area cannot satisfy a request."""


def _shape(shape) -> tuple[int, ...]:
    """`shape` as a tuple of non-negative ints; ValueError naming it otherwise."""
    items = (shape,) if isinstance(shape, int | np.integer) else shape
    try:
        out = tuple(items)
    except TypeError:
        out = None
    ok = out is not None and all(
        isinstance(s, int | np.integer) and not isinstance(s, bool) for s in out
    )
    if not ok:
        raise ValueError(f"alloc: shape {shape!r} must be an int or a tuple of ints")
    if any(s < 0 for s in out):
        raise ValueError(f"alloc: negative dimension in shape {out}")
    return tuple(int(s) for s in out)


class AppAllocator:
    """Allocate numpy arrays inside `area` (a uint8 view of the app area).

    Arguments:
        area: uint8 numpy view of the app area.
        area_off: byte offset of `area` in its region (so offsets of arrays are region offsets).
        name: used in error messages (e.g. "die 3 app area").
    """

    def __init__(self, area: np.ndarray, area_off: int = 0, name: str = "app area"):
        self._area = area
        self._area_off = area_off
        self._name = name
        self._size = int(area.nbytes)
        self._free: list[tuple[int, int]] = [(0, self._size)] if self._size else []  # (off, len)
        self._used: dict[int, int] = {}  # offset -> length

    @property
    def capacity_bytes(self) -> int:
        return self._size

    @property
    def used_bytes(self) -> int:
        return sum(self._used.values())

    @property
    def largest_free_bytes(self) -> int:
        return max((n for _, n in self._free), default=0)

    def alloc(
        self, shape: int | tuple[int, ...], dtype: np.typing.DTypeLike = np.uint8, align: int = 64
    ) -> np.ndarray:
        """Return a zero-initialised C-contiguous array of `shape` and `dtype` in the app area.

        Arguments:
            shape: int or tuple of non-negative ints.
            dtype: any numpy dtype without Python objects.
            align: byte alignment of the first element, a power of two (default 64, a cache line).
        Raises:
            AllocError naming the request, the largest free block and the capacity.
        """
        try:
            dt = np.dtype(dtype)
        except TypeError as e:
            raise TypeError(f"alloc: dtype {dtype!r} is not a numpy dtype ({e})") from None
        if dt.hasobject:
            raise TypeError(f"alloc: dtype {dt} holds Python objects; shared memory cannot")
        shape_t = _shape(shape)
        if not isinstance(align, int | np.integer) or align <= 0 or align & (align - 1):
            raise ValueError(f"alloc: align {align!r} is not a power of two")
        nbytes = math.prod(shape_t) * dt.itemsize
        if nbytes == 0:
            # numpy gives every empty view the area's base pointer, so an empty allocation cannot
            # be told apart by address: it reserves nothing and free() of it is a no-op.
            return self._area[:0].view(dt).reshape(shape_t)
        need = nbytes
        for i, (off, length) in enumerate(self._free):
            start = -(-off // align) * align
            if start + need <= off + length:
                self._take(i, off, length, start, need)
                arr = self._area[start : start + nbytes].view(dt).reshape(shape_t)
                arr[...] = 0
                return arr
        raise AllocError(
            f"{self._name} full: cannot allocate {nbytes} B (shape {shape_t}, {dt}); largest free"
            f" block {self.largest_free_bytes} B, {self.used_bytes} of {self._size} B in use"
        )

    def free(self, arr: np.ndarray) -> None:
        """Give back an array returned by `alloc` (not a slice of it). Empty arrays: no-op."""
        if arr.nbytes == 0:
            return
        off = self.area_offset(arr)
        length = self._used.pop(off, None)
        if length is None:
            raise ValueError(f"free: no allocation starts at app offset {off} of {self._name}")
        i = bisect.bisect(self._free, (off, 0))
        self._free.insert(i, (off, length))
        self._coalesce(i)

    def area_offset(self, arr: np.ndarray) -> int:
        """Offset of `arr` inside the app area; ValueError if it is not inside."""
        off = arr.ctypes.data - self._area.ctypes.data
        if off < 0 or off + arr.nbytes > self._size:
            raise ValueError(f"array is not inside {self._name}")
        return off

    def region_offset(self, arr: np.ndarray) -> int:
        """Offset of `arr` in the whole region (what a peer needs to address it)."""
        return self._area_off + self.area_offset(arr)

    def _take(self, i: int, off: int, length: int, start: int, need: int) -> None:
        del self._free[i]
        tail_off, tail_len = start + need, off + length - (start + need)
        # Alignment padding in front stays free; so does what is left behind.
        if tail_len:
            self._free.insert(i, (tail_off, tail_len))
        if start > off:
            self._free.insert(i, (off, start - off))
        self._used[start] = need

    def _coalesce(self, i: int) -> None:
        # Merge with the right neighbour, then with the left one.
        if i + 1 < len(self._free):
            off, n = self._free[i]
            noff, nn = self._free[i + 1]
            if off + n == noff:
                self._free[i] = (off, n + nn)
                del self._free[i + 1]
        if i > 0:
            poff, pn = self._free[i - 1]
            off, n = self._free[i]
            if poff + pn == off:
                self._free[i - 1] = (poff, pn + n)
                del self._free[i]
