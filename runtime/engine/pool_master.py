"""A master's side of the KV pool (`--kv-pool`, docs/serving.md "KV pool"): loads a request's
pooled prefix into its die's blocks before admitting it, and offers its new prompt blocks for
storing (000 §4.4's "reuse and store"; KVPOOL.md §4.5-4.6).

Read path. The shell's dispatch looked the prompt's block chain up in the pool index and leased
the hit (`pool` in the `add` body: `lease`, `ns`, and per block `[hash, server, slot, crc, promote]`
from the first block; `promote`: the block is on the SSD tier only, read into `slot` by the
same load order). `add`: if the die-local prefix cache already holds as much, the lease goes back
(`unpin`) and the request is queued as ever. Else the blocks past the local hit are allocated
under a holder key `("pool", id)` (which also holds the local prefix, so it cannot be evicted
before admission). `load_by` "master" (the default) and every block in DRAM: this master maps
the server's DRAM tier (once per server incarnation: the hint's `pid` is the segment's creator)
and copies the leased slots into its die's blocks itself, then lands them at once: no message
and no other process on the critical path (the lease keeps the slots from being reused; a
stopped server costs nothing). Else (`load_by` "server", or a block to promote from the SSD
tier) a `load` order goes to the pool server holding the slots (its copy runs in the server
process), and the request waits (WaitingForPool). The server scatters the slots into the die's
blocks, *then* sends `loaded` here (data before its completion). `land`: the crc32 of each
landed block (its layer spans, layer-major, in the die's region) is compared with the crc the
block was stored with; the blocks up to the first mismatch are registered in the die-local
prefix cache (`KVManager.cache_blocks`: hashed, then freed most recently, so evicted last;
rooted at the request's namespace, `ns_root(req.ns)`, as every hash of it), the request is
queued (its admission's prefix match finds them), and the lease goes back. Every order names
the server's epoch and this die's segment (its inode): the server refuses one meant for a
predecessor or for a die restarted since, so a late order never writes into the wrong blocks.
A load not complete within `timeout_s` (or whose server the shell reports dead) falls back:
the request is queued without it (its prefix recomputed) and the blocks stay quarantined until
the late completion arrives or the server is gone (a stopped server may still write them).

Several hosts (`--hosts`: one pool server per host). A master maps only its own host's DRAM
tier (`home`); a hit's blocks held by another host's server are fetched over TCP from that
server's peer socket (`runtime.engine.pool_peer`: `fetch` on a DEALER, the reply carries the
bytes) and written into the die's blocks here, home blocks copied directly as above; the load
lands when every fetch answered. Nothing writes the die's blocks but this master, so a fetch
that fails or times out frees them at once (no quarantine).

Write path. After every result, `offer` looks at each running request's newly registered
prompt blocks (hashes it has not offered or loaded lately), holds them under `("put", id, k)`
(hashed blocks are never rewritten, so the copy reads stable bytes) and reports them to the
shell (`put` events in the master's `out`, with the request's ns: the first block's parent is
`ns_root(ns)`, so the hashes are the pool index's keys in that ns): the shell deduplicates
them against the pool and orders the copies; `pool_release` frees the hold when they are done
(or not needed).
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import time
from collections import OrderedDict

import numpy as np
import zmq

from memory import layout as L
from memory import pool_layout as P
from memory.errors import ProtocolError, ShmError
from runtime.engine.pool_fetch import Fetches, Load
from runtime.engine.pool_server import pack as pool_frame
from runtime.engine.pool_shell import segment_inode
from runtime.engine.wire import master_socket
from sched import Request
from sched.kv import KVFull
from sched.pool import chain as pool_chain
from sched.pool import ns_root
from sched.request import FinishReason

log = logging.getLogger(__name__)
KNOWN = 8192  # hashes offered or loaded lately (not offered again)


def _unrun(blocks: list[list]) -> list[list[int]]:
    """[[h, slot]...] of the hint's blocks this master was to promote (`promote` set)."""
    return [[int(b[0]), int(b[2])] for b in blocks if len(b) > 4 and b[4]]


class PoolSide(Fetches):
    """One master's pool client (module docstring). `pool`: the MasterSpec's `pool` dict:
    `servers` {id: order address}, `n_layers`, `row_floats`, `timeout_s`, `store`."""

    def __init__(self, master, pool: dict):
        self.m = master
        self.n_layers, self.row_bytes = int(pool["n_layers"]), int(pool["row_floats"]) * 4
        self.timeout_s = float(pool.get("timeout_s", 1.0))
        pd = master.spec.pd
        mode = pool.get("store", "prompt")
        self.store_all = mode == "all"  # the generated tokens' blocks too, at a request's end
        # a PD decode die's prompt KV came from its prefill die, which stored it already
        decode = pd is not None and pd.get("role") == "decode"
        self.store = mode != "off" and (self.store_all or not decode)
        self.to_server: dict[int, zmq.Socket] = {}
        for s, addr in pool["servers"].items():
            sock = master.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(addr)
            self.to_server[int(s)] = sock
        self.reply_to = master_socket(master.spec.run_dir, master.spec.group)
        self.home = int(pool.get("home", 0))  # this die's host's server
        self.peers: dict[int, tuple[str, zmq.Socket]] = {}  # server -> (endpoint, DEALER)
        self.poller: zmq.Poller | None = None  # the master's (set by its loop)
        self.pod = pool.get("pod")  # the servers' DRAM tiers are /xpod.<pod>.pool<s>
        self.load_by = pool.get("load_by", "master") if self.pod else "server"
        self.prefaulted = False
        self.segs: dict[int, P.PoolSegment] = {}  # server -> its DRAM tier, mapped (load_by)
        self.seg = segment_inode(master.region.name)  # this incarnation's die segment
        self.loads: dict[int, Load] = {}
        self.quarantine: dict[int, tuple[object, int]] = {}  # request -> (holder, server)
        self.offered: dict[int, int] = {}  # request -> prompt blocks offered (or skipped)
        self.holds: dict[int, object] = {}  # put hold id -> holder key
        self.next_hold = 0
        self.known: OrderedDict[int, None] = OrderedDict()
        self.died: set[int] = set()  # servers seen dead and not up again (re-offer when they are)
        self.events: list[list] = []
        self.counters = {"pool_query_tokens": 0, "pool_hit_tokens": 0, "pool_loads": 0,
                         "pool_load_fallbacks": 0, "pool_crc_mismatches": 0,
                         "pool_load_bytes": 0, "pool_load_ns": 0, "pool_local_covered": 0,
                         "pool_put_blocks": 0, "pool_quarantined_blocks": 0,
                         "pool_kv_full": 0, "pool_direct_loads": 0, "pool_fetches": 0,
                         "pool_fetch_bytes": 0, "pool_fetch_failed": 0,
                         "pool_remote_loads": 0, "pool_remote_hit_tokens": 0,
                         "pool_decode_loads": 0, "pool_decode_tokens": 0,
                         "pool_decode_bytes": 0, "pool_decode_ns": 0}  # fmt: skip

    # -- read path -------------------------------------------------------------------------

    def add(self, req: Request, hint: dict) -> bool:
        """A request with a pool hint: True if it waits for a load (queued later by `land` or
        the fallback), False if the caller queues it now (the local cache covers the hit, or
        there is no room to load into)."""
        m, kv, bs = self.m, self.m.kv, self.m.spec.block_size
        rid, lease = req.request_id, int(hint.get("lease", 0))
        for s, kind, body in hint.get("orders") or ():  # room made for the hit's promotions:
            if int(s) in self.to_server:  # first, on the socket of the load (in order)
                self.to_server[int(s)].send(pool_frame(kind, body))
        blocks = [list(b) for b in hint.get("blocks", ())]
        local, _ = kv.match_by_prefix(req.prompt, ns_root(req.ns))
        hit = min(len(blocks), (len(req.prompt) - 1) // bs)
        self.counters["pool_query_tokens"] += max(0, len(req.prompt) - len(local) * bs)
        if len(local) >= hit or not blocks or hint.get("ns") != req.ns:  # (another ns: a bug)
            self.counters["pool_local_covered"] += 1
            self._unpin(lease, unrun=_unrun(blocks))
            return False
        todo = blocks[len(local) : hit]
        server = int(todo[0][1])
        remote = any(int(b[1]) != self.home for b in todo)
        if remote:  # fetched over TCP: a block to promote (a home one) ends the load there
            cut = next((i for i, b in enumerate(todo) if len(b) > 4 and b[4]), len(todo))
            todo, hit, server = todo[:cut], len(local) + cut, self.home
        pool_off = m.words[m.region.layout.serve_word(L.SV_KV_POOL)]
        if not todo or (not remote and any(int(b[1]) != server for b in todo)) or \
                server not in self.to_server or not pool_off:  # fmt: skip
            self._unpin(lease, unrun=_unrun(blocks))
            return False
        try:
            table = kv.alloc_blocks(("pool", rid), hit * bs, local)
        except KVFull:
            self.counters["pool_kv_full"] += 1
            self._unpin(lease, unrun=_unrun(blocks))
            return False
        skipped = _unrun(blocks[: len(local)] + blocks[hit:])  # promotions no load carries
        if skipped:
            self._unpin(0, unrun=skipped)
        nb, stride = m.spec.num_blocks, bs * self.row_bytes
        new = table[len(local) :]
        offs = [pool_off + (layer * nb + b) * stride
                for layer in range(self.n_layers) for b in new]  # fmt: skip
        ld = Load(req, lease, server, todo, len(local), offs)
        if remote:
            return self._fetch(ld, hint)
        if self.load_by == "master" and not any(len(b) > 4 and b[4] for b in todo):
            self.counters["pool_loads"] += 1
            nbytes = self._direct(ld, hint.get("pid"))
            if nbytes is None:  # not the hint's server's tier (it restarted since): recompute
                self.counters["pool_load_fallbacks"] += 1
                kv.free(("pool", rid))
                self.events.append(["failed", rid, lease, "its server restarted"])
                return False
            self.counters["pool_direct_loads"] += 1
            self._land(ld, True, nbytes, [])
            return True
        self.loads[rid] = ld
        self.to_server[server].send(pool_frame("load", {
            "id": rid, "die": m.spec.group, "gen": m.spec.gen, "seg": self.seg,
            "epoch": hint.get("epoch"),
            "slots": [int(b[2]) for b in todo], "dst_offs": offs, "n_tokens": len(todo) * bs,
            "reply_to": self.reply_to, "crcs": False,
            "promote": [[int(b[0]), int(b[2]), hint.get("ns")]
                        for b in todo if len(b) > 4 and b[4]]}))  # fmt: skip
        self.counters["pool_loads"] += 1
        return True

    def _direct(self, ld: Load, pid: int | None, idx: list[int] | None = None) -> int | None:
        """Copy the load's slots (its blocks `idx`, default all) from its server's DRAM tier
        into the die's blocks here (the leased slots cannot change under the lease): bytes
        copied, or None when the tier mapped is not that of the server the hint came from
        (`pid`)."""
        seg = self._segment(ld.server, pid)
        if seg is None:
            return None
        idx = list(range(len(ld.blocks))) if idx is None else idx
        slots = [int(ld.blocks[i][2]) for i in idx]
        if any(not 0 <= s < seg.n_slots for s in slots):
            raise ProtocolError(f"pool hint: slots {slots} outside server {ld.server}'s"
                                f" {seg.n_slots}")  # fmt: skip
        # (src, dst, bytes) per (layer, block), layer-major as `ld.offs`: a slot's layer spans
        # sit at `P.HEADER_BYTES + (layer * n_slots + slot) * stride` of the tier
        stride = self.m.spec.block_size * self.row_bytes
        src = np.arange(self.n_layers, dtype=np.int64)[:, None] * seg.n_slots
        src = P.HEADER_BYTES + (src + np.asarray(slots, np.int64)[None, :]) * stride
        return self._scatter(seg.array, src.ravel(), ld, idx)

    def _segment(self, server: int, pid: int | None) -> P.PoolSegment | None:
        """Server `server`'s DRAM tier, mapped once per incarnation (its creator's pid)."""
        seg = self.segs.get(server)
        if seg is not None and seg.creator_pid == pid:
            return seg
        if seg is not None:
            seg.close()
            del self.segs[server]
        try:
            seg = P.attach_pool(self.pod, server)
        except (ShmError, ProtocolError) as e:
            log.warning("master %d: pool server %d's DRAM tier: %s", self.m.spec.group, server, e)
            return None
        if seg.creator_pid != pid:
            seg.close()
            return None
        with contextlib.suppress(OSError, ValueError, AttributeError):  # page tables now
            seg._mmap.madvise(getattr(mmap, "MADV_POPULATE_READ", 22))
        self.segs[server] = seg
        return seg

    def on_loaded(self, body: dict) -> None:
        """A server's `loaded` (its data already in the die's blocks)."""
        rid = body.get("id")
        held = self.quarantine.pop(rid, None)
        if held is not None:  # a late completion of a fallen-back load: the blocks are free
            self.m.kv.free(held[0])
            return
        ld = self.loads.pop(rid, None)
        if ld is None:
            log.warning("master %d: a pool completion for request %r with no load waiting",
                        self.m.spec.group, rid)  # fmt: skip
            return
        if ld.aborted:
            self.m.kv.free(("pool", rid))
            self._unpin(ld.lease, promoted=body.get("promoted") or [])
            return
        self._land(ld, body.get("status") == 0, int(body.get("bytes", 0)),
                   body.get("promoted") or [])  # fmt: skip

    def _land(self, ld: Load, ok_status: bool, nbytes: int, promoted: list) -> None:
        """The load's data is in the die's blocks: check each block's crc, register the good
        ones in the die-local prefix cache, queue the request, report `landed`."""
        rid = ld.req.request_id
        bs = self.m.spec.block_size
        ok = self._check(ld) if ok_status else 0
        req, kv = ld.req, self.m.kv
        if ok:
            kv.cache_blocks(("pool", rid), req.prompt, (ld.local + ok) * bs, ns_root(req.ns))
            for b in ld.blocks[:ok]:
                self._know(int(b[0]))
        # No hold until admission: the landed blocks join the cache (hashed, freed most
        # recently: evicted last) and the request's admission matches them; holding them for
        # every queued request could leave no room to admit any (a small KV pool stalled).
        kv.free(("pool", rid))
        dt = time.monotonic() - ld.since
        if self.m.spec.trace:  # the master's "kv pool" track
            self.m.spans.append([ld.t_ns, time.perf_counter_ns() - ld.t_ns, "kv pool load", ok])
        self.counters["pool_hit_tokens"] += ok * bs
        if ld.pending is not None:  # over hosts: fetched (in part) from another host's server
            self.counters["pool_remote_hit_tokens"] += ok * bs
        self.counters["pool_load_bytes"] += nbytes
        self.counters["pool_load_ns"] += int(dt * 1e9)
        self.events.append(["landed", rid, ld.lease, ok, len(ld.blocks), nbytes,
                            round(dt * 1e3, 4), promoted])  # fmt: skip
        self.m.sched.add(req)

    def _check(self, ld: Load) -> int:
        """How many of the load's blocks landed with the crc they were stored with (the first
        that did not ends the count, reported `bad`): `block_crc` of each landed block, its
        layer spans in layer order."""
        mv, n = memoryview(self.m.region.array), len(ld.blocks)
        stride = self.m.spec.block_size * self.row_bytes
        for i, b in enumerate(ld.blocks):
            crc = 0
            for layer in range(self.n_layers):
                off = ld.offs[layer * n + i]
                crc = P.pool_crc(mv[off : off + stride], crc)
            if crc != int(b[3]):
                self.counters["pool_crc_mismatches"] += 1
                self.events.append(["bad", int(b[0])])
                return i
        return n

    def copyable(self, hint: dict, n: int) -> int:
        """How many of the hint's first n blocks `copy_hit` can copy: on this host's server,
        in DRAM (no promotion), its tier mapped (the hint's incarnation)."""
        m, k = self.m, 0
        if not self.pod or not m.words[m.region.layout.serve_word(L.SV_KV_POOL)]:
            return 0
        for b in list(hint.get("blocks", ()))[:n]:
            if int(b[1]) != self.home or (len(b) > 4 and b[4]):
                break
            k += 1
        return k if k and self._segment(self.home, hint.get("pid")) is not None else 0

    def copy_hit(self, hint: dict, table: list[int], start: int, n: int) -> int:
        """A PD decode die's load (the shell's `decode_hint`): the hint's blocks [start, n)
        copied now, by this master, from its host's mapped DRAM tier into the blocks
        `table[start:n]` (the caller's allocation), each crc checked; how many landed good
        (from `start`, up to the first bad one). The lease goes back whatever happens."""
        lease, m = int(hint.get("lease", 0)), self.m
        blocks = [list(b) for b in hint.get("blocks", ())][start:n]
        good = 0
        pool_off = m.words[m.region.layout.serve_word(L.SV_KV_POOL)]
        home = all(int(b[1]) == self.home and not (len(b) > 4 and b[4]) for b in blocks)
        if blocks and pool_off and self.pod and home:
            nb, stride = m.spec.num_blocks, m.spec.block_size * self.row_bytes
            offs = [pool_off + (layer * nb + b) * stride
                    for layer in range(self.n_layers) for b in table[start:n]]  # fmt: skip
            t0 = time.perf_counter_ns()
            ld = Load(None, lease, self.home, blocks, start, offs)  # type: ignore[arg-type]
            nbytes = self._direct(ld, hint.get("pid"))
            if nbytes is not None:
                good = self._check(ld)
                self.counters["pool_decode_loads"] += 1
                self.counters["pool_decode_tokens"] += good * m.spec.block_size
                self.counters["pool_decode_bytes"] += nbytes
                self.counters["pool_decode_ns"] += time.perf_counter_ns() - t0
        self._unpin(lease)
        return good

    def _fallback(self, ld: Load, why: str) -> None:
        """Queue the request without its load; its blocks quarantined (the server may still
        write them) until the completion comes or the server is gone."""
        rid = ld.req.request_id
        self.loads.pop(rid, None)
        if ld.pending is not None:  # fetched: only this master writes its blocks
            self.m.kv.free(("pool", rid))
        else:
            self.quarantine[rid] = (("pool", rid), ld.server)
        self.counters["pool_load_fallbacks"] += 1
        self.counters["pool_quarantined_blocks"] += len(ld.blocks)
        self.events.append(["failed", rid, ld.lease, why])
        if not ld.aborted:
            self.m.sched.add(ld.req)
        log.warning("master %d: the pool load of request %d %s: recomputed", self.m.spec.group,
                    rid, why)  # fmt: skip

    def abort(self, rid: int) -> bool:
        """True if `rid` waited for a load (it ends here; its load's completion frees it)."""
        ld = self.loads.get(rid)
        if ld is None or ld.aborted:
            return False
        ld.aborted = True
        ld.req.finish_reason = FinishReason.ABORT
        self.m.finish(ld.req)
        return True

    def abort_all(self) -> None:
        for rid in list(self.loads):
            self.abort(rid)

    def on_message(self, kind: str, body: dict) -> None:
        """The shell's and the servers' messages to this master."""
        if kind == "loaded":
            self.on_loaded(body)
        elif kind == "pool_release":
            self.on_release(body)
        elif kind == "pool_dead":
            self.server_dead(body.get("server"))
        elif kind == "pool_up":
            self.server_up(body.get("server"), body.get("pid"), body.get("peer"),
                           bool(body.get("reoffer")))  # fmt: skip

    def server_up(
        self, server: int, pid: int | None, peer: str | None = None, reoffer: bool = False
    ) -> None:
        """Server `server` (re)started and re-indexed: its DRAM tier mapped now (off a hit's
        critical path), and after a restart every block offered again (those offered while it
        was down were refused: a later prompt's blocks would otherwise never reach the pool).
        Its first start refused nothing (the orders waited on its socket): no re-offer. The
        shell says which (`reoffer`: the index had it down); this master knows it too when it
        saw the server's `pool_dead`."""
        if reoffer or server in self.died:
            self.died.discard(server)
            self.known.clear()
            self.offered.clear()
        if isinstance(server, int) and server != self.home:  # another host's: its peer socket
            self._peer(server, peer)  # connected now, off a hit's critical path
            return
        if self.load_by == "master" and isinstance(server, int) and isinstance(pid, int):
            self._segment(server, pid)
            # this process's page tables of its die's KV pool, filled once: else the first
            # loads into each page pay a fault per 4 KiB on their critical path
            m = self.m
            pool_off = m.words[m.region.layout.serve_word(L.SV_KV_POOL)]
            if pool_off and not self.prefaulted:
                n = self.n_layers * m.spec.num_blocks * m.spec.block_size * self.row_bytes
                self.prefaulted = m.region.prefault(int(pool_off), n, write=True)

    def server_dead(self, server: int) -> None:
        """The shell saw pool server `server` exit: its loads fall back, their blocks free; the
        blocks offered lately are offered again (its DRAM entries are gone: a later block whose
        parent is not re-offered would be an orphan, never stored)."""
        self.known.clear()
        self.died.add(server)
        seg = self.segs.pop(server, None)
        if seg is not None:
            seg.close()
        self._drop_peer(server)
        for ld in [
            x
            for x in self.loads.values()
            if (x.server == server and x.pending is None) or server in (x.pending or ())
        ]:
            self._fallback(ld, f"lost its server {server}")
        for rid, (holder, s) in list(self.quarantine.items()):
            if s == server:
                del self.quarantine[rid]
                self.m.kv.free(holder)

    # -- write path ------------------------------------------------------------------------

    def offer(self) -> None:
        """New full prompt blocks of running requests, held and reported for storing."""
        if self.store:
            for req in self.m.sched.running:
                self._offer(req, self.m.kv.chain(req.request_id))

    def _offer(self, req: Request, chain: list[int], tokens: list[int] | None = None) -> None:
        """Hold and report req's blocks of `chain` (the hashes of `tokens`, its prompt by
        default, rooted at its ns: the pool index's keys for that ns) not offered yet."""
        rid, root = req.request_id, ns_root(req.ns)
        prompt = req.prompt if tokens is None else tokens
        kv, bs = self.m.kv, self.m.spec.block_size
        n = min(len(chain), len(prompt) // bs)
        start = self.offered.get(rid, 0)
        if n <= start:
            return
        self.offered[rid] = n
        new = [i for i in range(start, n) if chain[i] not in self.known]
        if not new:
            return
        # The die-local cache's blocks of the chain, not the request's table: a block it
        # computed while another request registered the same hash is not hashed (it cannot
        # be held shared, and the cache serves the other one). One token more:
        # match_by_prefix leaves out the block of the last token.
        table, _ = kv.match_by_prefix([*prompt[: (new[-1] + 1) * bs], 0], root)
        new = [i for i in new if i < len(table)]
        if not new:
            return
        hold = self.next_hold
        self.next_hold += 1
        key = ("put", rid, hold)
        try:
            kv.alloc_blocks(key, (new[-1] + 1) * bs, table[: new[-1] + 1])
        except (KVFull, ValueError):
            return
        self.holds[hold] = key
        out = []
        for i in new:
            self._know(chain[i])
            out.append([chain[i], chain[i - 1] if i else root,
                        prompt[i * bs : (i + 1) * bs], table[i]])  # fmt: skip
        self.counters["pool_put_blocks"] += len(out)
        self.events.append(["put", hold, out, req.ns])

    def on_release(self, body: dict) -> None:
        key = self.holds.pop(body.get("hold"), None)
        if key is not None:
            self.m.kv.free(key)

    def finished(self, req: Request) -> None:
        """A request ends: its prompt blocks not offered yet are (one that ends at its first
        token, e.g. a PD prefill, was never seen running after its prefill's result), from
        the die-local cache where they still are."""
        rid = req.request_id
        if self.store and req.finish_reason in (FinishReason.STOP, FinishReason.LENGTH):
            # `all`: every token whose KV the die computed (the last sampled one has none)
            tokens = req.all_tokens[: req.num_computed] if self.store_all else req.prompt
            chain = [h for h, _, _ in pool_chain(tokens, self.m.spec.block_size, req.ns)]
            self._offer(req, chain, tokens)
        self.offered.pop(rid, None)

    def _know(self, h: int) -> None:
        self.known[h] = None
        self.known.move_to_end(h)
        if len(self.known) > KNOWN:
            self.known.popitem(last=False)

    # -- the loop ----------------------------------------------------------------------------

    def busy(self) -> bool:
        return bool(self.loads or self.events or self.quarantine)

    def tick(self, now: float) -> None:
        for ld in [x for x in self.loads.values() if now - x.since > self.timeout_s]:
            self._fallback(ld, f"timed out after {self.timeout_s:g} s")

    def _unpin(self, lease: int, promoted: list = (), unrun: list = ()) -> None:
        """The lease back to the shell, with the promotions its hint ordered: `promoted` [[h, ok,
        crc]...] as a server ran them, `unrun` [[h, slot]...] that no load carried (their slots
        free again; the blocks stay on the SSD tier)."""
        if lease or promoted or unrun:
            self.events.append(["unpin", lease, list(promoted), list(unrun)])

    def take_events(self) -> list:
        ev, self.events = self.events, []
        return ev

    def stats(self) -> dict:
        return {**self.counters, "pool_waiting": len(self.loads),
                "pool_quarantined": len(self.quarantine),
                "pool_holds": len(self.holds)}  # fmt: skip

    def close(self) -> None:
        for seg in self.segs.values():
            seg.close()
        self.segs.clear()
        for s in self.to_server.values():
            s.close(linger=0)
        for s in list(self.peers):
            self._drop_peer(s)


__all__ = ["PoolSide"]
