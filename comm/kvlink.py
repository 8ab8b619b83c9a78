"""KV links of a prefill-decode disaggregated pod (DISAGG.md §2, xDeepServe (001) §5.1).

A request's KV moves once, from the prefill die that computed it into the blocks the decode die
allocated for it, with no staging copy (zero-copy, a scatter list):

```
 decode side (its master)                         prefill die p (its KV thread)
   allocate blocks (or defer: backpressure)
   publish the scatter list: per (layer, block)
   the byte offset in its region  --- control --->  pair it with its own (layer, block) list,
                                                    coalesce adjacent runs (`segments`)
                                                    wait for a free record slot (ack, own region)
                                   <-- started ---  started = k + 1
                                   <-- KV bytes --  every segment straight into the decode
                                                    die's pool (crc32 of the source as it goes)
                                   <-- record ----  request, first token, bytes, crc, ns, status,
                                                    the MTP drafts (-1: none)
                                   <-- done -----   done = k + 1 LAST
   poll its own region's done, read the record,
   check the crc of what landed, ack = k + 1 ----->  (the record slot is free again)
```

Words (`memory.layout` serve `pd`, one block per peer die): in the decode die's region, written
only by prefill die p: `started`, `done`, `echo` and PD_SLOTS records (record k in slot
k % PD_SLOTS); in the prefill die's region, written only by decode die d: `ack` (records
consumed) and `probe`. Each side polls only its own region and never reads back a word it wrote
in the other's (MULTIHOST.md §4): data first, then the record, then the count. A peer on
another host (`comm.fabric`) is a mirror: the prefill side pushes the segments and the record's
words and publishes started, done and echo; the decode side publishes ack and probe (given
its fabric).

The probe (001 §6.1: KV transfer runs outside the step loop, so its hangs need their own
detector): the decode side writes a sequence into `probe` in the prefill die's region and
rings it; the prefill die's KV thread echoes it into `echo` in the decode die's region. An echo
says the link and the prefill side are alive (a late transfer is then "slow": the prefill side
is busy, or the decode side has no room); no echo within the deadline says "dead".
"""

from __future__ import annotations

import time
import zlib
from dataclasses import dataclass

import numpy as np

from comm.alltoall.state import kernels
from comm.endpoint import Endpoint
from comm.fabric import Fabric
from comm.trace import STEP_NAMES, TRACK_NAMES
from comm.wait import WaitContext, WaitPolicy, wait_ge
from memory import layout as L
from memory.errors import ConfigError, ProtocolError

OK, SOURCE_FAILED = 0, 1  # record status: the KV is there / the prefill side could not send it
KV_LANE, KV_OP = 97, "kv_push"  # trace track of a prefill die's KV thread
TRACK_NAMES[KV_LANE] = "kv link"
STEP_NAMES.update({(KV_OP, 0): "wait record slot", (KV_OP, 2): "write KV app->remote app",
                   (KV_OP, 3): "publish record + done",
                   (KV_OP, 4): "crc32 of the source"})  # fmt: skip
# The KV thread waits for a record slot gently: it runs beside the die's step loop.
LINK_POLICY = WaitPolicy(spin_polls=0, yield_every=1, backoff_after_s=0.001, sleep_s=0.0005)


def peer_word(lo: L.RegionLayout, peer: int, word: int) -> int:
    """Word index (in a region of layout `lo`) of `word` (PD_*) of the block of `peer`."""
    if not 0 <= peer < L.MAX_PD_DIES:
        raise ConfigError(f"KV link peer {peer}: a PD pod has at most {L.MAX_PD_DIES} dies")
    return lo.serve_word(L.SV_PD + peer * L.PD_PEER_WORDS + word)


def record_word(lo: L.RegionLayout, peer: int, k: int, field: int) -> int:
    """Word index of field `field` of record k from `peer`."""
    return peer_word(lo, peer, L.PD_REC + (k % L.PD_SLOTS) * L.PD_REC_WORDS + field)


REC_REQ, REC_FIRST, REC_BYTES, REC_CRC, REC_NS, REC_STATUS, REC_CRC_NS = range(7)
REC_DRAFT = 7  # then L.PD_REC_WORDS - 7 words: the MTP drafts made with the first token, -1: none
MAX_DRAFTS = L.PD_REC_WORDS - REC_DRAFT


@dataclass(frozen=True)
class KVGeometry:
    """Where a die's paged KV pool is and its shape: float32
    `[n_layers, n_blocks, block_size, row_floats]` at byte `pool_off` of the region."""

    pool_off: int
    n_layers: int
    n_blocks: int
    block_size: int
    row_floats: int

    @property
    def row_bytes(self) -> int:
        return self.row_floats * 4

    def offsets(self, blocks: list[int]) -> list[int]:
        """Byte offsets of every (layer, block) of `blocks`, layer-major: the scatter list."""
        stride = self.block_size * self.row_bytes
        for b in blocks:
            if not 0 <= b < self.n_blocks:
                raise ProtocolError(f"KV block {b} is outside the pool of {self.n_blocks}")
        return [self.pool_off + (layer * self.n_blocks + b) * stride
                for layer in range(self.n_layers) for b in blocks]  # fmt: skip


def segments(
    src: KVGeometry, src_blocks: list[int], dst_offs: list[int], n_tokens: int
) -> np.ndarray:
    """int64 `[k, 3]` (src offset, dst offset, bytes): the request's first `n_tokens` rows of
    every layer, from `src_blocks` of the prefill pool to `dst_offs` (the decode side's scatter
    list, layer-major, one offset per (layer, block)), adjacent runs on both sides merged."""
    nb = -(-n_tokens // src.block_size)
    if n_tokens < 1 or len(src_blocks) < nb:
        raise ProtocolError(f"KV transfer of {n_tokens} tokens: the source has"
                            f" {len(src_blocks)} blocks of {src.block_size}")  # fmt: skip
    if len(dst_offs) != src.n_layers * nb:
        raise ProtocolError(f"KV transfer of {n_tokens} tokens: the scatter list has"
                            f" {len(dst_offs)} segments, need {src.n_layers} x {nb}")  # fmt: skip
    s_offs = src.offsets(list(src_blocks[:nb]))
    full = src.block_size * src.row_bytes
    last = (n_tokens - (nb - 1) * src.block_size) * src.row_bytes
    out: list[list[int]] = []
    for i, (s, d) in enumerate(zip(s_offs, dst_offs, strict=True)):
        n = last if i % nb == nb - 1 else full
        if out and out[-1][0] + out[-1][2] == s and out[-1][1] + out[-1][2] == d \
                and out[-1][2] % full == 0:  # fmt: skip
            out[-1][2] += n
        else:
            out.append([s, d, n])
    return np.array(out, np.int64).reshape(-1, 3)


def scatter_spans(dst_offs: list[int], n_tokens: int, block_size: int, row_bytes: int,
                  n_layers: int) -> np.ndarray:  # fmt: skip
    """int64 `[k, 3]` (0, dst offset, bytes) of a scatter list: what `segments` writes there,
    per (layer, block) (the decode side's checksum of what landed)."""
    nb = -(-n_tokens // block_size)
    if len(dst_offs) != n_layers * nb:
        raise ProtocolError(f"scatter list of {len(dst_offs)} segments for {n_layers} x {nb}")
    full, last = block_size * row_bytes, (n_tokens - (nb - 1) * block_size) * row_bytes
    sizes = [last if i % nb == nb - 1 else full for i in range(len(dst_offs))]
    out = np.zeros((len(dst_offs), 3), np.int64)
    out[:, 1], out[:, 2] = dst_offs, sizes
    return out


def checksum(arr: np.ndarray, spans: np.ndarray, col: int) -> int:
    """crc32 over the bytes of `spans[:, col]` offsets (and `spans[:, 2]` sizes) of `arr`,
    in order: the same over coalesced or per-block spans."""
    crc = 0
    for off, n in zip(spans[:, col].tolist(), spans[:, 2].tolist(), strict=True):
        crc = zlib.crc32(arr[off : off + n], crc)
    return crc


class KVLinkTx:
    """The prefill side of every link of one prefill die (used by one thread)."""

    def __init__(self, ep: Endpoint, timeout_s: float = 60.0, verify: bool = True):
        self.ep = ep
        self.verify = verify  # crc32 of the source in every record (0 without)
        self.me = ep.die_id
        self.lo = ep.layout
        # records published to each decode die: a new sender (a new pod.run) goes on from what
        # each decode die acked (its own words: a link at rest has every record acked)
        own = ep.words[ep.die_id]
        self.sent = [own[peer_word(self.lo, d, L.PD_ACK)] if d < L.MAX_PD_DIES else 0
                     for d in range(ep.num_dies)]  # fmt: skip
        self.policy = LINK_POLICY.with_timeout(timeout_s)
        self.ctx = WaitContext(ep.die_id, ep.ctx.abort)
        if ep.fab.any_remote:  # acks from another host land while the fabric progresses
            self.ctx.progress = ep.fab.progress
        self.bytes_sent = [0] * ep.num_dies
        self.ns_sent = [0] * ep.num_dies

    def push(self, dst: int, spans: np.ndarray, req: int, first: int, status: int = OK,
             hook=None, drafts=()) -> tuple[int, int, int]:  # fmt: skip
        """Copy `spans` (`segments`) into die `dst`'s region, then the record and the count.
        Returns (bytes, ns, crc32 of the source). Waits for a free record slot first. `hook`:
        called once the transfer is marked started (fault injection). `drafts`: the MTP
        drafts the prefill die made after the first token (at most MAX_DRAFTS)."""
        self.ep.check_peer(dst, "KV link decode die")
        if len(drafts) > MAX_DRAFTS:
            raise ProtocolError(f"KV record of request {req}: {len(drafts)} drafts > {MAX_DRAFTS}")
        k = self.sent[dst]
        own = self.ep.words[self.me]
        tr = self.ep.trace if self.ep.trace.enabled else None
        if k >= L.PD_SLOTS:  # slot k % PD_SLOTS is free once record k - PD_SLOTS is consumed
            tw = time.perf_counter_ns()
            wait_ge(own, peer_word(self.lo, dst, L.PD_ACK), k - L.PD_SLOTS + 1, self.policy,
                    self.ctx, dst, "pd.ack (a free KV record slot)")  # fmt: skip
            if tr is not None:
                tr.rec(tw, time.perf_counter_ns() - tw, KV_OP, 0, dst, KV_LANE, req, 0)
        w = self.ep.words[dst]
        fab = self.ep.fab if self.ep.fab.any_remote and self.ep.fab.remote[dst] else None
        started = peer_word(self.lo, self.me, L.PD_STARTED)
        w[record_word(self.lo, self.me, k, REC_REQ)] = req  # the slot is free: what is coming,
        if fab is None:
            w[started] = k + 1  # then that it started
        else:  # another host: its mirror's word pushed, then the guard published
            fab.push_words(dst, record_word(self.lo, self.me, k, REC_REQ))
            fab.publish(dst, started, k + 1)
        if hook is not None:
            hook()
        t0 = time.perf_counter_ns()
        src, out = self.ep.regions[self.me].array, self.ep.regions[dst].array
        crc, nbytes = 0, 0
        if status == OK and len(spans):
            lo, hi, top = self.lo.app_off, self.lo.app_off + self.lo.app_bytes, len(src)
            for s, d, n in spans.tolist():  # a few rows (runs merged): plain Python is cheapest
                if d < lo or d + n > hi or s < 0 or s + n > top or n < 0:
                    raise ProtocolError(
                        f"die {self.me}: KV segment [{s}, {s + n}) -> [{d},"
                        f" {d + n}) of die {dst}: outside the app area"
                    )
            nbytes = kernels().scatter_copy(
                src.ctypes.data, out.ctypes.data, np.ascontiguousarray(spans)
            )  # without the GIL
            if fab is not None:  # the kernel wrote the mirror: carry every span over
                for _, d, n in spans.tolist():
                    fab.push(dst, d, n)
        t1 = time.perf_counter_ns()
        if status == OK and self.verify:  # the check, not the transfer: timed apart
            crc = checksum(src, spans, 0)
        t2 = time.perf_counter_ns()
        for field, v in ((REC_FIRST, first), (REC_BYTES, nbytes), (REC_CRC, crc),
                         (REC_STATUS, status), (REC_CRC_NS, t2 - t1)):  # fmt: skip
            w[record_word(self.lo, self.me, k, field)] = v
        for j, t in enumerate([*drafts, *[-1] * (MAX_DRAFTS - len(drafts))]):
            w[record_word(self.lo, self.me, k, REC_DRAFT + j)] = int(t)
        ns = t1 - t0 + time.perf_counter_ns() - t2  # the copy and the record's words
        w[record_word(self.lo, self.me, k, REC_NS)] = ns
        done = peer_word(self.lo, self.me, L.PD_DONE)
        if fab is None:
            w[done] = k + 1  # LAST
        else:  # the record's words, then done
            fab.push_words(dst, record_word(self.lo, self.me, k, 0), L.PD_REC_WORDS)
            fab.publish(dst, done, k + 1)
        if tr is not None:
            t1 = time.perf_counter_ns()
            t3 = time.perf_counter_ns()
            tr.rec(t0, t1 - t0, KV_OP, 2, dst, KV_LANE, req, nbytes)
            tr.rec(t1, t2 - t1, KV_OP, 4, dst, KV_LANE, req, nbytes)
            tr.rec(t2, t3 - t2, KV_OP, 3, dst, KV_LANE, req, 0)
        self.sent[dst] = k + 1
        self.bytes_sent[dst] += nbytes
        self.ns_sent[dst] += ns
        return nbytes, ns, crc

    def echo(self, peers) -> None:
        """Answer every decode die's probe (the probe word in this die's own region)."""
        own = self.ep.words[self.me]
        for d in peers:
            p = own[peer_word(self.lo, d, L.PD_PROBE)]
            if p:
                fab = self.ep.fab
                if fab.any_remote and fab.remote[d]:
                    fab.publish(d, peer_word(self.lo, self.me, L.PD_ECHO), p)
                else:
                    self.ep.words[d][peer_word(self.lo, self.me, L.PD_ECHO)] = p


@dataclass(frozen=True)
class Record:
    src: int
    k: int
    req: int
    first: int
    nbytes: int
    crc: int
    ns: int
    status: int
    crc_ns: int
    drafts: tuple[int, ...] = ()  # the MTP drafts made with the first token


class KVLinkRx:
    """The decode side of every link into one decode die: `words[d]` its own region's words,
    `remote[p]` each prefill die's (written only: ack, probe). `fab`: the die's fabric, when
    some prefill die is on another host (`remote[p]` is then its mirror: ack and probe are
    published)."""

    def __init__(self, me: int, lo: L.RegionLayout, own: memoryview, remote: dict,
                 fab: Fabric | None = None):  # fmt: skip
        self.me, self.lo, self.own, self.remote = me, lo, own, remote
        self.fab = fab if fab is not None and fab.any_remote else None
        self.taken = {p: own[peer_word(lo, p, L.PD_DONE)] for p in remote}  # at rest: all
        self.probes = dict.fromkeys(remote, 0)

    def poll(self, src: int) -> list[Record]:
        """The records published by `src` and not taken yet (call `ack` once each is checked)."""
        done = self.own[peer_word(self.lo, src, L.PD_DONE)]
        out = []
        for k in range(self.taken[src], done):
            f = [self.own[record_word(self.lo, src, k, i)] for i in range(L.PD_REC_WORDS)]
            out.append(Record(src, k, *f[:REC_DRAFT], tuple(t for t in f[REC_DRAFT:] if t >= 0)))
        return out

    def ack(self, src: int, k: int) -> None:
        """Record k of `src` is consumed: its slot is free."""
        self.taken[src] = k + 1
        self._store(src, peer_word(self.lo, self.me, L.PD_ACK), k + 1)

    def _store(self, src: int, word: int, value: int) -> None:
        """A word of `src`'s region that this die alone writes (a plain store, or published)."""
        if self.fab is not None and self.fab.remote[src]:
            self.fab.publish(src, word, value)
        else:
            self.remote[src][word] = value

    def in_flight(self, src: int) -> int | None:
        """The request whose KV `src` is writing now (started, not done), or None."""
        s = self.own[peer_word(self.lo, src, L.PD_STARTED)]
        if s <= self.own[peer_word(self.lo, src, L.PD_DONE)]:
            return None
        return self.own[record_word(self.lo, src, s - 1, REC_REQ)]

    def probe(self, src: int) -> int:
        """Ask `src`'s KV thread to echo a new sequence; returns it."""
        self.probes[src] += 1
        self._store(src, peer_word(self.lo, self.me, L.PD_PROBE), self.probes[src])
        return self.probes[src]

    def echoed(self, src: int) -> int:
        return self.own[peer_word(self.lo, src, L.PD_ECHO)]


__all__ = [
    "MAX_DRAFTS", "KVGeometry", "KVLinkRx", "KVLinkTx", "Record", "checksum", "scatter_spans",
    "segments",
]  # fmt: skip
