"""All-to-all peers of `xpod bench alltoall`: the byte pattern of one expert-parallel dispatch and
its combine, moved by mpi4py Alltoallv (mpirun -np N, bench/mpi_peer.py) or by a pyzmq
all-to-all (N forked processes, a PULL socket each and a PUSH socket to every other rank).

A case (a plain dict, JSON for mpirun): counts[src][dst] = messages src sends dst in the
dispatch (self included: nccl-tests counts it, busbw = algbw x (N-1)/N discounts it);
dispatch_msg_bytes / combine_msg_bytes = bytes per message of each phase; warmup; iters (0:
rank 0 picks `iters_for_budget` from the warm-up time and every rank follows); budget_s,
min_iters, max_iters. The combine moves counts[src][dst] x combine_msg_bytes back from dst to
src. One iteration, timed on every rank like the xpod rows: barrier, dispatch, barrier, combine.
Result per case: dispatch_ns / combine_ns = per-iteration maximum over ranks, cpu_s_per_die =
the mean over ranks of time.process_time() in the timed loop, iters.
"""

from __future__ import annotations

import os
import shutil
import struct
import tempfile
import time
from collections.abc import Callable

import numpy as np

from bench.peers.mpi import run_mpi_a2a
from bench.peers.p2p import ZMQ_ZERO_COPY_MIN_BYTES
from bench.peers.procs import JOIN_GRACE_S, run_group

A2A_PEER_TRANSPORTS = ("mpi4py", "zmq")
A2A_HEADER = struct.Struct("<qq")  # zmq frame 1: src rank, collective number


def iters_for_budget(t_iter_s: float, budget_s: float, min_iters: int, max_iters: int) -> int:
    """Timed iterations that fit `budget_s` at `t_iter_s` each, within [min_iters, max_iters]."""
    n = int(budget_s / t_iter_s) if t_iter_s > 0 else max_iters
    return max(min_iters, min(max_iters, n))


def a2a_block_bytes(counts, rank: int, msg_bytes: int, reverse: bool) -> tuple:
    """(send bytes per peer, receive bytes per peer) of `rank`, int64 [N] each. Dispatch:
    rank sends counts[rank][p] messages to p; combine (reverse): it returns counts[p][rank]."""
    c = np.asarray(counts, dtype=np.int64)
    out, into = (c[:, rank], c[rank]) if reverse else (c[rank], c[:, rank])
    return out * msg_bytes, into * msg_bytes


def a2a_byte(src: int, dst: int, phase: int) -> int:
    """The byte every payload byte of block src -> dst in `phase` (0 dispatch, 1 combine) holds."""
    return (src * 37 + dst * 11 + phase * 101 + 1) % 256


def a2a_send_buffer(rank: int, send_bytes: np.ndarray, phase: int) -> np.ndarray:
    """uint8 send buffer, block p (in peer order) filled with a2a_byte(rank, p, phase)."""
    values = [a2a_byte(rank, p, phase) for p in range(len(send_bytes))]
    return np.repeat(np.asarray(values, np.uint8), send_bytes)


def a2a_check(transport: str, rank: int, recv: np.ndarray, recv_bytes, phase: int) -> None:
    """First and last byte of every received block must name its sender."""
    at = 0
    for src, nbytes in enumerate(int(b) for b in recv_bytes):
        want = a2a_byte(src, rank, phase)
        if nbytes and (recv[at] != want or recv[at + nbytes - 1] != want):
            raise RuntimeError(
                f"{transport}: rank {rank} phase {phase}: block from {src} holds"
                f" {recv[at]:#x}..{recv[at + nbytes - 1]:#x}, expected {want:#x}"
            )
        at += nbytes


def a2a_timed(step: Callable[[], tuple], agree: Callable[[int], int], case: dict) -> dict:
    """Warm up, agree on the iteration count (rank 0's choice), then time. step() runs one
    iteration and returns (dispatch_ns, combine_ns) of this rank."""
    warmup_s = []
    for _ in range(max(1, int(case["warmup"]))):
        t0 = time.perf_counter()
        step()
        warmup_s.append(time.perf_counter() - t0)
    t_iter = float(np.median(warmup_s))  # the first one also pays connection set-up
    want = int(case.get("iters") or 0) or iters_for_budget(
        t_iter, case["budget_s"], case["min_iters"], case["max_iters"]
    )
    iters = agree(want)
    disp, comb = [], []
    cpu0 = time.process_time()
    for _ in range(iters):
        d, c = step()
        disp.append(d)
        comb.append(c)
    return {"dispatch_ns": disp, "combine_ns": comb, "cpu_s": time.process_time() - cpu0}


def a2a_merge_ranks(per_rank: list[dict]) -> dict:
    """One case's result from every rank's samples: per-iteration maximum over ranks."""
    return {
        "dispatch_ns": np.max([r["dispatch_ns"] for r in per_rank], axis=0).tolist(),
        "combine_ns": np.max([r["combine_ns"] for r in per_rank], axis=0).tolist(),
        "cpu_s_per_die": float(np.mean([r["cpu_s"] for r in per_rank])),
        "iters": len(per_rank[0]["dispatch_ns"]),
    }


def run_a2a_peer(
    transport: str, cases: list[dict], pin: bool = True, timeout_s: float = 300
) -> list[dict]:
    """Run every case (all with the same number of ranks N) over one peer transport.

    Arguments:
        transport: one of A2A_PEER_TRANSPORTS.
        cases: dicts as described above; counts is N x N with N >= 2, the same N in every case.
        pin: pin rank i to core i when N <= cores (more ranks than cores are never pinned).
        timeout_s: deadline for the whole run; on expiry every process is killed.
    Returns:
        one result dict per case (dispatch_ns, combine_ns, cpu_s_per_die, iters).
    Raises:
        ValueError on bad cases; RuntimeError if a process fails or times out, or MPI is not
        available. No process, socket file or temporary file is left behind in any case.
    """
    if transport not in A2A_PEER_TRANSPORTS:
        raise ValueError(f"transport {transport!r}: expected one of {A2A_PEER_TRANSPORTS}")
    if not cases:
        raise ValueError("cases: expected at least one case")
    shapes = {np.asarray(c["counts"]).shape for c in cases}
    if len(shapes) != 1 or len(next(iter(shapes))) != 2 or len(set(next(iter(shapes)))) != 1:
        raise ValueError(f"cases: counts must be N x N with one N for every case, got {shapes}")
    n = next(iter(shapes))[0]
    if n < 2:
        raise ValueError(f"cases: an all-to-all needs N >= 2 ranks, got {n}")
    pin = pin and n <= len(os.sched_getaffinity(0))
    if transport == "mpi4py":
        return run_mpi_a2a(cases, n, pin, timeout_s)
    return _run_zmq_a2a(cases, n, pin, timeout_s)


def _run_zmq_a2a(cases: list[dict], n: int, pin: bool, timeout_s: float) -> list[dict]:
    tmp_dir = tempfile.mkdtemp(prefix="xpod-peer-zmq.")
    try:
        per_rank = run_group("zmq", _zmq_a2a_rank, [(tmp_dir, n, cases)] * n, pin, timeout_s)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    return [a2a_merge_ranks([r[i] for r in per_rank]) for i in range(len(cases))]


class _ZmqAllToAll:
    """One rank's sockets: a PULL bound at ipc://<dir>/r<rank>, a PUSH to every other rank.

    A collective sends one [header, payload] message to every peer, then takes one from each.
    Per-pair FIFO order keeps collectives apart; a peer can be at most one collective ahead
    (it cannot finish one without this rank's part), so its early message is held back for the
    next call.
    """

    def __init__(self, zmq, ctx, rank: int, n: int, tmp_dir: str):
        self.zmq, self.rank, self.seq = zmq, rank, 0
        self.pull = ctx.socket(zmq.PULL)
        self.pull.linger = int(JOIN_GRACE_S * 1000)
        self.pull.bind(f"ipc://{tmp_dir}/r{rank}")
        self.push = {}
        for p in range(n):
            if p != rank:
                sock = ctx.socket(zmq.PUSH)
                # A rank closes right after its last sends: linger lets them reach the peers.
                sock.linger = int(JOIN_GRACE_S * 1000)
                sock.connect(f"ipc://{tmp_dir}/r{p}")
                self.push[p] = sock
        self.held: dict[int, list] = {p: [] for p in self.push}

    def exchange(self, blocks: dict, on_recv: Callable[[int, object], None]) -> None:
        """Send blocks[p] to every peer p, then on_recv(src, frame) once per peer."""
        self.seq += 1
        header = A2A_HEADER.pack(self.rank, self.seq)
        for p, sock in self.push.items():
            block = blocks[p]
            sock.send(header, self.zmq.SNDMORE)
            sock.send(block, copy=len(block) < ZMQ_ZERO_COPY_MIN_BYTES)
        waiting = set(self.push)
        for p in list(waiting):
            if self.held[p]:
                self._deliver(self.held[p].pop(0), on_recv)
                waiting.discard(p)
        while waiting:
            frames = self.pull.recv_multipart(copy=False)
            src, _ = A2A_HEADER.unpack(frames[0].bytes)
            if src in waiting:
                self._deliver(frames, on_recv)
                waiting.discard(src)
            else:
                self.held[src].append(frames)

    def _deliver(self, frames: list, on_recv) -> None:
        src, seq = A2A_HEADER.unpack(frames[0].bytes)
        if seq != self.seq:
            raise RuntimeError(
                f"zmq: rank {self.rank} got collective {seq} from rank {src}, expected {self.seq}"
            )
        on_recv(src, frames[1])

    def barrier(self, value: int = 0) -> int:
        """A collective of 8-byte messages; returns rank 0's `value` on every rank."""
        got: dict[int, int] = {}
        blob = struct.pack("<q", value)
        self.exchange(
            dict.fromkeys(self.push, blob),
            lambda src, frame: got.__setitem__(src, struct.unpack("<q", frame.bytes)[0]),
        )
        return value if self.rank == 0 else got[0]

    def close(self) -> None:
        for sock in (self.pull, *self.push.values()):
            sock.close()


def _zmq_a2a_rank(rank: int, tmp_dir: str, n: int, cases: list[dict]) -> list[dict]:
    import zmq  # after the fork: a zmq context must never cross one

    ctx = zmq.Context()
    a2a = _ZmqAllToAll(zmq, ctx, rank, n, tmp_dir)
    try:
        out = [_zmq_a2a_case(a2a, rank, case) for case in cases]
        a2a.barrier()  # nobody closes while a peer still waits for its last message
        return out
    finally:
        a2a.close()
        ctx.term()


def _zmq_a2a_case(a2a: _ZmqAllToAll, rank: int, case: dict) -> dict:
    phases = []
    for phase, (msg_bytes, reverse) in enumerate(
        ((case["dispatch_msg_bytes"], False), (case["combine_msg_bytes"], True))
    ):
        send_b, recv_b = a2a_block_bytes(case["counts"], rank, msg_bytes, reverse)
        phases.append(_zmq_phase(a2a, rank, send_b, recv_b, phase))
    dispatch, combine = (run for run, _ in phases)
    now = time.perf_counter_ns

    def step() -> tuple:
        a2a.barrier()
        t0 = now()
        dispatch()
        t1 = now()
        a2a.barrier()
        t2 = now()
        combine()
        return t1 - t0, now() - t2

    res = a2a_timed(step, a2a.barrier, case)
    for _, check in phases:
        check()
    return res


def _zmq_phase(a2a: _ZmqAllToAll, rank: int, send_b, recv_b, phase: int) -> tuple:
    """(run, check) of one phase: run moves this rank's blocks (its own block by a local copy,
    as MPI does), check verifies what arrived."""
    send_buf = a2a_send_buffer(rank, send_b, phase)
    recv_buf = np.zeros(int(recv_b.sum()), np.uint8)
    so = np.concatenate(([0], np.cumsum(send_b)))
    ro = np.concatenate(([0], np.cumsum(recv_b)))
    blocks = {p: memoryview(send_buf[so[p] : so[p + 1]]) for p in a2a.push}
    views = [recv_buf[ro[p] : ro[p + 1]] for p in range(len(recv_b))]
    own_src, own_dst = send_buf[so[rank] : so[rank + 1]], views[rank]

    def on_recv(src: int, frame) -> None:
        data = np.frombuffer(frame.buffer, np.uint8)
        if data.size != views[src].size:
            raise RuntimeError(
                f"zmq: rank {rank} phase {phase}: {data.size} B from rank {src},"
                f" expected {views[src].size}"
            )
        np.copyto(views[src], data)

    def run() -> None:
        np.copyto(own_dst, own_src)
        a2a.exchange(blocks, on_recv)

    return run, lambda: a2a_check("zmq", rank, recv_buf, recv_b, phase)
