"""The masters' sides of prefill-decode disaggregation (`runtime.engine.pd` has the picture).

`PrefillSide` (a prefill die's master): a PD request is prefilled with max_tokens 1; at its
finish its blocks move to a lease (`Scheduler.lease`) instead of the free list; once its first
token and its decode die's scatter list (`kv_dst`) are both known, an `xfer` order goes to the
die's KV thread. `kv_done` from the decode master frees the lease; a lease that is not freed
within `lease_s` frees itself (vLLM NIXL's `kv_lease_duration`: a decode side that never reads
must not pin the prefill pool). Every scatter list it gets is answered by exactly one record
(a failed one if the request is gone), so a decode die never waits for KV that is not coming.

`DecodeSide` (a decode die's master): the connector state of every PD request (SGLang's names):
Bootstrapping (waiting for room: the decode side defers = backpressure) -> WaitingForInput
(blocks allocated, the scatter list sent) -> Transferring (the prefill die's `started` word
names it) -> Success (crc checked, the request joins the batch) | Failed. A request late past
`timeout_s` makes it probe the link: an echo says "slow" (the prefill side or this decode side
is busy: keep waiting), none within `timeout_s` says "dead": the link's requests fail (their
blocks quarantined: a stopped prefill die may still write into them) and, under the
`recompute` policy, the shell sends them again.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import zmq

from comm.kvlink import OK, KVGeometry, KVLinkRx, checksum, scatter_spans
from memory import layout as L
from memory import pool_layout as P
from memory.region import Region, RegionHandle, region_name
from runtime.engine import wire
from runtime.engine.wire import kv_socket, master_socket
from sched import Request, SamplingParams
from sched.kv import KVFull
from sched.request import FinishReason

log = logging.getLogger(__name__)
TICK_S = 0.05  # a master with PD requests in flight wakes at least this often


class PrefillSide:
    def __init__(self, master, pd: dict):
        self.m, self.pd = master, pd
        self.lease_s = float(pd["lease_s"])
        self.peer: dict[int, int] = {}  # request -> its decode die
        self.dst: dict[int, dict] = {}  # request -> its kv_dst (scatter list)
        self.ready: dict[int, dict] = {}  # request -> first token, source blocks, tokens
        self.drafted: dict[int, list[int]] = {}  # MTP: request -> drafts made with its first
        self.leased: dict[int, float] = {}  # request -> when its lease began
        self.gone: set[int] = set()  # finished without KV to send (abort, error)
        # for the shell: [id, "prefilled", t_sched, t_done], [id, "ordered", t] (the KV order
        # went to the die's KV thread: its prefill done and its decode die's scatter list in)
        self.events: list[list] = []
        self.kv_out = master.ctx.socket(zmq.PUSH)
        self.kv_out.setsockopt(zmq.LINGER, 0)
        self.kv_out.connect(kv_socket(master.spec.run_dir, master.spec.group))
        self.counters = {"pd_prefilled": 0, "pd_orders": 0, "pd_failed_orders": 0,
                         "pd_leases_freed": 0, "pd_leases_expired": 0, "pd_skipped_blocks": 0,
                         "pd_skip_refused": 0}  # fmt: skip

    def add(self, rid: int, peer: int) -> None:
        self.peer[rid] = peer
        self.m.sched.lease[rid] = ("lease", rid)

    def busy(self) -> bool:
        return bool(self.leased or self.events)

    def finished(self, req: Request) -> bool:
        """The master's finish hook: True for a PD request (no finish record: its decode
        master ends it for the shell)."""
        rid = req.request_id
        if rid not in self.peer:
            return False
        key = ("lease", rid)
        now = time.monotonic()
        if req.finish_reason in (FinishReason.STOP, FinishReason.LENGTH) and req.output:
            self.ready[rid] = {"first": req.output[0], "n_tokens": len(req.prompt),
                               "src_blocks": self.m.kv.block_table(key),
                               "drafts": self.drafted.pop(rid, [])}  # fmt: skip
            self.leased[rid] = now
            self.counters["pd_prefilled"] += 1
            self.events.append([rid, "prefilled", self.m.sched_at.get(rid, now), now])
            self._send(rid)
        else:
            self.gone.add(rid)
            self.peer.pop(rid, None)
            self.drafted.pop(rid, None)
            if rid in self.dst:
                self._send_failed(self.dst.pop(rid))
        return True

    def on_drafted(self, drafted: list) -> None:
        """A speculative result's drafts (`[id, drafts]`): those of a PD request's final
        prefill row go to its decode die with its first token (the record's draft words)."""
        for rid, drafts in drafted:
            if rid in self.peer:
                self.drafted[rid] = list(drafts)

    def on_dst(self, body: dict) -> None:
        """A decode die's scatter list. It may come before the shell's `add` (two senders):
        kept until the request is prefilled; for a request that is gone here, a failed record
        at once (the decode side frees its blocks)."""
        rid = body.get("id")
        if rid in self.gone:
            self.gone.discard(rid)
            self._send_failed(body)
            return
        self.dst[rid] = body
        self._send(rid)

    def refused(self, rid) -> None:
        """A PD request the master refused (a bad `add`): its scatter list gets a failed
        record, now or when it comes."""
        if rid in self.dst:
            self._send_failed(self.dst.pop(rid))
        elif isinstance(rid, int):
            self.gone.add(rid)

    def on_done(self, body: dict) -> None:
        rid = body.get("id")
        if self.leased.pop(rid, None) is not None:
            self.m.kv.free(("lease", rid))
            self.counters["pd_leases_freed"] += 1
        self.peer.pop(rid, None)
        self.ready.pop(rid, None)
        self.dst.pop(rid, None)

    def on_cancel(self, body: dict) -> None:
        """The decode side dropped the request (abort, failure) before or after its dst."""
        rid = body.get("id")
        req = self.m.sched.abort(rid) if rid in self.peer else None
        if req is not None:
            self.m.finish(req)
        self.dst.pop(rid, None)
        self.gone.discard(rid)
        if rid not in self.ready:  # not prefilled: nothing is leased
            return
        self.ready.pop(rid)
        self.on_done(body)

    def tick(self, now: float) -> None:
        for rid, t in list(self.leased.items()):
            if now - t > self.lease_s:
                del self.leased[rid]
                self.m.kv.free(("lease", rid))
                self.counters["pd_leases_expired"] += 1
                log.warning("master %d: the KV lease of request %d expired (%.1f s): freed",
                            self.m.spec.group, rid, self.lease_s)  # fmt: skip
                if rid in self.ready and rid not in self.dst:
                    self.ready.pop(rid)  # a dst that comes now gets a failed record
                    self.gone.add(rid)
                    self.peer.pop(rid, None)

    def _send(self, rid: int) -> None:
        if rid not in self.ready or rid not in self.dst:
            return
        r, d = self.ready[rid], self.dst.pop(rid)
        self.events.append([rid, "ordered", time.monotonic()])
        start = self._start(r, d)
        bs, n_layers, offs = self.m.spec.block_size, int(self.pd["n_layers"]), d["offs"]
        nb = -(-r["n_tokens"] // bs)
        if start and isinstance(offs, list) and len(offs) == n_layers * nb:
            offs = [offs[layer * nb + b] for layer in range(n_layers) for b in range(start, nb)]
        else:
            start = 0
        self.kv_out.send(wire.pack("xfer", {
            "id": rid, "dst": d["die"], "dst_offs": offs, "n_tokens": r["n_tokens"] - start * bs,
            "src_blocks": r["src_blocks"][start:], "first": r["first"], "drafts": r["drafts"],
            "ok": True}))  # fmt: skip
        self.counters["pd_orders"] += 1
        self.counters["pd_skipped_blocks"] += start

    def _start(self, r: dict, d: dict) -> int:
        """The block to send from: the decode die's `skip` when this die's blocks have the
        crcs it sent for them (the same bytes: it loaded the same pool blocks, or this die
        computed and stored them), else 0 (the whole prompt, as without `skip`)."""
        skip, crcs, bs = d.get("skip", 0), d.get("crcs"), self.m.spec.block_size
        src = r["src_blocks"]
        if not (isinstance(skip, int) and skip > 0 and skip * bs < r["n_tokens"]
                and isinstance(crcs, list) and len(crcs) == skip and len(src) >= skip):  # fmt: skip
            return 0
        m = self.m
        pool_off = m.words[m.region.layout.serve_word(L.SV_KV_POOL)]
        geo = KVGeometry(int(pool_off), int(self.pd["n_layers"]), m.spec.num_blocks, bs,
                         int(self.pd["row_floats"]))  # fmt: skip
        for b, crc in zip(src[:skip], crcs, strict=True):
            if P.block_crc(m.region.array, geo, b) != crc:
                self.counters["pd_skip_refused"] += 1
                return 0
        return skip

    def _send_failed(self, d: dict) -> None:
        self.kv_out.send(wire.pack("xfer", {"id": d["id"], "dst": d["die"], "ok": False}))
        self.counters["pd_failed_orders"] += 1

    def stats(self) -> dict:
        return {**self.counters, "pd_leased": len(self.leased)}

    def take_events(self) -> list:
        ev, self.events = self.events, []
        return ev

    def close(self) -> None:
        self.kv_out.close(linger=0)


@dataclass(eq=False)
class _PDReq:
    rid: int
    src: int  # its prefill die
    prompt: list[int]
    params: SamplingParams
    base: int
    stream: bool
    state: str = "Bootstrapping"
    deferred: bool = False  # it waited for room at least once (backpressure)
    since: float = field(default_factory=time.monotonic)
    offs: list[int] = field(default_factory=list)
    aborted: bool = False
    ns: str | None = None  # its cache salt (the decode die's cache registers its blocks so)
    hint: dict | None = None  # its own lease of the pooled prefix (`decode_load`)
    skip: int = 0  # leading prompt blocks the decode die copies from the pool itself
    short: bool = False  # its pool copy did not check (fewer good blocks than `skip`)


class DecodeSide:
    def __init__(self, master, pd: dict):
        self.m, self.pd = master, pd
        spec, cfg_layout = master.spec, master.region.layout
        self.g = spec.group
        self.timeout_s = float(pd["timeout_s"])
        self.n_layers, self.row_bytes = int(pd["n_layers"]), int(pd["row_floats"]) * 4
        self.prefill = list(pd["prefill"])
        self.regions = {p: Region.attach(RegionHandle(region_name(spec.pod_id, p), p), cfg_layout)
                        for p in self.prefill}  # fmt: skip
        self.rx = KVLinkRx(self.g, cfg_layout, master.words,
                           {p: r.words for p, r in self.regions.items()})  # fmt: skip
        self.to_master, self.to_kv = {}, {}
        for p in self.prefill:
            for socks, addr in ((self.to_master, master_socket(spec.run_dir, p)),
                                (self.to_kv, kv_socket(spec.run_dir, p))):  # fmt: skip
                s = master.ctx.socket(zmq.PUSH)
                s.setsockopt(zmq.LINGER, 0)
                s.connect(addr)
                socks[p] = s
        self.reqs: OrderedDict[int, _PDReq] = OrderedDict()
        self.first: dict[int, int] = {}  # request -> its first token, sent with the next ones
        self.quarantine: dict[int, list[int]] = {}  # request -> blocks a dead link may write
        self.links = dict.fromkeys(self.prefill, "ok")
        self.probing: dict[int, tuple[int, float]] = {}  # prefill die -> (seq, sent at)
        self.events: list[list] = []  # [id, "landed", t, bytes, ns] for the shell
        self.link_bytes = dict.fromkeys(self.prefill, 0)
        self.link_ns = dict.fromkeys(self.prefill, 0)
        self.link_n = dict.fromkeys(self.prefill, 0)
        self.link_crc_ns = dict.fromkeys(self.prefill, 0)  # both sides' crc32 (not the copy)
        self.verify = bool(pd.get("checksum", True))
        if self.verify:  # the check reads what lands in the die's app area
            master.region.prefault(cfg_layout.app_off, cfg_layout.app_bytes, write=False)
        self.counters = {"pd_success": 0, "pd_failed": 0, "pd_checksum_mismatches": 0,
                         "pd_quarantined_blocks": 0, "pd_probes": 0,
                         "pd_deferred": 0, "pd_skip_offered_blocks": 0,
                         "pd_skipped_blocks": 0, "pd_pool_copy_bad": 0}  # fmt: skip

    # -- requests --------------------------------------------------------------------------

    def add(self, rid: int, body: dict, params: SamplingParams, prompt: list[int], base: int,
            ) -> None:  # fmt: skip
        src = body["pd"].get("peer")
        if src not in self.regions:
            raise ValueError(f"pd.peer {src!r} is not a prefill die of this pod")
        hint = body.get("pool") if isinstance(body.get("pool"), dict) else None
        self.reqs[rid] = _PDReq(rid, src, list(prompt), params, base, body.get("stream", True),
                                ns=body.get("ns"), hint=hint)  # fmt: skip

    def busy(self) -> bool:
        return bool(self.reqs or self.events or self.quarantine)

    def abort(self, rid: int) -> bool:
        """True if `rid` was a PD request not in the batch yet (ended here)."""
        r = self.reqs.get(rid)
        if r is None or r.aborted:
            return False
        if r.hint is not None and self.m.pool is not None:  # its pool lease, unused: back
            self.m.pool.copy_hit(r.hint, [], 0, 0)
            r.hint = None
        self._end(r, "abort", "")
        if r.state == "Bootstrapping":
            del self.reqs[rid]
        else:  # its blocks wait for the record (the prefill die may be writing them)
            r.aborted = True
        self.to_master[r.src].send(wire.pack("kv_cancel", {"id": rid}))
        return True

    def abort_all(self) -> None:
        for rid in list(self.reqs):
            self.abort(rid)

    # -- the loop ----------------------------------------------------------------------------

    def tick(self, now: float) -> None:
        for p in self.prefill:
            for rec in self.rx.poll(p):
                self._land(rec, now)
            rid = self.rx.in_flight(p)
            r = self.reqs.get(rid) if rid is not None else None
            if r is not None and r.src == p and r.state == "WaitingForInput":
                r.state, r.since = "Transferring", now
        self._prealloc(now)
        self._deadlines(now)

    def _prealloc(self, now: float) -> None:
        """Bootstrapping -> WaitingForInput in arrival order while there is room (a batch slot
        and the blocks of the prompt, one spare block per running request kept for decode)."""
        sched, kv = self.m.sched, self.m.kv
        pool_off = self.m.words[self.m.region.layout.serve_word(L.SV_KV_POOL)]
        if not pool_off:
            return  # the die has not made its pool yet
        holding = sum(x.state != "Bootstrapping" for x in self.reqs.values())
        boot = [r for r in self.reqs.values() if r.state == "Bootstrapping" and not r.aborted]
        for i, r in enumerate(boot):
            if len(sched.running) + len(sched.waiting) + holding >= self.m.spec.max_num_seqs:
                return self._deferred(boot[i:])
            need = kv.blocks_for(len(r.prompt))
            if not kv.can_alloc(need + len(sched.running)):
                return self._deferred(boot[i:])
            try:
                blocks = kv.alloc_blocks(r.rid, len(r.prompt))
            except KVFull:
                return self._deferred(boot[i:])
            nb, bs = self.m.spec.num_blocks, self.m.spec.block_size
            stride = bs * self.row_bytes
            r.offs = [pool_off + (layer * nb + b) * stride
                      for layer in range(self.n_layers) for b in blocks]  # fmt: skip
            r.state, r.since = "WaitingForInput", now
            holding += 1
            body = {"id": r.rid, "die": self.g, "offs": r.offs, "n_tokens": len(r.prompt)}
            hint, r.hint = r.hint, None
            if hint is not None:
                body.update(self._skip(r, hint))
            self.to_master[r.src].send(wire.pack("kv_dst", body))
            if hint is not None:  # the copy, after the scatter list is on its way
                r.short = self.m.pool.copy_hit(hint, blocks, 0, r.skip) < r.skip

    def _skip(self, r: _PDReq, hint: dict) -> dict:
        """`skip` and `crcs` of the scatter list (the KV pool's `decode_load`): the prompt's
        pooled prefix this master can copy into the request's own new blocks (it does, right
        after sending the list) and the crcs it was stored with. The prefill side sends from
        block `skip` when its own blocks have those crcs (the same bytes), else from 0
        (overwriting them: the blocks are the request's alone): the decode die's KV is the
        prefill die's either way, a replay's too. A copy that does not check fails the request
        (sent again) if the prefill side skipped it."""
        bs = self.m.spec.block_size
        hit = min(len(hint.get("blocks", ())), (len(r.prompt) - 1) // bs)
        r.skip = self.m.pool.copyable(hint, max(0, hit)) if self.m.pool is not None else 0
        if not r.skip:
            return {}
        self.counters["pd_skip_offered_blocks"] += r.skip
        return {"skip": r.skip, "crcs": [int(b[3]) for b in hint["blocks"][: r.skip]]}

    def _deferred(self, reqs: list) -> None:
        """These wait for room (backpressure): each counted once in `pd_deferred`."""
        for r in reqs:
            if not r.deferred:
                r.deferred = True
                self.counters["pd_deferred"] += 1

    def _land(self, rec, now: float) -> None:
        p, kv = rec.src, self.m.kv
        self.links[p] = "ok"
        blocks = self.quarantine.pop(rec.req, None)
        if blocks is not None:  # a late write into quarantined blocks ended: they are free
            kv.free(rec.req)
            self.rx.ack(p, rec.k)
            self.to_master[p].send(wire.pack("kv_done", {"id": rec.req}))  # its lease too
            return
        r = self.reqs.get(rec.req)
        if r is None or r.src != p or r.state not in ("WaitingForInput", "Transferring"):
            self.rx.ack(p, rec.k)
            log.warning("master %d: a KV record of request %d from die %d with no transfer"
                        " waiting for it: dropped", self.g, rec.req, p)  # fmt: skip
            return
        ok = rec.status == OK
        t0 = time.perf_counter_ns()
        start = self._start_of(r, rec.nbytes) if ok else 0
        if ok and start is None:  # not a size the prefill side could have sent
            self.counters["pd_checksum_mismatches"] += 1
            ok = False
        if ok and start and r.short:  # it skipped blocks this die's pool copy got wrong
            self.counters["pd_pool_copy_bad"] += 1
            ok = False
        if ok and self.verify:
            offs, n = self._rest(r, start)
            spans = scatter_spans(offs, n, self.m.spec.block_size, self.row_bytes,
                                  self.n_layers)  # fmt: skip
            if checksum(self.m.region.array, spans, 1) != rec.crc:
                self.counters["pd_checksum_mismatches"] += 1
                ok = False
        if ok:
            self.counters["pd_skipped_blocks"] += start
        self.link_crc_ns[p] += rec.crc_ns + time.perf_counter_ns() - t0
        self.rx.ack(p, rec.k)
        self.link_bytes[p] += rec.nbytes
        self.link_ns[p] += rec.ns
        self.link_n[p] += 1
        del self.reqs[r.rid]
        if r.aborted or not ok:
            kv.free(r.rid)
            self.to_master[p].send(wire.pack("kv_done", {"id": r.rid}))
            if not r.aborted:
                why = (
                    "the prefill side had no KV"
                    if rec.status != OK
                    else (
                        "its pool copy did not check" if r.short and start else "checksum mismatch"
                    )
                )
                self._fail(r, why)
            return
        self.to_master[p].send(wire.pack("kv_done", {"id": r.rid}))
        self.counters["pd_success"] += 1
        self.events.append([r.rid, "landed", now, rec.nbytes, rec.ns])
        self._start(r, rec.first, list(rec.drafts))

    def _start_of(self, r: _PDReq, nbytes: int) -> int | None:
        """The block the prefill side sent from, `skip` or 0, known by the bytes that landed
        (every layer's rows of the prompt from there); None: neither."""
        row = self.n_layers * self.row_bytes
        for start in {r.skip, 0}:
            if nbytes == (len(r.prompt) - start * self.m.spec.block_size) * row:
                return start
        return None

    def _rest(self, r: _PDReq, start: int) -> tuple[list[int], int]:
        """The scatter list of the prompt's blocks from `start`, and their tokens."""
        nb = len(r.offs) // self.n_layers
        offs = [r.offs[layer * nb + b] for layer in range(self.n_layers) for b in range(start, nb)]
        return offs, len(r.prompt) - start * self.m.spec.block_size

    def _start(self, r: _PDReq, first: int, drafts: list[int]) -> None:
        """Success: the request joins the batch at position len(prompt), fed its first token
        (the row that samples output index base + 1); the first token goes out with the next.
        MTP: that row is a verify row, `[first] + drafts` (the prefill die's drafts)."""
        m, rid, p = self.m, r.rid, r.params
        m.sent_n[rid] = r.base
        if r.stream:
            m.streamed.add(rid)
        stop = (first == m.spec.eos_token_id and not p.ignore_eos) or first in p.stop_token_ids
        if stop or p.max_tokens <= 1:
            m.kv.free(rid)
            m.deltas.setdefault(rid, []).append(first)
            m.first[rid] = time.monotonic()
            m.counters["tokens"] += 1
            m.streamed.discard(rid)
            m.done.append([rid, "stop" if stop else "length", len(r.prompt), 0, "",
                           m.first.pop(rid), 0.0])  # fmt: skip
            return
        params = SamplingParams(p.max_tokens - 1, p.temperature, p.seed, tuple(p.stop_token_ids),
                                p.ignore_eos)  # fmt: skip
        req = Request(rid, r.prompt + [first], params, m.spec.eos_token_id, time.monotonic(),
                      index_base=r.base + 1, ns=r.ns)  # fmt: skip
        m.sched.add_prefilled(req, len(r.prompt), drafts if m.spec.spec_tokens else ())
        self.first[rid] = first
        m.counters["tokens"] += 1

    def _deadlines(self, now: float) -> None:
        late: dict[int, list[_PDReq]] = {}
        for r in self.reqs.values():
            if now - r.since > self.timeout_s:
                late.setdefault(r.src, []).append(r)
        for p in self.prefill:
            if p not in late:
                self.probing.pop(p, None)
                continue
            seq, at = self.probing.get(p, (0, 0.0))
            if not seq:
                self.probing[p] = (self.rx.probe(p), now)
                self.to_kv[p].send(wire.pack("probe", {"from": self.g}))
                self.counters["pd_probes"] += 1
            elif self.rx.echoed(p) >= seq:  # alive: late because someone is busy
                self.links[p] = "slow"
                del self.probing[p]
                for r in late[p]:
                    r.since = now
            elif now - at > self.timeout_s:
                self.links[p] = "dead"
                del self.probing[p]
                for r in late[p]:
                    if r.state == "Bootstrapping":
                        r.since = now  # no KV is coming for it yet: wait for room
                        continue
                    del self.reqs[r.rid]
                    blocks = self.m.kv.block_table(r.rid)
                    self.quarantine[r.rid] = blocks
                    self.counters["pd_quarantined_blocks"] += len(blocks)
                    if not r.aborted:
                        self._fail(r, f"link {p}->{self.g} dead (no probe echo in"
                                      f" {self.timeout_s:g} s)")  # fmt: skip

    def _fail(self, r: _PDReq, why: str) -> None:
        self.counters["pd_failed"] += 1
        log.warning("master %d: KV transfer of request %d failed: %s", self.g, r.rid, why)
        self._end(r, "error", f"KV transfer failed: {why}", retry=True)

    def _end(self, r: _PDReq, reason: str, error: str, retry: bool = False) -> None:
        rec = [r.rid, reason, len(r.prompt), 0, error, 0.0, 0.0, retry]
        if retry:  # straight to the shell (never an output process: its policy may resend it)
            self.m.send("out", {"group": self.g, "deltas": [], "done": [rec], "pd": []})
        else:
            self.m.done.append(rec)

    def first_tokens(self, rid: int, toks: list[int]) -> list[int]:
        """A request's tokens with its first token in front, the first time it has any."""
        first = self.first.pop(rid, None)
        return toks if first is None else [first, *toks]

    def stats(self) -> dict:
        states = {s: 0 for s in ("Bootstrapping", "WaitingForInput", "Transferring")}
        for r in self.reqs.values():
            states[r.state] += 1
        links = {f"{p}->{self.g}": {"state": self.links[p], "bytes": self.link_bytes[p],
                                    "ns": self.link_ns[p], "transfers": self.link_n[p],
                                    "crc_ns": self.link_crc_ns[p]}
                 for p in self.prefill}  # fmt: skip
        return {**self.counters, "pd_states": states, "pd_links": links}

    def take_events(self) -> list:
        ev, self.events = self.events, []
        return ev

    def close(self) -> None:
        for s in (*self.to_master.values(), *self.to_kv.values()):
            s.close(linger=0)
        self.rx = None
        for r in self.regions.values():
            r.close()
