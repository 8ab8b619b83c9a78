"""The engine's receiver of the masters' messages (`Engine` inherits it): a thread that polls
the engine's inbox, or the event loop of the HTTP server in its place (`attach_loop`: one
wake-up per message); the dispatch of each message by kind (`ready`, `out`, `stats`, `pong`,
`log`, and the KV pool servers' replies); and the watch, every `WATCH_EVERY_S`, that every
master and output process still lives (a dead one is a fault: `EngineRecovery._fault`).

Split from `engine.py`, which starts and stops the processes; the state read and written here
(`inbox`, `rx_loop`, `rx_watch`, `rx_handover`, `stats`, `pongs`, `step_log`, ...) is made in
`Engine.__init__`.
"""

from __future__ import annotations

import asyncio
import logging
import time

import zmq

from runtime.engine import wire
from runtime.engine.pool_shell import REPLIES as POOL_REPLIES

log = logging.getLogger(__name__)
WATCH_EVERY_S = 0.2  # how often the receiver thread checks that every master lives


class EngineReceiver:
    """The receiving methods of `runtime.engine.Engine` (see the module doc)."""

    # -- background threads ---------------------------------------------------------------------

    def _receive(self) -> None:
        poller = zmq.Poller()
        poller.register(self.inbox, zmq.POLLIN)
        watched = time.monotonic()
        while not self.rx_handover:
            ready = poller.poll(WATCH_EVERY_S * 1000)
            if time.monotonic() - watched >= WATCH_EVERY_S:
                watched = time.monotonic()
                self._watch()
            if not ready:
                if self.drained:  # close(): every master is gone and nothing is left to read
                    return
                continue
            self._read_inbox()

    def _read_inbox(self) -> None:
        while True:
            try:
                frame = self.inbox.recv(zmq.NOBLOCK)
            except (zmq.Again, zmq.ZMQError):
                return
            try:
                self._on_message(*wire.unpack(frame))
            except Exception as e:  # noqa: BLE001 - a bad frame must not stop the engine
                log.warning("engine: dropped a message: %s", e)

    # -- an event loop as the receiver ----------------------------------------------------------

    def attach_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        """Read the masters' messages on `loop` (call from its thread) instead of the receiver
        thread: one wake-up per message instead of two (the thread's, then the loop's), and
        the deltas go to their streams without crossing threads. `detach_loop` gives it back.
        """
        if self.rx_loop is not None:
            return
        rx = next((t for t in self._threads if t.name == "xpod-engine-receive"), None)
        self.rx_handover = True
        if rx is not None:
            rx.join(2 * WATCH_EVERY_S + 1)
            self._threads.remove(rx)
        self.rx_loop = loop
        loop.add_reader(self.inbox.getsockopt(zmq.FD), self._on_readable)
        loop.call_soon(self._on_readable)  # what came before the reader was added
        self.rx_watch = loop.call_later(WATCH_EVERY_S, self._watch_tick)

    def _on_readable(self) -> None:
        # the zmq FD signals edges: read until the socket says there is nothing left
        while self.inbox is not None and self.inbox.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            self._read_inbox()

    def _watch_tick(self) -> None:
        self._watch()
        if self.rx_loop is not None:
            self.rx_watch = self.rx_loop.call_later(WATCH_EVERY_S, self._watch_tick)

    def detach_loop(self) -> None:
        """Back to the receiver thread (call on the loop's thread, before the loop ends)."""
        loop = self.rx_loop
        if loop is None:
            return
        loop.remove_reader(self.inbox.getsockopt(zmq.FD))
        if self.rx_watch is not None:
            self.rx_watch.cancel()
        self.rx_loop = self.rx_watch = None
        self.rx_handover = False
        self._thread(self._receive, name="xpod-engine-receive")

    def _watch(self) -> None:
        if self.closing or self.failure is not None:
            return
        if self.pool is not None:  # a dead pool server costs hits, never requests
            with self.lock:
                self.pool.watch()
        if self.recovering:
            return
        if self.supervisor is not None and self.config.recover:
            return  # it waits on the processes' sentinels itself
        for g, p in enumerate(self.masters):
            if p.exitcode is not None:
                self._fault(f"master {g} (pid {p.pid}) exited ({p.exitcode})", self.gen)
                return
        for g, p in enumerate(self.outputs):
            if p.exitcode is not None:
                self._fault(f"output process {g} (pid {p.pid}) exited ({p.exitcode})", self.gen)
                return

    def _on_message(self, kind: str, body: dict) -> None:
        if kind in POOL_REPLIES:  # a pool server's (it outlives the pod's incarnations)
            if self.pool is not None:
                with self.lock:
                    self.pool.on_server(kind, body)
            return
        if body.get("gen", 0) != self.gen and kind != "out":  # the tracker counts stale `out`
            return
        if kind == "ready":
            self.ready.release()
        elif kind == "out":
            self.tracker.on_out(body)
        elif kind == "stats":
            self.stats[body["group"]] = body
            self.stats_log.append(body)
            if self.tracker.pd is not None:
                self.tracker.pd.on_stats(body)
            if self.observer is not None:
                self.observer.on_stats(body)
        elif kind == "pong":
            self.pongs[body["group"]] = (body["seq"], time.monotonic(), body.get("die_step", 0))
        elif kind == "log":
            self.step_log[body["group"]] = body["steps"]
            self.master_trace[body["group"]] = body.get("trace", {})
