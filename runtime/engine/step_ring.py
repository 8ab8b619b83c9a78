"""The per-step channel between a DP-group master and its die: two rings in the die's region and
two doorbells.

```
 master g                                   die g (region serve block, memory/layout.py)
   cmd ring writer ---- step frames ------>  cmd ring reader     (cmd_pub / cmd_taken)
   result ring reader <-- result frames ---  result ring writer  (res_pub / res_taken)
   rings bell.d<g> after each publish        rings bell.m<g> after each result
```
A ring is `SERVE_SLOTS` slots of `serve_slot_bytes`; message k lives in slot k % slots. The
writer fills the slot, stores its length, then bumps its `*_pub` count LAST (the reader reads
the slot only after it sees the count: payload first, flag last, as every protocol of comm/).
The reader copies the frame out, then bumps its `*_taken` count, which frees the slot.

Doorbells are FIFOs in the pod's run directory. A blocked process sleeps in `select` on its
bell (no spinning, no deadline needed for correctness: whoever publishes rings after the words
are written, so a wake-up is never lost; bytes are drained before the words are re-checked).
Sleeping in `select` costs nothing while the pod is idle; a wake-up costs one write and one read.
"""

from __future__ import annotations

import contextlib
import os
import select

from memory import layout as L
from memory.errors import ProtocolError
from memory.region import Region


class Ring:
    """One direction of the channel, seen from one side (`writer` True: this side publishes).

    Arguments:
        region: the die's region (mapped by both sides).
        kind: "cmd" (master -> die) or "res" (die -> master).
        writer: this side writes the ring.
    """

    def __init__(self, region: Region, kind: str, writer: bool):
        lo = region.layout
        if not lo.serve_slot_bytes:
            raise ProtocolError(f"{region.name}: this pod has no serving area (serve_slot_bytes)")
        self.words = region.words
        self.bytes = region.bytes
        self.kind, self.writer = kind, writer
        self.slot_bytes = lo.serve_slot_bytes
        self.slots_off = lo.serve_cmd_off if kind == "cmd" else lo.serve_res_off
        pub, taken = (
            (L.SV_CMD_PUB, L.SV_CMD_TAKEN) if kind == "cmd" else (L.SV_RES_PUB, L.SV_RES_TAKEN)
        )
        self.pub, self.taken = lo.serve_word(pub), lo.serve_word(taken)
        base = L.SV_CMD_LEN if kind == "cmd" else L.SV_CMD_LEN + L.SERVE_SLOTS
        self.lens = [lo.serve_word(base + i) for i in range(L.SERVE_SLOTS)]

    def published(self) -> int:
        return self.words[self.pub]

    def consumed(self) -> int:
        return self.words[self.taken]

    def can_put(self) -> bool:
        return self.words[self.pub] - self.words[self.taken] < L.SERVE_SLOTS

    def put(self, frame: bytes) -> None:
        """Publish one frame (the caller checked `can_put`)."""
        assert self.writer
        k = self.words[self.pub]
        if k - self.words[self.taken] >= L.SERVE_SLOTS:
            raise ProtocolError(f"{self.kind} ring: slot {k} is still unread")
        n = len(frame)
        if n > self.slot_bytes:
            raise ProtocolError(
                f"{self.kind} ring: a {n}-byte frame exceeds the {self.slot_bytes}-byte slot"
                " (PodConfig.serve_slot_bytes)"
            )
        off = self.slots_off + (k % L.SERVE_SLOTS) * self.slot_bytes
        self.bytes[off : off + n] = frame
        self.words[self.lens[k % L.SERVE_SLOTS]] = n
        self.words[self.pub] = k + 1  # LAST: the reader looks at the slot after this

    def available(self) -> bool:
        return self.words[self.pub] > self.words[self.taken]

    def get(self) -> bytes:
        """Copy out the next frame and free its slot (the caller checked `available`)."""
        assert not self.writer
        k = self.words[self.taken]
        n = self.words[self.lens[k % L.SERVE_SLOTS]]
        off = self.slots_off + (k % L.SERVE_SLOTS) * self.slot_bytes
        frame = bytes(self.bytes[off : off + n])
        self.words[self.taken] = k + 1
        return frame


class Bell:
    """A doorbell: a FIFO opened read-write (so it never reports end of file and never blocks
    the opener); `ring` writes one byte, `wait` sleeps until a byte arrives."""

    def __init__(self, path: str):
        self.path = path
        self.fd = os.open(path, os.O_RDWR | os.O_NONBLOCK)

    @staticmethod
    def create(path: str) -> None:
        os.mkfifo(path, 0o600)

    def ring(self) -> None:
        with contextlib.suppress(BlockingIOError):  # full: the sleeper wakes anyway
            os.write(self.fd, b"!")

    def drain(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while os.read(self.fd, 4096):
                pass

    def wait(self, timeout_s: float | None) -> bool:
        """Sleep until the bell rings or `timeout_s` passes; True if it rang."""
        ready, _, _ = select.select([self.fd], [], [], timeout_s)
        return bool(ready)

    def fileno(self) -> int:
        return self.fd

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)


def bell_path(run_dir: str, who: str) -> str:
    """`who`: "d<die>" (a die's bell) or "m<group>" (a master's result bell)."""
    return os.path.join(run_dir, f"bell.{who}")
