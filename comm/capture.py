"""Capture: every event of a die that projected time needs (docs/projection.md §1).

A capture pod (`PodConfig(capture=True)`) gives each die a `CaptureFabric`: every other die is
"remote", so every protocol takes its multi-host path and carries every byte and guard word it
writes in a peer's region through the fabric seam (docs/protocols.md §11, rules R1-R5, checked
for those paths by the poisoned-mirror conformance suites) — but a peer's "mirror" is its real
mapping, so nothing is copied and nothing poisoned: the run is the same run, recorded. The
fabric records `put` / `get` / `pub`; the protocols record what the seam cannot see: each
guarded step (`acq`, whether or not it was already satisfied here), the rows and tokens a put
carries, local copies, compute ops, calls and the stream each event belongs to.

Program order is per stream: a die's `main` stream (barriers, the caller), `a2a` (a collective
kernel), `p2p.tx.D.L` / `p2p.rx.S.L` (one lane, an AIV core, of a send to D / a receive from S).
Where a protocol's host schedule depends on timing (how many ring chunks a receiver found at
once), a capture pod runs a canonical schedule instead, the same on any machine (the events are
what the hardware would do; the protocol is unchanged: `Capture.canonical`).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
import time
from collections.abc import Callable, Iterator, Sequence

from comm.fabric import Fabric
from memory import layout as L

now_ns = time.perf_counter_ns


class Capture:
    """One die's event log, unbounded (a list of lists; msgpack writes it whole)."""

    canonical = True  # the protocols' timing-free schedules (see the module docstring)

    def __init__(self, die_id: int, layout: L.RegionLayout):
        self.die = die_id
        self.layout = layout
        self.streams: list[str] = []
        self._sid: dict[str, int] = {}
        self.seq: list[int] = []  # events so far per stream
        self.events: list[list] = []
        self._tls = threading.local()  # the current stream, per thread (the DMA engine's own)
        self.main = self.stream("main")
        self._rows: dict[int, tuple[int, int, int]] = {}  # peer -> the next put's rows
        self._calls: list[tuple[str, int, int]] = []  # open calls: (name, stream, caller)
        self.tags: dict = {}  # dims the caller adds to its model ops (a micro-batch's `mb`)

    # -- streams ------------------------------------------------------------------------------

    @property
    def cur(self) -> int:
        """The stream events go to now (this thread's; `main` unless inside `on`)."""
        return getattr(self._tls, "sid", self.main)

    @cur.setter
    def cur(self, sid: int) -> None:
        self._tls.sid = sid

    def stream(self, name: str) -> int:
        """The id of stream `name` (made on first use)."""
        sid = self._sid.get(name)
        if sid is None:
            sid = self._sid[name] = len(self.streams)
            self.streams.append(name)
            self.seq.append(0)
        return sid

    @contextlib.contextmanager
    def on(self, sid: int) -> Iterator[None]:
        """Record into stream `sid` for the block (the fabric's events included)."""
        prev, self.cur = self.cur, sid
        try:
            yield
        finally:
            self.cur = prev

    def last(self, sid: int) -> int:
        """The seq of stream `sid`'s latest event (-1: none)."""
        return self.seq[sid] - 1

    def _add(self, sid: int, t0: int, t1: int, kind: str, *fields) -> int:
        seq = self.seq[sid]
        self.seq[sid] = seq + 1
        self.events.append([kind, sid, t0, t1, *fields])
        return seq

    # -- what the fabric records ----------------------------------------------------------------

    def area(self, off: int) -> str:
        """The name of the area byte `off` of a region lies in (docs/projection.md §1.1)."""
        return area_of(self.layout, off)

    def rows(self, peer: int, rows: int, tokens: int, row_bytes: int) -> None:
        """The next `put` to (or `get` from) `peer` carries `rows` messages of `row_bytes` over
        `tokens` distinct tokens (the all-to-all's (token, expert) rows)."""
        self._rows[peer] = (int(rows), int(tokens), int(row_bytes))

    def put(self, peer: int, nbytes: int, area: str, t0: int | None = None) -> None:
        """A write of `nbytes` into `peer`'s region (the die itself: a local write, recorded
        as a put with its rows so that its per-row work counts)."""
        t1 = now_ns()
        rows, tokens, rb = self._rows.pop(peer, (0, 0, 0))
        self._add(self.cur, t1 if t0 is None else t0, t1, "put", int(peer), int(nbytes), area,
                  rows, tokens, rb)  # fmt: skip

    def get(self, peer: int, nbytes: int, area: str, t0: int | None = None) -> None:
        t1 = now_ns()
        rows, _, rb = self._rows.pop(peer, (0, 0, 0))
        self._add(self.cur, t1 if t0 is None else t0, t1, "get", int(peer), int(nbytes), area,
                  rows, rb)  # fmt: skip

    def pub(self, peer: int, words: Sequence[int], values: Sequence[int]) -> None:
        """Guard words into `peer`'s region, in word order (several guards of one publish may
        land in any order: docs/protocols.md §11)."""
        t = now_ns()
        pairs = sorted(zip((int(w) for w in words), (int(v) for v in values), strict=True))
        self._add(self.cur, t, t, "pub", int(peer), [w for w, _ in pairs], [v for _, v in pairs])

    # -- what the protocols record ----------------------------------------------------------------

    def acq(self, words: Sequence[int], targets: Sequence[int], writers: Sequence[int],
            field: str, t0: int, t1: int | None = None) -> None:  # fmt: skip
        """A guarded step of this die over its own words (its own writes are program order:
        left out, as are targets <= 0, every word's initial value)."""
        me = self.die
        keep = sorted((int(w), int(t), int(p)) for w, t, p in zip(words, targets, writers,
                                                                  strict=True)
                      if p != me and t > 0)  # fmt: skip
        if not keep:
            return
        ws, ts, ps = (list(x) for x in zip(*keep, strict=True))
        self._add(self.cur, t0, now_ns() if t1 is None else t1, "acq", ws, ts, ps, field)

    def copy(self, nbytes: int, t0: int | None = None) -> None:
        t1 = now_ns()
        self._add(self.cur, t1 if t0 is None else t0, t1, "copy", int(nbytes))

    def op(self, name: str, flops: int, rd_bytes: int, wr_bytes: int, t0: int | None = None,
           **dims) -> None:  # fmt: skip
        t1 = now_ns()
        self._add(self.cur, t1 if t0 is None else t0, t1, "op", name, int(flops), int(rd_bytes),
                  int(wr_bytes), {k: v for k, v in sorted(dims.items())})  # fmt: skip

    def after(self, sid: int, other: int, seq: int) -> None:
        """Stream `sid`'s next events wait for event `seq` of stream `other`."""
        if seq >= 0:
            t = now_ns()
            self._add(sid, t, t, "after", other, seq)

    def begin(self, name: str, call: int, sid: int | None = None) -> int:
        """A call starts on stream `sid` (default: the current one), after the caller's (the
        current stream's: `main`, or a decode stream `s1` that launches a collective) latest
        event when it runs on a stream of its own."""
        caller = self.cur
        sid = caller if sid is None else sid
        if sid != caller:
            self.after(sid, caller, self.last(caller))
        t = now_ns()
        self._calls.append((name, sid, caller))
        return self._add(sid, t, t, "begin", name, int(call))

    def end(self, name: str, call: int, joins: Sequence[tuple[int, int]] = ()) -> None:
        """The call ends once `joins` ([stream, seq] of this die) have; its caller (the stream
        current at its `begin`) goes on after it."""
        entry = next(c for c in reversed(self._calls) if c[0] == name)
        self._calls.remove(entry)
        _, sid, caller = entry
        t = now_ns()
        seq = self._add(sid, t, t, "end", name, int(call),
                        [[int(s), int(q)] for s, q in joins if q >= 0])  # fmt: skip
        if sid != caller:
            self.after(caller, sid, seq)

    def dump(self) -> dict:
        """The die file's map (docs/projection.md §1.1)."""
        return {"die": self.die, "streams": list(self.streams), "events": self.events}

    def write(self, directory: str) -> dict:
        """Write this die's file into `directory` (a temporary name, then renamed: a file that
        is there is whole); returns its entry of meta.json's `dies`."""
        import hashlib
        import os

        import msgpack

        if self._calls:
            names = ", ".join(c[0] for c in self._calls)
            raise RuntimeError(f"die {self.die}: capture of unfinished calls ({names})")
        name = f"die-{self.die:04d}.msgpack"
        blob = msgpack.packb(self.dump(), use_bin_type=True)
        tmp = os.path.join(directory, f".{name}.tmp")
        with open(tmp, "wb") as fh:
            fh.write(blob)
        os.replace(tmp, os.path.join(directory, name))
        return {"die": self.die, "file": name, "events": len(self.events),
                "sha256": hashlib.sha256(blob).hexdigest()}  # fmt: skip


AREAS = ("desc", "ack", "rdv", "sync", "pull_field", "pull_disp", "pull_comb", "fused_flag",
         "fused_counts", "fused_cflag", "fused_disp", "fused_comb", "a2e_in", "a2e_flag",
         "fused_refuse", "fused_cevent", "a2e_seen", "serve", "serve_cmd", "serve_res", "eplb",
         "eplb_counts", "eplb_plan")  # fmt: skip


def area_of(lo: L.RegionLayout, off: int) -> str:
    """The layout area holding byte `off` of a region: the one with the highest start at or
    below it (the app area, the meta area's fields, the rings at the start of the managed area,
    then the all-to-all and serving areas)."""
    starts = [(lo.app_off, 0, "app"), (lo.meta_off, 0, "meta"), (lo.managed_off, 0, "ring")]
    starts += [(getattr(lo, f"{n}_off", 0), 1, n) for n in AREAS if getattr(lo, f"{n}_off", 0)]
    return max((s for s in starts if s[0] <= off), default=(0, 0, "app"))[2]


class CaptureFabric(Fabric):
    """Every other die "remote" through its real mapping: the protocols' multi-host paths,
    recorded (module docstring). Pushes and pulls copy nothing (the bytes are already there);
    a publish is the store it always is."""

    kind = "capture"
    cheap_guards = False  # p2p takes the general path (the one recorded lane by lane)

    def __init__(self, me: int, regions: Sequence, cap: Capture):
        super().__init__(me, regions)
        self.remote = [d != me for d in range(len(self.regions))]
        self.any_remote = len(self.regions) > 1
        self.cap = cap

    def push(self, peer: int, off: int, nbytes: int) -> None:
        if self.remote[peer] and nbytes > 0:
            self.pushes += 1
            self.push_bytes += nbytes
            self.cap.put(peer, nbytes, self.cap.area(off))

    def push_words(self, peer: int, word: int, count: int = 1) -> None:
        """Payload words (a descriptor's, a flag's counts) travel with the guard published
        after them (one write on the hardware): counted, not recorded."""
        if self.remote[peer]:
            self.pushes += 1
            self.push_bytes += count * L.WORD

    def push_from(self, peer: int, off: int, data) -> None:
        self.bytes[peer][off : off + len(data)] = data
        if self.remote[peer] and len(data):
            self.pushes += 1
            self.push_bytes += len(data)
            self.cap.put(peer, len(data), self.cap.area(off))

    def pull(self, peer: int, off: int, nbytes: int) -> None:
        if self.remote[peer] and nbytes > 0:
            self.pulls += 1
            self.pull_bytes += nbytes
            self.cap.get(peer, nbytes, self.cap.area(off))

    def publish(self, peer: int, word: int, value: int) -> None:
        self.words[peer][word] = value
        if self.remote[peer]:
            self.publishes += 1
            self.cap.pub(peer, (word,), (value,))

    def publish_many(self, peer: int, words: Sequence[int], values: Sequence[int]) -> None:
        w = self.words[peer]
        for i, v in zip(words, values, strict=True):
            w[i] = v
        if self.remote[peer] and len(words):
            self.publishes += len(words)
            self.cap.pub(peer, words, values)


def captured(name: str, stream: str = "a2a") -> Callable:
    """Decorate a collective entry point `fn(ep, ..., event_id=...)`: in a capture pod its
    events go to `stream` between a `begin` and an `end` of call `name` (its event id; an
    expert die's unknown one: -1). Elsewhere it costs one attribute read."""

    def wrap(fn: Callable) -> Callable:
        sig = inspect.signature(fn)

        @functools.wraps(fn)
        def call(ep, *args, **kwargs):
            cap = ep.cap
            if cap is None:
                return fn(ep, *args, **kwargs)
            event = sig.bind(ep, *args, **kwargs).arguments.get("event_id", 0)
            event = -1 if event is None or not isinstance(event, int) else event
            sid = cap.stream(stream)
            cap.begin(name, event, sid)
            with cap.on(sid):
                out = fn(ep, *args, **kwargs)
            cap.end(name, event)
            return out

        return call

    return wrap


def tokens_of(slots) -> int:
    """Distinct tokens (batch slots) among a put's rows."""
    import numpy as np

    return int(len(np.unique(np.asarray(slots)))) if len(slots) else 0


__all__ = ["AREAS", "Capture", "CaptureFabric", "area_of", "captured", "tokens_of"]
