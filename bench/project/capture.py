"""Capture pods of the benchmarks' workloads (docs/projection.md §1): the same pod as the
measured run with `capture=True`, a warm-up call and a few captured ones, written to a
directory the replay reads (`runtime.project`)."""

from __future__ import annotations

import dataclasses
import resource
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.alltoall.dies import a2e_run, ep_run
from bench.alltoall.inputs import Point, counts_matrix
from bench.project.memwatch import MemWatch, shm_used
from comm import recv as comm_recv
from comm import send as comm_send
from runtime import Pod, PodConfig
from runtime.pod.capture import write_capture

CAPTURE_WARMUP, CAPTURE_ITERS = 1, 2  # calls: the first is left out of the percentiles
CAPTURE_TIMEOUT_S = 1800.0  # a 128-die pod's calls on 2 cores take minutes


def _want_rows(pt: Point) -> np.ndarray:
    counts = counts_matrix(pt)
    want = counts.sum(axis=0)
    if pt.attention_dies:
        want[: pt.attention_dies] = counts[: pt.attention_dies].sum(axis=1)
    return want


def capture_alltoall(cfg: PodConfig, pt: Point, protocol: str, quant: str,
                     directory: str | Path | None = None,
                     memory: bool = False) -> tuple[Path, dict]:  # fmt: skip
    """Capture `protocol` x `quant` of point `pt` on a fresh capture pod of `cfg`'s shape
    (every word starts at 0, so every guarded step's write is in the log); returns the
    capture's directory and what it cost (seconds, peak resident MiB of the launcher, the
    capture's bytes on disk; `memory`: the dies' resident memory, `bench.project.memwatch`)."""
    cfg = dataclasses.replace(cfg, capture=True, trace=False, hosts=(), fabric="auto")
    if cfg.timeout_s < 60:
        cfg = dataclasses.replace(cfg, timeout_s=60.0)
    out = Path(directory or tempfile.mkdtemp(prefix="xpod-capture-"))
    fn = a2e_run if protocol == "a2e" else ep_run
    names = ["a2e", "e2a"] if protocol == "a2e" else ["dispatch", "combine"]
    t0 = time.monotonic()
    watch, shm0 = None, shm_used()
    with Pod.launch(cfg) as pod:
        launched = time.monotonic()
        if memory:
            watch = MemWatch([p.pid for p in pod.procs], shm_base=shm0).start()
        pod.run(fn, pt, protocol, quant, CAPTURE_WARMUP, CAPTURE_ITERS, _want_rows(pt),
                timeout_s=CAPTURE_TIMEOUT_S)  # fmt: skip
        workload = {"bench": "alltoall", "protocol": protocol, "quant": quant,
                    "batch": pt.batch, "hidden": pt.hidden, "topk": pt.topk,
                    "experts": pt.num_experts, "routing": pt.routing, "seed": pt.seed,
                    "dies": pt.dies, "attention_dies": pt.attention_dies,
                    "combine_dtype": pt.combine_dtype}  # fmt: skip
        write_capture(pod, out, workload, names, warmup=CAPTURE_WARMUP)
        mem = watch.stop() if watch is not None else {}
    cost = {
        "capture_s": round(time.monotonic() - t0, 3),
        "launch_s": round(launched - t0, 3),
        "launcher_peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,
        "capture_mib": round(sum(f.stat().st_size for f in out.iterdir()) / (1 << 20), 2),
        **mem,
    }
    return out, cost


def _one_way(die, nbytes: int, cores: int, variant: str, calls: int) -> int:
    """Die 0 sends `calls` messages of `nbytes` to die 1 (a barrier before each: die 1's
    receive is posted when the send starts, as 001 §3.1 times a send's eight steps)."""
    whole = die.alloc(max(nbytes, 1), np.uint8)
    buf = whole[:nbytes]
    try:
        for i in range(calls):
            die.barrier()
            if die.die_id == 0:
                buf[:] = i & 0xFF
                comm_send(die, buf, 1, event_id=i, cores=cores, variant=variant)
            elif die.die_id == 1:
                comm_recv(die, buf, 0, event_id=i, cores=cores, variant=variant)
        return int(buf[0]) if nbytes and die.die_id == 1 else 0
    finally:
        die.free(whole)


def capture_p2p(cfg: PodConfig, nbytes: int, cores: int, variant: str,
                directory: str | Path | None = None,
                inter_node: bool = False) -> tuple[Path, dict]:  # fmt: skip
    """Capture one-way sends of `nbytes` over `cores` lanes from die 0 to die 1 on a fresh
    2-die capture pod of `cfg`'s ring shape (lanes raised to `cores` if needed);
    `inter_node`: the two dies on different nodes (001 §3.1 times a pair on two servers)."""
    cfg = dataclasses.replace(cfg, num_dies=2, capture=True, trace=False, hosts=(),
                              fabric="auto", lanes=max(cfg.lanes, cores),
                              app_bytes=max(cfg.app_bytes, 2 * nbytes + (1 << 20)))  # fmt: skip
    out = Path(directory or tempfile.mkdtemp(prefix="xpod-capture-"))
    t0 = time.monotonic()
    with Pod.launch(cfg) as pod:
        pod.run(_one_way, nbytes, cores, variant, CAPTURE_WARMUP + CAPTURE_ITERS,
                timeout_s=CAPTURE_TIMEOUT_S)  # fmt: skip
        workload = {"bench": "p2p", "bytes": nbytes, "cores": cores, "variant": variant,
                    "pattern": "one-way: a barrier, then die 0 sends, die 1 receives"}  # fmt: skip
        write_capture(pod, out, workload, ["send"], warmup=CAPTURE_WARMUP,
                      nodes=[0, 1] if inter_node else None)  # fmt: skip
    cost = {"capture_s": round(time.monotonic() - t0, 3)}
    return out, cost


def _ring_rounds(die, size: int, calls: int) -> int:
    """`bench.ring.token_ring`'s rounds (a barrier, then die 0 sends a token of `size` bytes
    to die 1, die i forwards to i + 1, die N-1 returns it to die 0), die 0 recording each
    round as a call `round` (its send's start to its recv's end) for the projection."""
    n, me = die.num_dies, die.die_id
    nxt, prv = (me + 1) % n, (me - 1) % n
    tok = np.zeros(max(1, size // 8), np.int64)
    die.barrier()
    cap = die.cap
    for r in range(calls):
        if me == 0:
            cap.begin("round", r, cap.main)
            tok[0] = r
            comm_send(die, tok, nxt, r)
            comm_recv(die, tok, prv, r)
            cap.end("round", r)
            if tok[0] != r + n - 1:
                raise AssertionError(f"ring round {r}: token {tok[0]} != {r + n - 1}")
        else:
            comm_recv(die, tok, prv, r)
            tok[0] += 1
            comm_send(die, tok, nxt, r)
    return int(tok[0])


def capture_ring(cfg: PodConfig, size: int,
                 directory: str | Path | None = None) -> tuple[Path, dict]:  # fmt: skip
    """Capture token-ring rounds (`bench.ring`) of a `size`-byte token over `cfg.num_dies`
    dies on a fresh capture pod of `cfg`'s shape; meta.json's calls: `round` (die 0's)."""
    cfg = dataclasses.replace(cfg, capture=True, trace=False, hosts=(), fabric="auto",
                              host_names=())  # fmt: skip
    out = Path(directory or tempfile.mkdtemp(prefix="xpod-capture-"))
    t0 = time.monotonic()
    with Pod.launch(cfg) as pod:
        pod.run(_ring_rounds, size, CAPTURE_WARMUP + CAPTURE_ITERS, timeout_s=CAPTURE_TIMEOUT_S)
        pattern = "token ring: die i sends to i + 1, die N-1 back to die 0"
        workload = {"bench": "ring", "dies": cfg.num_dies, "bytes": size, "pattern": pattern}
        write_capture(pod, out, workload, ["round"], warmup=CAPTURE_WARMUP)
    cost = {"capture_s": round(time.monotonic() - t0, 3)}
    return out, cost
