"""A KV pool server: the process that owns one DRAM tier and one SSD tier of the pod-wide KV
pool and copies blocks between them and the dies' KV pools (KVPOOL.md §4.1, §4.3, §4.5-4.6,
§4.8). It is the emulated DMA engine of 000 §4.4.1: every copy runs here (`scatter_copy`,
without the GIL), no die spends a cycle on it. The index (which block is where) is the shell's
(`sched.pool`); this process only does what it is told and reports what it did.

```
 shell --orders (PULL, bound here)--> pool server s --results (PUSH)--> shell
                                         |  ^ gather (store)              master's inbox
                    die regions <--------+--' scatter (load) --loaded-->  (reply_to, PUSH)
                    /xpod.<pod>.pool<s>  float32 [n_layers, n_slots, block_size, row]
                    <ssd_dir>/<fingerprint hex>/<ns>/<hash:016x>.blk
```

Frames (`runtime.engine.pool_wire`) are `runtime.engine.wire`'s: msgpack `["xpod", kind,
WIRE_VERSION, body]`, checked before use; nothing is pickled. Orders (a body's missing `gen`
is 0, `n_tokens` all rows):
- `store {id, die, gen, die_blocks, slots, n_tokens}` -> `stored {server, id, crcs, bytes, ns,
  status, error}`: the die's blocks, every layer, gathered into the slots.
- `load {id, die, gen, slots, dst_offs, n_tokens, reply_to}` -> `loaded {server, id, crcs,
  bytes, ns, status, error}` pushed to `reply_to` (the results socket without one) once the
  data is in the die's region: `dst_offs` are die byte offsets, layer-major per (layer, block)
  (`KVGeometry.offsets`); a partial last block copies its first rows only. `promote` [[h, slot,
  ns]...]: SSD blocks of the hit read into their slots first, in the same order (a promotion
  the shell ordered could otherwise reach the server after the master's load); the reply's
  `promoted` [[h, ok, crc]...]; a failed one fails the load (status ERROR). `crcs` false: no
  crc of the source slots in the reply (a master checks the landed blocks against the stored
  crcs itself: one crc pass on the critical path, not two).
- `demote {h, slot, ns, parent, tokens, crc}` -> `demoted {server, h, ok, crc, path, error}`:
  the slot to its block file (refused when the slot's crc is not `crc`, or the tier is full).
- `promote {h, slot, path | ns}` -> `promoted {server, h, slot, ok, crc, error}`: a block file
  (crc checked) into the slot.
- `delete {h, ns | path}` -> `deleted {server, h, ok, error}`; `drop {slot}` -> `dropped
  {server, slot, ok}`; `probe {id}` -> `echo {server, id}`; `stop {}`: exit.
Several hosts: a server also binds a peer socket (`peer`, TCP), where other hosts' masters
fetch its slots (runtime.engine.pool_peer); its endpoint goes out in the inventory (`peer`).
A failed order gets its own reply kind with `status` ERROR (1) / `ok` false and `error`; a frame
that is not an order (unknown kind, other version, not msgpack) gets `error {server, id, error}`.
On start: `inventory {server, pid, n_slots, slot_bytes, entries: [[h, ns, parent, tokens, crc,
path]...], skipped, removed_tmp, problems}` (the SSD tier re-indexed). crcs are
`memory.pool_layout.block_crc` of the pool's slots: the same function checks a die's blocks.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import multiprocessing as mp
import os
import signal
import time
import traceback
from dataclasses import dataclass, fields
from typing import NamedTuple

import numpy as np
import posix_ipc
import zmq

from comm.alltoall.state import kernels
from comm.kvlink import KVGeometry, segments
from memory import pool_layout as P
from memory.errors import ConfigError, ProtocolError, ShmError
from runtime.engine.pool_peer import bind_peer, serve_peer
from runtime.engine.pool_wire import (
    ERROR,
    OK,
    ORDER_KINDS,
    REPLY_KINDS,
    REPLY_OF,
    frame_id,
    order_socket,
    pack,
    unpack,
)
from runtime.engine.pool_wire import (
    field_int as _int,
)
from runtime.engine.pool_wire import (
    field_ints as _ints,
)
from runtime.engine.pool_wire import (
    field_ns as _ns,
)
from runtime.engine.wire import WireError
from runtime.pod.proc import batch_scheduling, follow_parent

log = logging.getLogger(__name__)
POLL_MS = 200  # how often an idle server checks that its parent lives
STOP_TIMEOUT_S = 5.0
SHM_DIR = "/dev/shm"
_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)


# -- configuration -----------------------------------------------------------------------------


class DieRegion(NamedTuple):
    """A die region the server may copy into and out of (msgpack: a list)."""

    die: int
    name: str  # the segment, /xpod.<pod>.d<die>
    region_bytes: int
    kv_off: int  # byte offset of the die's KV pool in its region
    n_blocks: int


@dataclass(frozen=True)
class PoolServerConfig:
    pod: str
    server: int
    fingerprint: bytes
    n_layers: int
    block_size: int
    row_floats: int
    n_slots: int
    orders: str  # zmq address the server binds (PULL), ipc:// in the run directory
    results: str  # zmq address the server connects to (PUSH): the shell
    dies: tuple[DieRegion, ...] = ()
    ssd_dir: str | None = None
    ssd_blocks: int = 0  # files the SSD tier may hold (0: no limit)
    ssd_fsync: bool = False
    pin_cpu: int = -1
    epoch: int = 0  # the shell's count of this server's (re)starts: a load or store of another
    # (sent to a predecessor, queued here) is refused, never executed
    peer: str | None = None  # where to bind the peer socket (`tcp://HOST:*`): other hosts'
    # masters read its slots there (runtime.engine.pool_peer); None: one host, no peer socket

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["dies"] = [list(r) for r in self.dies]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> PoolServerConfig:
        return cls(**{**d, "dies": tuple(DieRegion(*r) for r in d.get("dies", ()))})

    def slot_bytes(self) -> int:
        return P.slot_bytes(self.n_layers, self.block_size, self.row_floats)

    def check(self) -> None:
        """ConfigError naming the first bad field."""
        for name in ("n_layers", "block_size", "row_floats", "n_slots"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(
                    f"pool server {self.server}: {name} must be an int >= 1, got {v!r}"
                )
        if not isinstance(self.fingerprint, bytes) or len(self.fingerprint) != 16:
            raise ConfigError(f"pool server {self.server}: the fingerprint must be 16 bytes")
        if self.ssd_blocks < 0:
            raise ConfigError(f"pool server {self.server}: ssd_blocks {self.ssd_blocks} < 0")
        seen = set()
        for r in self.dies:
            end = r.kv_off + r.n_blocks * self.slot_bytes()
            if r.die in seen or r.kv_off < 0 or r.n_blocks < 1 or end > r.region_bytes:
                raise ConfigError(f"pool server {self.server}: die region {tuple(r)}: a die"
                                  f" listed twice, or its KV pool [{r.kv_off}, {end}) is not"
                                  f" inside its {r.region_bytes} B")  # fmt: skip
            seen.add(r.die)


# -- the die regions ---------------------------------------------------------------------------


class _DieMap:
    """One die region mapped read/write (a raw mapping: the server needs the KV pool only)."""

    def __init__(self, spec: DieRegion, gen: int, geo: KVGeometry):
        self.spec, self.gen, self.geo = spec, gen, geo
        try:
            shm = posix_ipc.SharedMemory(spec.name)
        except (posix_ipc.Error, OSError) as e:
            raise ShmError(f"die {spec.die}: shm_open({spec.name}): {e}") from e
        try:
            if shm.size < spec.region_bytes:
                raise ShmError(f"die {spec.die}: {spec.name} has {shm.size} bytes, not"
                               f" {spec.region_bytes}")  # fmt: skip
            self.ino = os.fstat(shm.fd).st_ino
            self.mm = mmap.mmap(shm.fd, spec.region_bytes)
        except OSError as e:
            raise ShmError(f"die {spec.die}: mmap({spec.name}): {e}") from e
        finally:
            shm.close_fd()
        self.arr: np.ndarray | None = np.frombuffer(self.mm, np.uint8)
        self.lo = spec.kv_off
        self.hi = spec.kv_off + geo.n_layers * geo.n_blocks * geo.block_size * geo.row_bytes
        lo = self.lo - self.lo % mmap.PAGESIZE  # page tables filled now, not per copy
        with contextlib.suppress(OSError, ValueError):
            self.mm.madvise(_POPULATE_WRITE, lo, self.hi - lo)

    def current(self, gen: int) -> bool:
        """Still the die's region: the same incarnation and the same segment at its name."""
        if gen != self.gen:
            return False
        try:
            return os.stat(SHM_DIR + self.spec.name).st_ino == self.ino
        except OSError:
            return False

    def close(self) -> None:
        self.arr = None
        with contextlib.suppress(BufferError):
            self.mm.close()


# -- the server --------------------------------------------------------------------------------


class PoolServer:
    """The orders of one server over its DRAM segment `seg` (one thread: the process's)."""

    def __init__(self, cfg: PoolServerConfig, seg: P.PoolSegment):
        self.cfg, self.seg = cfg, seg
        self.geo = KVGeometry(*seg.kv_args())
        self.slot_bytes = cfg.slot_bytes()
        self.dies = {r.die: r for r in cfg.dies}
        self.maps: dict[int, _DieMap] = {}
        self.root = P.check_pool_dir(cfg.ssd_dir) if cfg.ssd_dir is not None else None
        self.fp_dir = os.path.join(self.root, cfg.fingerprint.hex()) if self.root else None
        self.files: set[str] = set()
        self.scanned = P.ScanResult()
        if self.root is not None:
            self.scanned = P.scan(self.root, cfg.fingerprint, self.slot_bytes)
            self.files = {e.path for e in self.scanned.entries}

    def inventory(self) -> dict:
        s = self.scanned
        return {"server": self.cfg.server, "pid": os.getpid(), "n_slots": self.cfg.n_slots,
                "slot_bytes": self.slot_bytes, "entries": [e.to_wire() for e in s.entries],
                "skipped": s.skipped, "removed_tmp": s.removed_tmp,
                "problems": s.problems[:20]}  # fmt: skip

    def handle(self, kind: str, body: dict) -> tuple[str | None, str, dict]:
        """(where: None = the results socket, reply kind, reply body) of one order."""
        try:
            return getattr(self, f"_{kind}")(body)
        except Exception as e:  # noqa: BLE001 - a bad order is answered, never fatal
            if not isinstance(e, ProtocolError | ConfigError | OSError):
                log.warning("pool %d: %s order failed:\n%s", self.cfg.server, kind,
                            traceback.format_exc())  # fmt: skip
            reply = {"server": self.cfg.server, "status": ERROR, "ok": False,
                     "error": f"{type(e).__name__}: {e}"}  # fmt: skip
            reply.update({k: body[k] for k in ("id", "h", "slot") if k in body})
            dest = body.get("reply_to") if kind == "load" else None
            return dest if isinstance(dest, str) else None, REPLY_OF[kind], reply

    def _checked(self, b: dict, kind: str) -> _DieMap:
        """The order's die region, after its guards: the order was meant for this server (its
        `epoch`) and for the die's segment as it is now (its `seg`: the segment's inode when
        the sender chose the blocks; a die restarted since has a new segment at the name)."""
        epoch = b.get("epoch")
        if epoch is not None and int(epoch) != self.cfg.epoch:
            raise ProtocolError(f"{kind}: an order of epoch {epoch}, this server is epoch"
                                f" {self.cfg.epoch} (sent to a predecessor)")  # fmt: skip
        m = self.die(_int(b, "die"), _int(b, "gen", 0))
        seg = b.get("seg")
        if seg is not None and int(seg) != m.ino:
            raise ProtocolError(f"{kind}: die {m.spec.die}'s segment changed since the order"
                                f" was made (inode {seg}, now {m.ino})")  # fmt: skip
        return m

    def die(self, die: int, gen: int) -> _DieMap:
        """Die `die`'s region, (re-)attached when its incarnation `gen` or its segment changed."""
        m = self.maps.get(die)
        if m is not None and m.current(gen):
            return m
        if m is not None:
            m.close()
            del self.maps[die]
        spec = self.dies.get(die)
        if spec is None:
            raise ProtocolError(f"die {die} is not a die of pool server {self.cfg.server}")
        geo = KVGeometry(spec.kv_off, self.cfg.n_layers, spec.n_blocks, self.cfg.block_size,
                         self.cfg.row_floats)  # fmt: skip
        m = self.maps[die] = _DieMap(spec, gen, geo)
        return m

    def _n_tokens(self, b: dict, nb: int) -> int:
        bs = self.cfg.block_size
        n = _int(b, "n_tokens", nb * bs)
        if nb < 1 or not (nb - 1) * bs < n <= nb * bs:
            raise ProtocolError(f"{n} tokens do not fill the last of {nb} blocks of {bs}")
        return n

    def _copy(self, src: np.ndarray, dst: np.ndarray, spans: np.ndarray) -> tuple[int, int]:
        t0 = time.perf_counter_ns()
        n = kernels().scatter_copy(src.ctypes.data, dst.ctypes.data, np.ascontiguousarray(spans))
        return int(n), time.perf_counter_ns() - t0

    def _crcs(self, slots: list[int]) -> list[int]:
        return [P.block_crc(self.seg.array, self.geo, s) for s in slots]

    def _store(self, b: dict) -> tuple[str | None, str, dict]:
        blocks, slots = _ints(b, "die_blocks"), _ints(b, "slots")
        if len(blocks) != len(slots) or len(set(slots)) != len(slots):
            raise ProtocolError(f"store of {len(blocks)} die blocks into {len(slots)} slots"
                                f" (each slot once)")  # fmt: skip
        n = self._n_tokens(b, len(slots))
        m = self._checked(b, "store")
        spans = segments(m.geo, blocks, self.geo.offsets(slots), n)  # both checked in range
        nbytes, ns = self._copy(m.arr, self.seg.array, spans)
        return None, "stored", {"server": self.cfg.server, "id": b.get("id"), "status": OK,
                                "error": "", "crcs": self._crcs(slots), "bytes": nbytes,
                                "ns": ns}  # fmt: skip

    def _load(self, b: dict) -> tuple[str | None, str, dict]:
        reply_to = b.get("reply_to")
        if reply_to is not None and not isinstance(reply_to, str):
            raise ProtocolError(f"load: reply_to {reply_to!r} is not an address")
        slots, dst = _ints(b, "slots"), _ints(b, "dst_offs")
        n = self._n_tokens(b, len(slots))
        m = self._checked(b, "load")
        promoted = []  # SSD blocks of this load, read into their slots first (one order: no
        for p in b.get("promote") or ():  # other sender can come between the two)
            if not (isinstance(p, list) and len(p) == 3):
                raise ProtocolError(f"load: promote entry {p!r} is not [h, slot, ns]")
            try:
                r = self._promote({"h": p[0], "slot": p[1], "ns": p[2]})[2]
            except (ProtocolError, OSError, P.BlockFileError) as e:
                r = {"h": p[0], "ok": False, "crc": 0, "error": str(e)}
            promoted.append([r["h"], bool(r["ok"]), int(r.get("crc") or 0)])
        if not all(ok for _, ok, _ in promoted):
            return reply_to, "loaded", {"server": self.cfg.server, "id": b.get("id"),
                                        "status": ERROR, "error": "a promotion failed",
                                        "crcs": [], "bytes": 0, "ns": 0,
                                        "promoted": promoted}  # fmt: skip
        spans = segments(self.geo, slots, dst, n)
        for _, d, k in spans.tolist():
            if d < m.lo or d + k > m.hi:
                raise ProtocolError(f"load: bytes [{d}, {d + k}) of die {m.spec.die} are outside"
                                    f" its KV pool [{m.lo}, {m.hi})")  # fmt: skip
        nbytes, ns = self._copy(self.seg.array, m.arr, spans)
        crcs = self._crcs(slots) if b.get("crcs", True) else []  # a master checks what landed
        return reply_to, "loaded", {"server": self.cfg.server, "id": b.get("id"), "status": OK,
                                    "error": "", "crcs": crcs, "bytes": nbytes, "ns": ns,
                                    "promoted": promoted}  # fmt: skip

    def _slot_views(self, slot: int) -> list[np.ndarray]:
        return [self.seg.array[o : o + self.slot_bytes // self.cfg.n_layers]
                for o in self.geo.offsets([slot])]  # fmt: skip

    def _path(self, b: dict) -> str:
        """The block file of an order: its `path` (inside this server's fingerprint directory)
        or the one of (`ns`, `h`)."""
        if self.root is None or self.fp_dir is None:
            raise ProtocolError(f"pool server {self.cfg.server} has no SSD tier")
        path = b.get("path")
        if path is None:
            return P.block_path(self.root, self.cfg.fingerprint, _ns(b), _int(b, "h"))
        if not isinstance(path, str):
            raise ProtocolError(f"order field 'path' must be a string, got {path!r}")
        real = os.path.realpath(path)
        if not real.startswith(os.path.realpath(self.fp_dir) + os.sep):
            raise ProtocolError(f"block file {path} is not in the SSD tier {self.fp_dir}")
        return real

    def _demote(self, b: dict) -> tuple[str | None, str, dict]:
        h, slot, ns = _int(b, "h"), _int(b, "slot"), _ns(b)
        crc = None if b.get("crc") is None else _int(b, "crc")
        parent = None if b.get("parent") is None else _int(b, "parent")
        tokens = _ints(b, "tokens")
        path = self._path({"h": h, "ns": ns})
        have = self._crcs([slot])[0]  # checks the slot too
        reply = {"server": self.cfg.server, "h": h, "ok": False, "crc": have, "path": path}
        if crc is not None and crc != have:
            return None, "demoted", {**reply, "error": f"slot {slot} has crc {have}, not {crc}"}
        if self.cfg.ssd_blocks and path not in self.files and \
                len(self.files) >= self.cfg.ssd_blocks:  # fmt: skip
            return None, "demoted", {**reply, "error": f"SSD tier full ({len(self.files)} blocks)"}
        entry = P.write_block(self.root, self.cfg.fingerprint, h, ns, parent, tokens,
                              self._slot_views(slot), fsync=self.cfg.ssd_fsync)  # fmt: skip
        self.files.add(entry.path)
        return None, "demoted", {**reply, "ok": True, "crc": entry.crc, "error": ""}

    def _promote(self, b: dict) -> tuple[str | None, str, dict]:
        h, slot = _int(b, "h"), _int(b, "slot")
        views = self._slot_views(slot) if 0 <= slot < self.cfg.n_slots else None
        if views is None:
            raise ProtocolError(f"slot {slot} is outside the pool of {self.cfg.n_slots}")
        entry, payload = P.read_block(self._path(b), self.cfg.fingerprint, self.slot_bytes)
        if entry.h != h:
            raise ProtocolError(f"block file {entry.path} holds block {entry.h:016x}, not {h:016x}")
        step = self.slot_bytes // self.cfg.n_layers
        for i, v in enumerate(views):
            v[:] = payload[i * step : (i + 1) * step]
        return None, "promoted", {"server": self.cfg.server, "h": h, "slot": slot, "ok": True,
                                  "crc": entry.crc, "error": ""}  # fmt: skip

    def _delete(self, b: dict) -> tuple[str | None, str, dict]:
        h, path = _int(b, "h"), self._path(b)
        self.files.discard(path)
        try:
            os.unlink(path)
        except FileNotFoundError:
            return None, "deleted", {"server": self.cfg.server, "h": h, "ok": False,
                                     "error": f"no block file {path}"}  # fmt: skip
        return None, "deleted", {"server": self.cfg.server, "h": h, "ok": True, "error": ""}

    def _drop(self, b: dict) -> tuple[str | None, str, dict]:
        return None, "dropped", {"server": self.cfg.server, "slot": b.get("slot"), "ok": True}

    def _probe(self, b: dict) -> tuple[str | None, str, dict]:
        return None, "echo", {"server": self.cfg.server, "id": b.get("id")}

    def close(self) -> None:
        for m in self.maps.values():
            m.close()
        self.maps.clear()


def _serve(server: PoolServer, cfg: PoolServerConfig, parent_pid: int) -> None:
    """The order loop, until `stop`, the parent's death or a signal."""
    ctx = zmq.Context()
    orders = ctx.socket(zmq.PULL)
    orders.setsockopt(zmq.LINGER, 0)
    results = ctx.socket(zmq.PUSH)
    results.setsockopt(zmq.LINGER, 1000)
    results.setsockopt(zmq.SNDHWM, 100_000)
    replies: dict[str, zmq.Socket] = {}

    def send(where: str | None, kind: str, body: dict) -> None:
        sock = results
        if where is not None:
            sock = replies.get(where)
            if sock is None:
                try:
                    sock = ctx.socket(zmq.PUSH)
                    sock.setsockopt(zmq.LINGER, 1000)
                    sock.connect(where)
                except zmq.ZMQError as e:
                    sock.close(linger=0)
                    body = {**body, "status": ERROR, "error": f"reply_to {where!r}: {e}"}
                    sock, where = results, None
                else:
                    replies[where] = sock
        try:
            sock.send(pack(kind, body), zmq.NOBLOCK)
        except zmq.Again:
            log.warning("pool %d: %s reply to %s dropped (nobody reads)", cfg.server, kind,
                        where or cfg.results)  # fmt: skip

    peer = None
    poller = zmq.Poller()
    poller.register(orders, zmq.POLLIN)
    try:
        orders.bind(cfg.orders)
        results.connect(cfg.results)
        inventory = server.inventory()
        if cfg.peer is not None:
            peer, inventory["peer"] = bind_peer(ctx, cfg.peer)
            poller.register(peer, zmq.POLLIN)
        send(None, "inventory", inventory)
        while True:
            ready = dict(poller.poll(POLL_MS))
            if peer is not None and peer in ready:
                serve_peer(peer, cfg.server, cfg.epoch, server.seg)
            if orders not in ready:
                if not ready and os.getppid() != parent_pid:
                    log.warning("pool %d: the engine is gone, exiting", cfg.server)
                    return
                continue
            frame = orders.recv()
            try:
                kind, body = unpack(frame)
            except WireError as e:
                send(None, "error", {"server": cfg.server, "id": frame_id(frame),
                                     "error": str(e)})  # fmt: skip
                continue
            if kind == "stop":
                return
            send(*server.handle(kind, body))
    finally:
        if peer is not None:
            peer.close(linger=0)
        for s in (orders, *replies.values()):
            s.close(linger=0 if s is orders else 1000)
        results.close(linger=1000)
        ctx.term()


def _exit_on_term(signum: int, frame: object) -> None:
    raise SystemExit(0)


def serve_pool(cfg: PoolServerConfig | dict, parent_pid: int | None = None) -> None:
    """Entry of a pool server process: create the DRAM segment (a stale one of the same name
    unlinked first), re-index the SSD tier, push the inventory, serve. Exits on `stop`, SIGTERM
    or the parent's death (PR_SET_PDEATHSIG, and its pid polled), unlinking the segment on
    every way out but SIGKILL (then `cleanup_pool_segment`)."""
    if isinstance(cfg, dict):
        cfg = PoolServerConfig.from_dict(cfg)
    parent = os.getppid() if parent_pid is None else parent_pid
    signal.signal(signal.SIGTERM, _exit_on_term)
    if not follow_parent(parent):  # the engine is already gone
        os._exit(3)
    logging.basicConfig(format=f"pool {cfg.server} %(levelname)s %(name)s: %(message)s")
    if cfg.pin_cpu >= 0:
        os.sched_setaffinity(0, {cfg.pin_cpu})
    batch_scheduling()  # copies run when the dies yield: a copy must not preempt a die mid-step
    seg: P.PoolSegment | None = None
    server: PoolServer | None = None
    failed = False
    try:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # a segment is ours or none
        try:
            P.unlink_pool(cfg.pod, cfg.server)
            seg = P.create_pool(cfg.pod, cfg.server, cfg.fingerprint, cfg.n_layers, cfg.n_slots,
                                cfg.block_size, cfg.row_floats)  # fmt: skip
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
        server = PoolServer(cfg, seg)
        _serve(server, cfg, parent)
    except Exception:  # noqa: BLE001 - logged with the server, then exit non-zero
        log.error("pool server %d failed:\n%s", cfg.server, traceback.format_exc())
        failed = True
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if server is not None:
            server.close()
        if seg is not None:
            seg.close()
            seg.unlink()
    if failed:
        raise SystemExit(1)


# -- the parent's side -------------------------------------------------------------------------


@dataclass
class PoolServerHandle:
    process: mp.process.BaseProcess
    cfg: PoolServerConfig

    @property
    def pid(self) -> int | None:
        return self.process.pid

    @property
    def sentinel(self) -> int:
        return self.process.sentinel

    @property
    def exitcode(self) -> int | None:
        return self.process.exitcode

    def is_alive(self) -> bool:
        return self.process.is_alive()


def start_pool_server(cfg: PoolServerConfig) -> PoolServerHandle:
    """Fork pool server `cfg.server` (the engine's start method for its children: fork, daemon,
    following this process). The configuration and SSD directory are checked here first, so a
    bad one is a ConfigError in the caller."""
    cfg.check()
    if cfg.ssd_dir is not None:
        P.check_pool_dir(cfg.ssd_dir)
    kernels()  # loaded here once: the server starts with `scatter_copy` compiled
    ctx = mp.get_context("fork")
    p = ctx.Process(target=serve_pool, args=(cfg, os.getpid()),
                    name=f"xpod-{cfg.pod}-pool{cfg.server}", daemon=True)  # fmt: skip
    p.start()
    return PoolServerHandle(p, cfg)


def cleanup_pool_segment(pod: str, server: int) -> bool:
    """Unlink the DRAM segment of a server that could not (SIGKILL); False if it was gone."""
    return P.unlink_pool(pod, server)


def stop_pool_server(handle: PoolServerHandle, timeout_s: float = STOP_TIMEOUT_S) -> int | None:
    """SIGTERM (SIGKILL after `timeout_s`), reap, then remove what a killed server leaves: its
    DRAM segment and its ipc socket file. Returns the exit code."""
    p = handle.process
    if p.is_alive():
        p.terminate()
        p.join(timeout_s)
    if p.is_alive():
        p.kill()
        p.join(timeout_s)
    cleanup_pool_segment(handle.cfg.pod, handle.cfg.server)
    if handle.cfg.orders.startswith("ipc://"):
        with contextlib.suppress(OSError):
            os.unlink(handle.cfg.orders[len("ipc://") :])
    return p.exitcode


__all__ = [
    "ERROR", "OK", "ORDER_KINDS", "REPLY_KINDS", "DieRegion", "PoolServer", "PoolServerConfig",
    "PoolServerHandle", "cleanup_pool_segment", "order_socket", "pack", "serve_pool",
    "start_pool_server", "stop_pool_server", "unpack",
]  # fmt: skip
