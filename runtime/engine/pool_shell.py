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

A pod over several hosts (`--hosts`) has one server per host (server s: the s-th host with
dies), each attached to its own host's dies only. A die's blocks are stored on its host's
server (`put_start(..., server, strict=True)`: its DRAM tier is the one that server's copy
reaches); a lookup sees every server, and a hit held by another host's server is read by the
die's master over TCP from that server's peer socket (`runtime.engine.pool_peer`), except the
blocks that server would first promote from its SSD tier (the hit stops there: a promotion
and the fetch that reads it travel on different sockets, unordered).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import os
import shutil
from dataclasses import asdict, dataclass, field

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
    PoolServerHandle,
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


@dataclass
class _Server:
    """One pool server as the shell knows it."""

    sid: int
    dies: list[int]  # the groups of its host
    cfg: PoolServerConfig | None = None
    handle: PoolServerHandle | None = None
    sock: zmq.Socket | None = None  # PUSH to its orders
    epoch: int = 0
    restarts: int = 0
    down: bool = False  # out of restarts
    peer: str | None = None  # its peer socket's endpoint (several hosts)
    ssd_dir: str | None = None
    stats: dict = field(default_factory=dict)

    def up(self) -> bool:
        return self.handle is not None and not self.down


def hosts_of_groups(cfg) -> list[int]:
    """The pool server of each DP group: the index of its host among the hosts with groups
    (one host: every group's is 0)."""
    hosts = list(cfg.hosts[: cfg.dies]) if cfg.hosts else [0] * cfg.dies
    order = sorted(set(hosts))
    return [order.index(h) for h in hosts]


class PoolShell:
    """The pool's index, servers and messages, for one engine (module docstring)."""

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
        self.home = hosts_of_groups(cfg)  # group -> its host's server
        self.servers = {s: _Server(s, [g for g, h in enumerate(self.home) if h == s])
                        for s in sorted(set(self.home))}  # fmt: skip
        self.multi = len(self.servers) > 1
        self.index = PoolIndex(self.bs, dict.fromkeys(self.servers, self.n_slots),
                               dict.fromkeys(self.servers, self.ssd_blocks)
                               if self.ssd_blocks else None,
                               admit=self.cfg.admit, lease_s=self.cfg.lease_s,
                               quotas=self.quotas)  # fmt: skip
        # hash -> ns of the entries of a namespace (a `delete` order, queued once its entry
        # left the index, names the SSD file's ns directory); pruned to the index now and then
        self.ns_of: dict[int, str] = {}
        self.ctx: zmq.Context | None = None
        self.ssd_dir: str | None = None
        self.own_dir = False
        self.next_store = 0
        self.stores: dict[int, tuple[int, int, list[int], int]] = {}  # group, hold, hashes, s
        self.counters = {"pool_lookups": 0, "pool_hints": 0, "pool_hint_blocks": 0,
                         "pool_stores": 0, "pool_stored_blocks": 0, "pool_store_failed": 0,
                         "pool_landed_blocks": 0, "pool_load_failed": 0, "pool_crc_bad": 0,
                         "pool_server_deaths": 0, "pool_server_restarts": 0,
                         "pool_inventory_blocks": 0, "pool_inventories": 0, "pool_demote_failed": 0,
                         "pool_load_ms_sum": 0.0, "pool_load_bytes": 0,
                         "pool_quota_refused_blocks": 0, "pool_remote_hint_blocks": 0,
                         "pool_remote_cut_blocks": 0, "pool_decode_hints": 0,
                         "pool_decode_hint_blocks": 0, "pool_store_copy_ns": 0}  # fmt: skip

    # -- the servers' state (the fault watch and the supervisor read these) -------------------

    @property
    def down(self) -> bool:
        """Every server out of restarts (or failed to restart): the pool is off."""
        return all(sv.down for sv in self.servers.values())

    @down.setter
    def down(self, value: bool) -> None:
        for sv in self.servers.values():
            sv.down = bool(value)

    @property
    def handle(self) -> PoolServerHandle | None:
        """Server 0's handle (one host: the server)."""
        return self.servers[min(self.servers)].handle

    def handle_of(self, s: int) -> PoolServerHandle | None:
        sv = self.servers.get(s)
        return sv.handle if sv is not None and not sv.down else None

    # -- lifecycle ---------------------------------------------------------------------------

    def master_spec(self, group: int = 0) -> dict:
        run_dir = self.e.run_dir
        return {"servers": {s: order_socket(run_dir, s) for s in self.servers},
                "home": self.home[group], "n_layers": self.n_layers,
                "row_floats": self.row_floats, "timeout_s": self.cfg.load_timeout_s,
                "store": self.cfg.store, "pod": self.e.pod_id,
                "load_by": self.cfg.load_by}  # fmt: skip

    def start(self) -> None:
        """Start the pool servers (after the dies made their KV pools: their offsets)."""
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
        for s, sv in self.servers.items():
            # several hosts: each server's SSD tier in its own directory (its host's disk)
            ssd = self.ssd_dir if not self.multi or not self.ssd_dir else \
                os.path.join(self.ssd_dir, f"host{s}")  # fmt: skip
            if ssd is not None and self.multi:
                os.makedirs(ssd, mode=0o700, exist_ok=True)
            sv.cfg = PoolServerConfig(
                pod=e.pod_id, server=s, fingerprint=self.fp, n_layers=self.n_layers,
                block_size=self.bs, row_floats=self.row_floats, n_slots=self.n_slots,
                orders=order_socket(e.run_dir, s), results=engine_socket(e.run_dir),
                dies=tuple(dies[g] for g in sv.dies), ssd_dir=ssd, ssd_blocks=self.ssd_blocks,
                pin_cpu=cpus[-1] if len(cpus) > 1 and e.config.pin != "off" else -1,
                peer=peer_address(e.config) if self.multi else None,
            )  # fmt: skip
            self._spawn(sv)

    def _spawn(self, sv: _Server) -> None:
        cleanup_pool_segment(self.e.pod_id, sv.sid)
        sv.epoch += 1  # orders queued for a predecessor are refused by this one
        sv.cfg = dataclasses.replace(sv.cfg, epoch=sv.epoch)
        sv.peer = None  # known again from its inventory
        sv.handle = start_pool_server(sv.cfg)
        if self.ctx is None:
            self.ctx = zmq.Context()
        if sv.sock is None:
            sv.sock = self.ctx.socket(zmq.PUSH)
            sv.sock.setsockopt(zmq.LINGER, 0)
            sv.sock.connect(sv.cfg.orders)

    def sentinels(self) -> list[int]:
        """The live servers' process sentinels (the supervisor wakes on their exits)."""
        return [sv.handle.sentinel for sv in self.servers.values() if sv.up()]

    def watch(self) -> bool:
        """Check the servers (caller holds the tracker lock); True if one died (handled)."""
        died = False
        for sv in self.servers.values():
            h = sv.handle
            if h is None or sv.down or h.is_alive():
                continue
            died = True
            s = sv.sid
            self.counters["pool_server_deaths"] += 1
            log.warning("kv pool: server %d (pid %s) exited (%s): its DRAM entries are lost,"
                        " loads fall back to recompute", s, h.pid, h.exitcode)  # fmt: skip
            cleanup_pool_segment(self.e.pod_id, s)
            self.index.server_dead(s)
            for sid in [k for k, st in self.stores.items() if st[3] == s]:
                self._store_failed(sid)
            for g in range(self.e.config.dies):
                self.e._send(g, "pool_dead", {"server": s})
            if sv.restarts >= self.cfg.restarts:
                sv.down = True
                log.warning("kv pool: server %d out of restarts (%d): its host's blocks are"
                            " not pooled any more", s, sv.restarts)  # fmt: skip
                continue
            sv.restarts += 1
            self.counters["pool_server_restarts"] += 1
            try:
                self._spawn(sv)
            except Exception as e:  # noqa: BLE001 - costs this host's hits, never requests
                sv.down = True
                log.error("kv pool: server %d's restart failed: %s: its host's blocks are not"
                          " pooled any more", s, e)  # fmt: skip
        return died

    def close(self) -> None:
        for sv in self.servers.values():
            if sv.handle is not None:
                with contextlib.suppress(Exception):
                    stop_pool_server(sv.handle)
                sv.handle = None
            with contextlib.suppress(Exception):
                cleanup_pool_segment(self.e.pod_id, sv.sid)
            if sv.sock is not None:
                sv.sock.close(linger=0)
                sv.sock = None
        if self.ctx is not None:
            self.ctx.term()
            self.ctx = None
        if self.own_dir and self.ssd_dir:
            shutil.rmtree(self.ssd_dir, ignore_errors=True)

    # -- read path (dispatch, under the tracker lock) -----------------------------------------

    def hint(self, tokens: list[int], ns: str | None = None, group: int = 0) -> dict | None:
        """The `pool` field of an `add` to `group` (module docstring), or None (no hit worth
        a load)."""
        if self.down:
            return None
        home = self.home[group] if 0 <= group < len(self.home) else 0
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
            if mine and b.server != home:  # another host's SSD block: not fetched (docstring)
                self.counters["pool_remote_cut_blocks"] += 1
                break
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
        self.counters["pool_remote_hint_blocks"] += sum(b[1] != home for b in blocks)
        used = sorted({b[1] for b in blocks} | {home})
        sv = self.servers[home]
        hint = {
            "lease": hit.lease,
            "ns": ns,
            "blocks": blocks,
            "epoch": sv.epoch,
            "pid": sv.handle.pid if sv.handle is not None else None,
        }  # the home server the slots are in (its incarnation)
        if self.multi:  # [server, epoch, peer endpoint] of every server the blocks are on
            hint["servers"] = [[s, self.servers[s].epoch, self.servers[s].peer] for s in used]
        if promote:
            # The demotions that made room for the promotions go with the hint: its master
            # sends them before its load, on the same socket (sent from here, they could reach
            # the server after the load's promotions overwrote their slots).
            hint["orders"] = self._frames(rest)
        else:
            self._send_orders(rest)
        return hint

    def decode_hint(self, tokens: list[int], ns: str | None, group: int) -> dict | None:
        """A PD decode die's own lease of the prompt's pooled prefix (`PoolConfig.decode_load`),
        after its prefill die's hint: the blocks its master can copy now (in DRAM on its host's
        server: no promotion, no fetch), a second lookup that changes no counter, recency or
        admission. None: nothing to load (the KV link carries the whole prompt)."""
        if self.down or not self.cfg.decode_load:
            return None
        home = self.home[group] if 0 <= group < len(self.home) else 0
        hit = self.index.lookup(tokens, ns, count=False, promote=False)
        blocks = []
        for b in hit.blocks:
            if b.server != home:
                break
            blocks.append([b.h, b.server, b.slot, b.crc, False])
        if len(blocks) < max(1, self.cfg.min_hit_blocks):
            self.index.release(hit.lease)
            return None
        sv = self.servers[home]
        self.counters["pool_decode_hints"] += 1
        self.counters["pool_decode_hint_blocks"] += len(blocks)
        return {"lease": hit.lease, "ns": ns, "blocks": blocks, "epoch": sv.epoch,
                "pid": sv.handle.pid if sv.handle is not None else None}  # fmt: skip

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
            _, _rid, lease, ok, _n, nbytes, ms, promoted = ev[:8]
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
        first one's parent its root, a chain), stored on the group's host's server (the one
        whose copy reaches the die); a block over ns's quota is skipped, and so are its
        descendants (orphans): counted as refused for the quota."""
        s = self.home[group] if 0 <= group < len(self.home) else 0
        sv = self.servers[s]
        if not sv.up() or self.cfg.store == "off":
            self.e._send(group, "pool_release", {"hold": hold})
            return
        states = self.index.put_start([(int(h), None if p is None else int(p), tuple(t))
                                       for h, p, t, _ in blocks], ns, server=s,
                                      strict=True)  # fmt: skip
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
        self.stores[sid] = (group, hold, [int(b[0]) for b, _ in granted], s)
        self.counters["pool_stores"] += 1
        self._send_orders(self.index.take_orders())  # demotions before the slots are reused
        body = {"id": sid, "die": group, "gen": self.e.gen, "epoch": sv.epoch,
                "seg": segment_inode(region_name(self.e.pod_id, group)),
                "die_blocks": [int(b[3]) for b, _ in granted],
                "slots": [st.slot for _, st in granted],
                "n_tokens": len(granted) * self.bs}  # fmt: skip
        sv.sock.send(pool_frame("store", body))

    # -- the servers' replies (the engine's receiver, under the tracker lock) -----------------

    def on_server(self, kind: str, body: dict) -> None:
        s = body.get("server", 0)
        sv = self.servers.get(s) if isinstance(s, int) else None
        if sv is None:
            log.warning("kv pool: a %s from an unknown server %r", kind, s)
            return
        if kind == "stored":
            st = self.stores.pop(body.get("id"), None)
            if st is None:
                return
            group, hold, hashes, _ = st
            if body.get("status") == 0 and len(body.get("crcs", ())) == len(hashes):
                for h, crc in zip(hashes, body["crcs"], strict=True):
                    self.index.put_end(h, int(crc))
                self.counters["pool_stored_blocks"] += len(hashes)
                self.counters["pool_store_copy_ns"] += int(body.get("ns") or 0)
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
            reoffer = self.index.is_down(s)  # a restart: offers made meanwhile were refused
            self.index.server_inventory(s, ents)
            self.counters["pool_inventory_blocks"] += len(ents)
            self.counters["pool_inventories"] += 1
            peer = body.get("peer")
            sv.peer = peer if isinstance(peer, str) else None
            # the masters map its DRAM tier now (not on a hit's critical path) and offer their
            # blocks again (those offered while it was down were refused, never stored); on
            # several hosts, the other hosts' masters learn where its peer socket is
            pid = body.get("pid")
            for g in range(self.e.config.dies):
                self.e._send(g, "pool_up", {"server": s, "pid": pid, "peer": sv.peer,
                                            "epoch": sv.epoch, "reoffer": reoffer})  # fmt: skip
        elif kind == "error":
            log.warning("kv pool: server %d refused an order: %s", s, body.get("error"))
        self._send_orders(self.index.take_orders())

    def _store_failed(self, sid: int) -> None:
        group, hold, hashes, _ = self.stores.pop(sid)
        for h in hashes:
            self.index.put_abort(h)
        self.counters["pool_store_failed"] += 1
        self.e._send(group, "pool_release", {"hold": hold})

    def _send_orders(self, orders: list[tuple]) -> None:
        for server, kind, body in self._frames(orders):
            sv = self.servers.get(server)
            if sv is not None and sv.sock is not None and not sv.down:
                sv.sock.send(pool_frame(kind, body))

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
        n = len(self.servers)
        return {**self.counters, **{f"index_{k}": v for k, v in self.index.stats().items()},
                "n_slots": self.n_slots * n, "ssd_blocks": self.ssd_blocks * n,
                "slot_bytes": self.slot_bytes, "servers": n, "up": not self.down}  # fmt: skip


def peer_address(cfg) -> str:
    """Where a server binds its peer socket (a free port): loopback for emulated hosts, the
    IPv4 address of `--net-if` for named ones (the launcher's ROUTER's rule)."""
    from runtime.pod.die_mpi import bind_address  # (no MPI import: the launcher's helper)

    return f"tcp://{bind_address(cfg)}:*"


__all__ = [
    "REPLIES",
    "PoolConfig",
    "PoolShell",
    "fingerprint",
    "hosts_of_groups",
    "peer_address",
    "segment_inode",
]
