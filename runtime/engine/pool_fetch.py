"""A master's pool loads over hosts (`--hosts`; the mixin of `runtime.engine.pool_master.
PoolSide`): the blocks of a hit held by another host's pool server are fetched over TCP from
that server's peer socket (`runtime.engine.pool_peer`: `fetch` on a DEALER, the reply carries
the bytes) and written into the die's blocks by the master itself; home blocks of the same load
are copied from the mapped DRAM tier (`PoolSide._direct`). The load lands when every fetch
answered. Nothing writes the die's blocks but this master, so a fetch that fails or times out
frees them at once (no quarantine). Also `Load`, a load in flight, and `_scatter`, the copy of
spans into the die's blocks both paths use.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np
import zmq

from comm.alltoall.state import kernels
from runtime.engine.pool_peer import unpack_fetched
from runtime.engine.pool_server import pack as pool_frame
from runtime.engine.wire import WireError
from sched import Request

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Load:
    req: Request
    lease: int
    server: int
    blocks: list[list]  # [hash, server, slot, crc, promote] of the loaded blocks (past the hit)
    local: int  # blocks the die-local cache had
    offs: list[int]  # the scatter list: per (layer, loaded block), layer-major
    since: float = field(default_factory=time.monotonic)
    t_ns: int = field(default_factory=time.perf_counter_ns)  # the trace's clock
    aborted: bool = False
    pending: dict[int, list[int]] | None = None  # fetched: server -> its blocks (indices)
    nbytes: int = 0


class Fetches:
    """PoolSide's loads over hosts (module docstring); the state is PoolSide's: `peers`,
    `poller`, `home`, `loads`, `counters`, `m`, `n_layers`, `row_bytes`, `load_by`."""

    def _scatter(self, src_buf: np.ndarray, src: np.ndarray, ld: Load, idx: list[int]) -> int:
        """Copy spans of `src_buf` at `src` (per (layer, block of idx), layer-major) to the
        die's blocks idx of the load."""
        n, stride = len(ld.blocks), self.m.spec.block_size * self.row_bytes
        dst = [ld.offs[layer * n + i] for layer in range(self.n_layers) for i in idx]
        spans = np.empty((len(dst), 3), np.int64)
        spans[:, 0], spans[:, 1], spans[:, 2] = src, dst, stride
        n = kernels().scatter_copy(src_buf.ctypes.data, self.m.region.array.ctypes.data, spans)
        return int(n)

    # -- several hosts: fetches from other hosts' servers ---------------------------------------

    def _fetch(self, ld: Load, hint: dict) -> bool:
        """Load ld over hosts (module docstring): home blocks copied now (load_by master),
        the others fetched from their servers; False (the caller queues the request to
        recompute) when a server has no peer socket known yet or its tier is not mapped."""
        rid, kv = ld.req.request_id, self.m.kv
        info = {int(x[0]): (x[1], x[2]) for x in hint.get("servers") or ()}
        pending: dict[int, list[int]] = {}
        home = []
        for i, b in enumerate(ld.blocks):
            s = int(b[1])
            if s == self.home and self.load_by == "master":
                home.append(i)
            else:
                pending.setdefault(s, []).append(i)
        socks = {s: self._peer(s, info.get(s, (None, None))[1]) for s in pending}
        nbytes = self._direct(ld, hint.get("pid"), home) if home else 0
        if nbytes is None or any(v is None for v in socks.values()):
            kv.free(("pool", rid))
            self._unpin(ld.lease)
            self.counters["pool_load_fallbacks"] += 1
            return False
        self.counters["pool_loads"] += 1
        self.counters["pool_remote_loads"] += 1
        ld.pending, ld.nbytes = pending, nbytes
        self.loads[rid] = ld
        for s, idx in pending.items():
            socks[s].send(
                pool_frame(
                    "fetch",
                    {"id": rid, "epoch": info[s][0], "slots": [int(ld.blocks[i][2]) for i in idx]},
                )
            )
            self.counters["pool_fetches"] += 1
        return True

    def _peer(self, s: int, endpoint: str | None) -> zmq.Socket | None:
        """The DEALER to server s's peer socket at `endpoint` (a new one when it moved)."""
        have = self.peers.get(s)
        if have is not None and have[0] == endpoint:
            return have[1]
        self._drop_peer(s)
        if not isinstance(endpoint, str):
            return None
        sock = self.m.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        self.peers[s] = (endpoint, sock)
        if self.poller is not None:
            self.poller.register(sock, zmq.POLLIN)
        return sock

    def _drop_peer(self, s: int) -> None:
        have = self.peers.pop(s, None)
        if have is not None:
            if self.poller is not None:
                self.poller.unregister(have[1])
            have[1].close(linger=0)

    def poll_peers(self, events: dict) -> None:
        """Every `fetched` waiting on a peer socket the master's poll saw readable."""
        for s, (_, sock) in list(self.peers.items()):
            if sock not in events:
                continue
            while self.peers.get(s, (None, None))[1] is sock:
                try:
                    frame = sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                try:
                    body = unpack_fetched(frame)
                except WireError as e:
                    log.warning("master %d: a bad reply from pool server %d: %s",
                                self.m.spec.group, s, e)  # fmt: skip
                    continue
                self.on_fetched(s, body)

    def on_fetched(self, s: int, body: dict) -> None:
        """Server s's bytes for a load: written into its blocks; the load lands when every
        server it fetches from answered."""
        ld = self.loads.get(body.get("id"))
        if ld is None or ld.pending is None or s not in ld.pending:
            return  # a late reply of a load fallen back (its blocks are free already)
        idx = ld.pending.pop(s)
        stride = self.m.spec.block_size * self.row_bytes
        data = body.get("data")
        want = self.n_layers * len(idx) * stride
        if body.get("status") != 0 or not isinstance(data, bytes) or len(data) != want:
            self.counters["pool_fetch_failed"] += 1
            why = body.get("error") or f"{len(data or b'')} bytes, not {want}"
            self._fallback(ld, f"fetch from server {s} failed: {why}")
            return
        if not ld.aborted:
            buf = np.frombuffer(data, np.uint8)
            ld.nbytes += self._scatter(buf, np.arange(len(idx) * self.n_layers) * stride, ld, idx)
            self.counters["pool_fetch_bytes"] += len(data)
        if ld.pending:
            return
        del self.loads[ld.req.request_id]
        if ld.aborted:
            self.m.kv.free(("pool", ld.req.request_id))
            self._unpin(ld.lease)
            return
        self._land(ld, True, ld.nbytes, [])


__all__ = ["Fetches", "Load"]
