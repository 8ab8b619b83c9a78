"""Prefill-decode disaggregation (DISAGG.md §2; xDeepServe (001) §5.1, CloudMatrix-Infer (000)
§4.3.3, DeepServe (004) §4.4): a pod of P prefill dies and D decode dies, each part its own
lockstep EP group with its own masters; a request's KV goes once from its prefill die into the
blocks its decode die allocated (`comm.kvlink`).

```
 shell (runtime.engine.pd_shell)   picks a prefill die (queue x prompt length) and a decode
   │                               die (least KV, reservations counted); sends `add` to both
   ├─ decode master d: Bootstrapping (no room: the RECV is deferred = backpressure)
   │     -> allocate the blocks -> kv_dst (the scatter list) to prefill master p
   │     -> WaitingForInput -> Transferring (started word) -> record: crc check -> Success:
   │     the request joins d's batch at position len(prompt), fed its first token (MTP:
   │     a verify row, its first token and the drafts of the record)
   ├─ prefill master p: prefill (max_tokens 1), blocks kept under a lease at the finish;
   │     first token (MTP: and drafts) + kv_dst known -> `xfer` order to its die's KV
   │     thread; kv_done frees
   └─ prefill die p's KV thread (`KVThread`, off the step loop): copies the segments
         straight into decode die d's pool, the record, done LAST; echoes probes
```

This module: the topology (`PDTopology`, the connection mapping) and the KV thread of a
prefill die. The masters' sides are `runtime.engine.pd_master`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from dataclasses import dataclass

import numpy as np
import zmq

from comm.kvlink import OK, SOURCE_FAILED, KVGeometry, KVLinkTx, segments
from memory import layout as L
from memory.errors import ConfigError
from runtime.engine import wire
from runtime.engine.step_ring import Bell, bell_path
from runtime.engine.wire import kv_socket

log = logging.getLogger(__name__)
STATES = ("Bootstrapping", "WaitingForInput", "Transferring", "Success", "Failed")
POLICIES = ("fail", "recompute")
SWITCH_S = 0.0002  # a prefill die's interpreter switch interval (its KV thread waits less)


@dataclass(frozen=True)
class PDTopology:
    """Dies 0..P-1 prefill, P..P+D-1 decode (every die is a DP group with its master)."""

    prefill: tuple[int, ...]
    decode: tuple[int, ...]

    @classmethod
    def make(cls, prefill_dies: int, decode_dies: int) -> PDTopology:
        for name, v in (("prefill_dies", prefill_dies), ("decode_dies", decode_dies)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"{name}: {v!r} must be an int >= 1 (a PD pod has both parts)")
        if prefill_dies + decode_dies > L.MAX_PD_DIES:
            raise ConfigError(f"prefill_dies + decode_dies: a PD pod has at most"
                              f" {L.MAX_PD_DIES} dies")  # fmt: skip
        n = prefill_dies + decode_dies
        return cls(tuple(range(prefill_dies)), tuple(range(prefill_dies, n)))

    @property
    def num_dies(self) -> int:
        return len(self.prefill) + len(self.decode)

    def part(self, die: int) -> tuple[int, ...]:
        """The lockstep EP group of `die`."""
        return self.prefill if die in self.prefill else self.decode

    def role(self, die: int) -> str:
        return "prefill" if die in self.prefill else "decode"

    def link(self, p: int, d: int) -> str:
        return f"{p}->{d}"


def kv_source_rank(prefill_tp: int, decode_tp: int, decode_dp: int, decode_dp_rank: int,
                   decode_tp_rank: int) -> int:  # fmt: skip
    """The deterministic connection mapping of CloudMatrix-Infer (000 §4.3.3): the prefill TP
    rank a decode rank pulls its KV from (MLA KV is the same on every TP rank, so any mapping
    that spreads the decode ranks evenly over the prefill ranks is right). A pure function:
    every process derives the same links with no message. xpod's dies are TP 1, so each
    (prefill die, decode die) pair is one link, `PDTopology.link`."""
    if prefill_tp % decode_tp:
        raise ConfigError(f"prefill_tp {prefill_tp} must be a multiple of decode_tp {decode_tp}")
    ratio = prefill_tp // decode_tp
    group_size = max(decode_dp // ratio, 1)
    group_id = decode_dp_rank // group_size
    return group_id * decode_tp + decode_tp_rank


def geometry(region, pool: np.ndarray) -> KVGeometry:
    """The KV geometry of a die's pool (float32 [layers, blocks, block_size, row]; with MTP
    the MTP module's latent layer is its last layer and travels with the others)."""
    n_layers, n_blocks, bs, row = pool.shape
    return KVGeometry(region.offset_of(pool), n_layers, n_blocks, bs, row)


class KVThread:
    """A prefill die's KV transfers, off its step loop: orders from its master (`xfer`: a
    request's source blocks, the decode die's scatter list, the first token and its MTP
    drafts) over a zmq PULL socket; each is copied straight into the decode die's pool
    (`comm.kvlink.KVLinkTx`), then the decode master's bell rings. Probes from decode masters
    are echoed at every wake-up."""

    def __init__(self, die, pool: np.ndarray, topo: PDTopology, run_dir: str, timeout_s: float,
                 fault=None, verify: bool = True):  # fmt: skip
        self.die, self.topo, self.run_dir = die, topo, run_dir
        self.fault = fault  # the die's fault hook (phase "kv", step = the transfer number)
        self.n = 0
        self.tx = KVLinkTx(die, timeout_s, verify)
        self.geo = geometry(die.region, pool)
        self.stopping = False
        self.error: BaseException | None = None
        self.counters = {"transfers": 0, "bytes": 0, "ns": 0, "failed_at_source": 0}
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.PULL)
        self.sock.bind(kv_socket(run_dir, die.die_id))
        self.bells = {d: Bell(bell_path(run_dir, f"m{d}")) for d in topo.decode}
        lo = die.layout  # where the copies go: mapped in this process now, not per page later
        for d in topo.decode:
            die.regions[d].prefault(lo.app_off, lo.app_bytes)
        # The KV thread takes the GIL a few times per transfer (its copy runs without it); the
        # step loop keeps the GIL up to the switch interval once asked for it: 5 ms by default
        # (measured: 1.2 GB/s while serving against ~18 alone), SWITCH_S here.
        self.switch = sys.getswitchinterval()
        sys.setswitchinterval(SWITCH_S)
        self.thread = threading.Thread(target=self._run, name=f"kv-die{die.die_id}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            while not self.stopping:
                if not self.sock.poll(100):
                    continue
                while True:
                    try:
                        frame = self.sock.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._on(frame)
        except BaseException as e:  # noqa: BLE001 - kept for the loop, which raises it
            self.error = e
            log.error("die %d: KV thread failed: %s", self.die.die_id, e)

    def _on(self, frame: bytes) -> None:
        try:
            kind, body = wire.unpack(frame, {"xfer", "probe"})
        except wire.WireError as e:
            log.warning("die %d: KV thread dropped a bad frame: %s", self.die.die_id, e)
            return
        if kind == "probe":
            self.tx.echo(self.topo.decode)
            src = body.get("from")
            if src in self.bells:
                self.bells[src].ring()
            return
        dst = body["dst"]
        status = OK if body.get("ok", True) else SOURCE_FAILED
        spans = np.zeros((0, 3), np.int64)
        if status == OK:
            try:
                spans = segments(self.geo, body["src_blocks"], body["dst_offs"], body["n_tokens"])
            except Exception as e:  # noqa: BLE001 - a bad order fails its request, not the die
                log.warning("die %d: KV order of request %s refused: %s", self.die.die_id,
                            body.get("id"), e)  # fmt: skip
                status = SOURCE_FAILED
        self.n += 1
        hook = None
        if self.fault is not None:
            n, fault = self.n, self.fault

            def hook() -> None:
                fault(n, -1, "kv")

        nbytes, ns, _ = self.tx.push(dst, spans, body["id"], body.get("first", 0), status, hook,
                                     body.get("drafts", ()))  # fmt: skip
        self.counters["transfers"] += status == OK
        self.counters["failed_at_source"] += status != OK
        self.counters["bytes"] += nbytes
        self.counters["ns"] += ns
        self.tx.echo(self.topo.decode)
        self.bells[dst].ring()

    def close(self) -> None:
        self.stopping = True
        self.thread.join(2.0)
        sys.setswitchinterval(self.switch)
        self.sock.close(linger=0)
        self.ctx.term()
        for b in self.bells.values():
            b.close()
        with contextlib.suppress(OSError):
            os.unlink(kv_socket(self.run_dir, self.die.die_id)[len("ipc://") :])


__all__ = ["POLICIES", "STATES", "KVThread", "PDTopology", "geometry", "kv_source_rank"]
