"""The shell's side of the KV pool (`--kv-pool`, docs/serving.md "KV pool"): the pool's index
(`sched.pool.PoolIndex`, in this process: a lookup costs no round trip), its server process
and the messages between them and the masters (KVPOOL.md §4).

```
 tracker.dispatch_pending --hint()--> add{pool: lease, ns, blocks}  --> master g (PoolSide)
 master g  --out{pool: unpin / landed / failed / bad / put}--> on_event()
 on_event(put) --put_start--> store{die blocks -> slots} --> pool server --stored--> on_server()
 on_server(stored) --put_end--> pool_release{hold} --> master g
 index eviction --demote / delete--> pool server;  a hit's SSD blocks --promote--> in the load
```

A pool server is a child process of the engine (`runtime.engine.pool_server`), outside the
pod's restart: a die or master restart keeps the pool (the requests it resumes hit it), and a
pool server's death costs hits, never requests: the shell sees it exit (`watch`, every
supervisor tick), its DRAM entries leave the index (`PoolIndex.server_dead`), every master
falls back on its loads (`pool_dead`), and it is restarted (up to `restarts` times), its SSD
tier re-indexed from its inventory.

The ns (namespace) of a request is a salt on its first block (`sched.pool.ns_root`); the
default None leaves every hash as the die-local prefix cache computes it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import os
import shutil
from dataclasses import asdict

import zmq

from memory import layout as L
from memory import pool_layout as P
from memory.errors import ConfigError
from memory.region import region_name
from runtime.engine.pd_shell import pd_blocks
from runtime.engine.pool_config import PoolConfig, quota_blocks
from runtime.engine.pool_server import (
    DieRegion,
    PoolServerConfig,
    cleanup_pool_segment,
    order_socket,
    start_pool_server,
    stop_pool_server,
)
from runtime.engine.pool_server import pack as pool_frame
from runtime.engine.wire import engine_socket
from sched.pool import Dropped, Granted, PoolIndex

log = logging.getLogger(__name__)
KV_FORMAT = 1  # the pool's block format (a change makes old SSD files foreign)
REPLIES = frozenset({"inventory", "stored", "demoted", "promoted", "deleted", "dropped", "echo",
                     "error"})  # fmt: skip


def segment_inode(name: str) -> int | None:
    """The inode of POSIX shared-memory segment `name` now (None: not there): an order names
    the die segment it was made for (a restarted die has a new one at the same name)."""
    try:
        return os.stat(os.path.join("/dev/shm", name.lstrip("/"))).st_ino
    except OSError:
        return None


def fingerprint(model, cfg) -> bytes:
    """What makes a block's bytes: the model (its seed, dims, routing, batch invariance), the
    all-to-all's quantization and combine dtype, the block size, the format."""
    doc = repr(sorted(asdict(model).items())) + repr(
        (cfg.quant, cfg.combine_dtype, cfg.block_size, KV_FORMAT)
    )
    return hashlib.blake2b(doc.encode(), digest_size=16).digest()


class PoolShell:
    """The pool's index, server and messages, for one engine (module docstring)."""

    def __init__(self, engine):
        self.e = engine
        cfg = engine.config
        self.cfg: PoolConfig = cfg.kv_pool
        m = engine.model
        self.n_layers, self.row_floats, self.bs = m.kv_layers, m.kv_cache_dim, cfg.block_size
        self.fp = fingerprint(m, cfg)
        self.slot_bytes = P.slot_bytes(self.n_layers, self.bs, self.row_floats)
        self.n_slots = P.slots_for(self.cfg.dram_mib, self.n_layers, self.bs, self.row_floats)
        self.ssd_blocks = int(self.cfg.ssd_mib * (1 << 20)) // self.slot_bytes
        if self.cfg.ssd_mib and not self.ssd_blocks:
            raise ConfigError(f"kv_pool.ssd_mib: {self.cfg.ssd_mib:g} MiB holds no block of"
                              f" {self.slot_bytes} B")  # fmt: skip
        if self.cfg.pool_dir is not None:
            P.check_pool_dir(self.cfg.pool_dir)  # a clear refusal before anything starts
        self.quotas = quota_blocks(self.cfg.quotas, self.slot_bytes)
        self.index = PoolIndex(self.bs, {0: self.n_slots},
                               {0: self.ssd_blocks} if self.ssd_blocks else None,
                               admit=self.cfg.admit, lease_s=self.cfg.lease_s,
                               quotas=self.quotas)  # fmt: skip
        # hash -> ns of the entries of a namespace (a `delete` order, queued once its entry
        # left the index, names the SSD file's ns directory); pruned to the index now and then
        self.ns_of: dict[int, str] = {}
        self.handle = None
        self.sock = None
        self.ctx: zmq.Context | None = None
        self.ssd_dir: str | None = None
        self.own_dir = False
        self.down = False  # out of restarts: the pool is off
        self.epoch = 0
        self.restarts = 0
        self.next_store = 0
        self.stores: dict[int, tuple[int, int, list[int]]] = {}  # id -> group, hold, hashes
        self.counters = {"pool_lookups": 0, "pool_hints": 0, "pool_hint_blocks": 0,
                         "pool_stores": 0, "pool_stored_blocks": 0, "pool_store_failed": 0,
                         "pool_landed_blocks": 0, "pool_load_failed": 0, "pool_crc_bad": 0,
                         "pool_server_deaths": 0, "pool_server_restarts": 0,
                         "pool_inventory_blocks": 0, "pool_inventories": 0, "pool_demote_failed": 0,
                         "pool_load_ms_sum": 0.0, "pool_load_bytes": 0,
                         "pool_quota_refused_blocks": 0}  # fmt: skip

    # -- lifecycle ---------------------------------------------------------------------------

    def master_spec(self) -> dict:
        run_dir = self.e.run_dir
        return {"servers": {0: order_socket(run_dir, 0)}, "n_layers": self.n_layers,
                "row_floats": self.row_floats, "timeout_s": self.cfg.load_timeout_s,
                "store": self.cfg.store, "pod": self.e.pod_id,
                "load_by": self.cfg.load_by}  # fmt: skip

    def start(self) -> None:
        """Start the pool server (after the dies made their KV pools: their offsets)."""
        e = self.e
        if self.ssd_blocks and self.ssd_dir is None:
            self.own_dir = self.cfg.pool_dir is None
            self.ssd_dir = self.cfg.pool_dir or os.path.join(e.run_dir, "pool-ssd")
        pod = e.pod
        lo = pod.layout
        word = lo.serve_word(L.SV_KV_POOL)
        dies = tuple(DieRegion(g, region_name(e.pod_id, g), lo.region_bytes,
                               int(pod.region(g).words[word]), pd_blocks(e.config, g))
                     for g in range(e.config.dies))  # fmt: skip
        if any(d.kv_off == 0 for d in dies):
            raise ConfigError("kv pool: a die has no KV pool yet (start after the warm-up)")
        cpus = sorted(os.sched_getaffinity(0))
        self.server_cfg = PoolServerConfig(
            pod=e.pod_id, server=0, fingerprint=self.fp, n_layers=self.n_layers,
            block_size=self.bs, row_floats=self.row_floats, n_slots=self.n_slots,
            orders=order_socket(e.run_dir, 0), results=engine_socket(e.run_dir), dies=dies,
            ssd_dir=self.ssd_dir, ssd_blocks=self.ssd_blocks,
            pin_cpu=cpus[-1] if len(cpus) > 1 and e.config.pin != "off" else -1,
        )  # fmt: skip
        self._spawn()

    def _spawn(self) -> None:
        cleanup_pool_segment(self.e.pod_id, 0)
        self.epoch += 1  # orders queued for a predecessor are refused by this one
        self.server_cfg = dataclasses.replace(self.server_cfg, epoch=self.epoch)
        self.handle = start_pool_server(self.server_cfg)
        if self.ctx is None:
            self.ctx = zmq.Context()
        if self.sock is None:
            self.sock = self.ctx.socket(zmq.PUSH)
            self.sock.setsockopt(zmq.LINGER, 0)
            self.sock.connect(self.server_cfg.orders)

    def sentinel(self) -> int | None:
        return self.handle.sentinel if self.handle is not None and not self.down else None

    def watch(self) -> bool:
        """Check the server (caller holds the tracker lock); True if it died (handled)."""
        h = self.handle
        if h is None or self.down or h.is_alive():
            return False
        code = h.exitcode
        self.counters["pool_server_deaths"] += 1
        log.warning("kv pool: server 0 (pid %s) exited (%s): its DRAM entries are lost, loads"
                    " fall back to recompute", h.pid, code)  # fmt: skip
        cleanup_pool_segment(self.e.pod_id, 0)
        self.index.server_dead(0)
        for sid in list(self.stores):
            self._store_failed(sid)
        for g in range(self.e.config.dies):
            self.e._send(g, "pool_dead", {"server": 0})
        if self.restarts >= self.cfg.restarts:
            self.down = True
            log.warning("kv pool: server 0 out of restarts (%d): the pool is off",
                        self.restarts)  # fmt: skip
            return True
        self.restarts += 1
        self.counters["pool_server_restarts"] += 1
        self._spawn()
        return True

    def close(self) -> None:
        if self.handle is not None:
            with contextlib.suppress(Exception):
                stop_pool_server(self.handle)
            self.handle = None
        with contextlib.suppress(Exception):
            cleanup_pool_segment(self.e.pod_id, 0)
        if self.sock is not None:
            self.sock.close(linger=0)
            self.sock = None
        if self.ctx is not None:
            self.ctx.term()
            self.ctx = None
        if self.own_dir and self.ssd_dir:
            shutil.rmtree(self.ssd_dir, ignore_errors=True)

    # -- read path (dispatch, under the tracker lock) -----------------------------------------

    def hint(self, tokens: list[int], ns: str | None = None) -> dict | None:
        """The `pool` field of an `add` (module docstring), or None (no hit worth a load)."""
        if self.down or self.handle is None:
            return None
        self.counters["pool_lookups"] += 1
        hit = self.index.lookup(tokens, ns)
        orders = self.index.take_orders()
        promote = {(o[2], o[3]) for o in orders if o[0] == "promote"}
        rest = [o for o in orders if o[0] != "promote"]
        if not hit.blocks or len(hit.blocks) < self.cfg.min_hit_blocks:
            self._send_orders(rest)
            if hit.blocks:
                self._undo(hit, promote)
            return None
        blocks = []
        for b in hit.blocks:
            slot = b.slot if b.promote_slot is None else b.promote_slot
            mine = (b.h, slot) in promote
            if b.promote_slot is not None and not mine:
                break  # an earlier hit's load is promoting it: its bytes are not in DRAM yet
            blocks.append([b.h, b.server, slot, b.crc, mine])
        for b in hit.blocks[len(blocks) :]:  # promotions ordered past the cut: not carried
            if (b.h, b.promote_slot) in promote:
                self.index.promoted(b.h, b.promote_slot, ok=False)
                promote.discard((b.h, b.promote_slot))
        if len(blocks) < max(1, self.cfg.min_hit_blocks):
            self._send_orders(rest)
            for b in blocks:
                if b[4]:
                    self.index.promoted(b[0], b[2], ok=False)
            self.index.release(hit.lease)
            return None
        self.counters["pool_hints"] += 1
        self.counters["pool_hint_blocks"] += len(blocks)
        hint = {
            "lease": hit.lease,
            "ns": ns,
            "blocks": blocks,
            "epoch": self.epoch,
            "pid": self.handle.pid,
        }  # the server the slots are in (its incarnation)
        if promote:
            # The demotions that made room for the promotions go with the hint: its master
            # sends them before its load, on the same socket (sent from here, they could reach
            # the server after the load's promotions overwrote their slots).
            hint["orders"] = self._frames(rest)
        else:
            self._send_orders(rest)
        return hint

    def _undo(self, hit, promote: set) -> None:
        for b in hit.blocks:
            if b.promote_slot is not None and (b.h, b.promote_slot) in promote:
                self.index.promoted(b.h, b.promote_slot, ok=False)
        self.index.release(hit.lease)

    # -- a master's events (its `out`, under the tracker lock) --------------------------------

    def on_event(self, group: int, ev: list) -> None:
        kind = ev[0]
        if kind == "unpin":  # [unpin, lease, promoted, unrun] (older: [unpin, lease])
            if len(ev) > 3:
                self._promoted(ev[2])
                for h, slot in ev[3]:
                    self.index.promoted(int(h), int(slot), ok=False)
            self.index.release(int(ev[1]))
        elif kind == "landed":
            _, _rid, lease, ok, _n, nbytes, ms, promoted = ev
            self._promoted(promoted)
            self.index.release(int(lease))
            self.counters["pool_landed_blocks"] += int(ok)
            self.counters["pool_load_ms_sum"] += float(ms)
            self.counters["pool_load_bytes"] += int(nbytes)
        elif kind == "failed":
            self.counters["pool_load_failed"] += 1
            self.index.release(int(ev[2]))
        elif kind == "bad":
            self.counters["pool_crc_bad"] += 1
            self.index.drop(int(ev[1]))
        elif kind == "put":
            self._put(group, int(ev[1]), ev[2], ev[3] if len(ev) > 3 else None)
        self._send_orders(self.index.take_orders())

    def _promoted(self, promoted: list) -> None:
        for h, ok, _crc in promoted:
            e = self.index.entry(int(h))
            if e is not None and e.promoting:
                self.index.promoted(int(h), e.dram_slot, ok=bool(ok))
                if not ok:
                    self.index.drop(int(h))

    def _put(self, group: int, hold: int, blocks: list, ns: str | None = None) -> None:
        """A master's offer: blocks [hash, parent, tokens, die block] of namespace ns (the
        first one's parent its root, a chain); a block over ns's quota is skipped, and so are
        its descendants (orphans): counted as refused for the quota."""
        if self.down or self.handle is None or self.cfg.store == "off":
            self.e._send(group, "pool_release", {"hold": hold})
            return
        states = self.index.put_start([(int(h), None if p is None else int(p), tuple(t))
                                       for h, p, t, _ in blocks], ns)  # fmt: skip
        over = False  # a block refused for the quota, and its descendants in the offer
        for st in states:
            if isinstance(st, Dropped) and st.reason in ("quota", "orphan"):
                over = over or st.reason == "quota"
                self.counters["pool_quota_refused_blocks"] += over
        if ns is not None:
            self._note_ns(ns, [int(b[0]) for b, st in zip(blocks, states, strict=True)
                               if isinstance(st, Granted)])  # fmt: skip
        granted = [(b, st) for b, st in zip(blocks, states, strict=True)
                   if isinstance(st, Granted)]  # fmt: skip
        if not granted:
            self.e._send(group, "pool_release", {"hold": hold})
            return
        sid = self.next_store
        self.next_store += 1
        self.stores[sid] = (group, hold, [int(b[0]) for b, _ in granted])
        self.counters["pool_stores"] += 1
        self._send_orders(self.index.take_orders())  # demotions before the slots are reused
        body = {"id": sid, "die": group, "gen": self.e.gen, "epoch": self.epoch,
                "seg": segment_inode(region_name(self.e.pod_id, group)),
                "die_blocks": [int(b[3]) for b, _ in granted],
                "slots": [st.slot for _, st in granted],
                "n_tokens": len(granted) * self.bs}  # fmt: skip
        self.sock.send(pool_frame("store", body))

    # -- the server's replies (the engine's receiver, under the tracker lock) -----------------

    def on_server(self, kind: str, body: dict) -> None:
        if kind == "stored":
            st = self.stores.pop(body.get("id"), None)
            if st is None:
                return
            group, hold, hashes = st
            if body.get("status") == 0 and len(body.get("crcs", ())) == len(hashes):
                for h, crc in zip(hashes, body["crcs"], strict=True):
                    self.index.put_end(h, int(crc))
                self.counters["pool_stored_blocks"] += len(hashes)
            else:
                for h in hashes:
                    self.index.put_abort(h)
                self.counters["pool_store_failed"] += 1
            self.e._send(group, "pool_release", {"hold": hold})
        elif kind == "demoted" and not body.get("ok"):
            self.counters["pool_demote_failed"] += 1
            self.index.drop(int(body.get("h", 0)))
        elif kind == "inventory":
            ents = [(int(x[0]), x[1], None if x[2] is None else int(x[2]), tuple(x[3]),
                     int(x[4])) for x in body.get("entries", ())]  # fmt: skip
            for h, ns, *_ in ents:
                if isinstance(ns, str):
                    self._note_ns(ns, [h])
            self.index.server_inventory(0, ents)
            self.counters["pool_inventory_blocks"] += len(ents)
            self.counters["pool_inventories"] += 1
            # the masters map its DRAM tier now (not on a hit's critical path) and offer their
            # blocks again (those offered while it was down were refused, never stored)
            pid = body.get("pid")
            for g in range(self.e.config.dies):
                self.e._send(g, "pool_up", {"server": 0, "pid": pid})
        elif kind == "error":
            log.warning("kv pool: server 0 refused an order: %s", body.get("error"))
        self._send_orders(self.index.take_orders())

    def _store_failed(self, sid: int) -> None:
        group, hold, hashes = self.stores.pop(sid)
        for h in hashes:
            self.index.put_abort(h)
        self.counters["pool_store_failed"] += 1
        self.e._send(group, "pool_release", {"hold": hold})

    def _send_orders(self, orders: list[tuple]) -> None:
        if self.sock is None or self.down:
            return
        for _server, kind, body in self._frames(orders):
            self.sock.send(pool_frame(kind, body))

    def _frames(self, orders: list[tuple]) -> list[list]:
        """[server, kind, body] of the index's orders."""
        out = []
        for o in orders:
            kind, server, h = o[0], o[1], o[2]
            if kind == "demote":
                e = self.index.entry(h)
                if e is None:
                    continue
                out.append([server, "demote", {
                    "h": h, "slot": o[3], "ns": e.ns, "parent": e.parent,
                    "tokens": list(e.tokens), "crc": e.crc}])  # fmt: skip
            elif kind == "delete":  # its entry left the index: its ns as noted
                out.append([server, "delete", {"h": h, "ns": self.ns_of.pop(h, None)}])
            elif kind == "promote":  # not part of a hit's load: its own order
                e = self.index.entry(h)
                out.append([server, "promote", {"h": h, "slot": o[3],
                                                "ns": e.ns if e else None}])  # fmt: skip
        return out

    def _note_ns(self, ns: str, hashes: list[int]) -> None:
        if len(self.ns_of) > 2 * len(self.index) + 1024:  # drop the hashes no longer indexed
            self.ns_of = {h: n for h, n in self.ns_of.items() if h in self.index}
        self.ns_of.update(dict.fromkeys(hashes, ns))

    # -- figures -------------------------------------------------------------------------------

    def stats(self) -> dict:
        return {**self.counters, **{f"index_{k}": v for k, v in self.index.stats().items()},
                "n_slots": self.n_slots, "ssd_blocks": self.ssd_blocks,
                "slot_bytes": self.slot_bytes, "up": not self.down}  # fmt: skip


__all__ = ["REPLIES", "PoolConfig", "PoolShell", "fingerprint", "segment_inode"]
