"""The mpi4py peer of `xpod bench p2p`, run under mpirun by `bench.peers.run_peer("mpi4py", ...)`:

    mpirun -np 2 --oversubscribe --bind-to core [--allow-run-as-root] \\
        python -m bench.mpi_peer p2p --sizes 8,4096,8388608 --iters-scale 1.0

Rank 0 pings (comm.Send then comm.Recv of numpy uint8 buffers) and times every round trip, rank 1
answers. Same iteration counts and warm-up as the other peers (`bench.peers.iters_for`). Rank 0
prints one JSON row per size on stdout (`bench.common.p2p_row`, transport "mpi4py"); rank 1 sends
it its CPU seconds so that `cpu_s_per_die` is the mean of both ranks.

The all-to-all peer of `xpod bench alltoall`, run by `bench.peers.run_a2a_peer("mpi4py", ...)`:

    mpirun -np N --oversubscribe --bind-to none --mca mpi_yield_when_idle 1 \\
        python -m bench.mpi_peer alltoall --spec cases.json

Every rank moves the dispatch bytes of each case (`bench.peers.a2a` describes a case) with one
comm.Alltoallv, then the combine bytes back with another; each iteration is barrier, dispatch,
barrier, combine, timed on every rank. Rank 0 prints one JSON line per case: the per-iteration
maximum over ranks of both phases (`bench.peers.a2a_merge_ranks`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback

import numpy as np

from bench.common import p2p_row, parse_sizes
from bench.peers import (
    SIDE_BYTE,
    a2a_block_bytes,
    a2a_check,
    a2a_merge_ranks,
    a2a_send_buffer,
    a2a_timed,
    iters_for,
    warmup_for,
)

TAG_PAYLOAD = 7


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.mpi_peer", description="mpi4py peer of xpod bench p2p / alltoall"
    )
    sub = parser.add_subparsers(dest="bench", required=True)
    p2p = sub.add_parser("p2p", help="ping-pong between 2 ranks")
    p2p.add_argument("--sizes", type=parse_sizes, required=True, help="e.g. 8,4096,8M")
    p2p.add_argument("--iters-scale", type=float, default=1.0)
    a2a = sub.add_parser("alltoall", help="Alltoallv dispatch + combine between N ranks")
    a2a.add_argument("--spec", required=True, help="JSON file {'cases': [...]} (bench.peers)")
    args = parser.parse_args(argv)
    cases = None
    if args.bench == "alltoall":
        with open(args.spec, encoding="utf-8") as f:
            cases = json.load(f)["cases"]

    from mpi4py import MPI  # initialises MPI: only once the arguments are known to be good

    comm = MPI.COMM_WORLD
    try:
        if args.bench == "alltoall":
            for case in cases:
                row = _alltoall(comm, MPI.BYTE, case)
                if row is not None:
                    print(json.dumps(row), flush=True)
            return 0
        if comm.Get_size() != 2:
            raise RuntimeError(f"needs exactly 2 ranks, got {comm.Get_size()}: mpirun -np 2")
        for size in args.sizes:
            row = _pingpong(comm, MPI.BYTE, size, args.iters_scale)
            if row is not None:
                print(json.dumps(row), flush=True)
    except BaseException:
        # Without the abort the other ranks would wait in Recv / Alltoallv forever.
        traceback.print_exc()
        sys.stderr.flush()
        comm.Abort(1)
        raise
    return 0


def _alltoall(comm, mpi_byte, case: dict) -> dict | None:
    """Time one case: Alltoallv of the dispatch bytes, then of the combine bytes back (or, for
    a case with "ep", the whole EP job: `bench.ep_job`). Rank 0 returns the merged result, the
    other ranks None."""
    rank, n = comm.Get_rank(), comm.Get_size()
    if len(case["counts"]) != n:
        raise RuntimeError(f"case counts are {len(case['counts'])} x N, mpirun -np {n}")
    if case.get("ep"):
        return _ep(comm, mpi_byte, case)
    phases = []
    for phase, (msg_bytes, reverse) in enumerate(
        ((case["dispatch_msg_bytes"], False), (case["combine_msg_bytes"], True))
    ):
        send_b, recv_b = a2a_block_bytes(case["counts"], rank, msg_bytes, reverse)
        recv = np.zeros(int(recv_b.sum()), np.uint8)
        phases.append(
            (
                _vspec(a2a_send_buffer(rank, send_b, phase), send_b, mpi_byte),
                _vspec(recv, recv_b, mpi_byte),
                recv,
                recv_b,
            )
        )
    (d_send, d_recv, *_), (c_send, c_recv, *_) = phases
    barrier, alltoallv, now = comm.Barrier, comm.Alltoallv, time.perf_counter_ns

    def step() -> tuple:
        barrier()
        t0 = now()
        alltoallv(d_send, d_recv)
        t1 = now()
        barrier()
        t2 = now()
        alltoallv(c_send, c_recv)
        return t1 - t0, now() - t2

    res = a2a_timed(step, lambda v: comm.bcast(v, root=0), case)
    for phase, (_, _, recv, recv_b) in enumerate(phases):
        a2a_check("mpi4py", rank, recv, recv_b, phase)
    every = comm.gather(res, root=0)
    return a2a_merge_ranks(every) if rank == 0 else None


def _ep(comm, mpi_byte, case: dict) -> dict | None:
    """The EP job (quantize, pack, Alltoall of counts + Alltoallv of rows, group by expert;
    bfloat16 rows back with Alltoallv, weighted sum), timed as the xpod rows are and checked
    against comm.reference after the timed steps."""
    from bench.ep_job import EPJob

    rank, n = comm.Get_rank(), comm.Get_size()
    job = EPJob(case["ep"]["point"], case["ep"]["quant"], rank, n)

    def alltoall(counts: np.ndarray) -> np.ndarray:
        got = np.empty_like(counts)
        comm.Alltoall(counts, got)
        return got

    bufs: dict[int, np.ndarray] = {}  # receive buffers kept between steps, by size

    def alltoallv(send: np.ndarray, send_b: np.ndarray, recv_b: np.ndarray) -> np.ndarray:
        n = int(recv_b.sum())
        recv = bufs.get(n)
        if recv is None:
            recv = bufs[n] = np.empty(n, np.uint8)
        comm.Alltoallv(_vspec(send, send_b, mpi_byte), _vspec(recv, recv_b, mpi_byte))
        return recv

    barrier, now = comm.Barrier, time.perf_counter_ns

    def step() -> tuple:
        barrier()
        t0 = now()
        job.dispatch(alltoall, alltoallv)
        t1 = now()
        barrier()
        t2 = now()
        job.combine(alltoallv)
        return t1 - t0, now() - t2

    res = a2a_timed(step, lambda v: comm.bcast(v, root=0), case)
    job.check("mpi4py")
    every = comm.gather(res, root=0)
    return a2a_merge_ranks(every) if rank == 0 else None


def _vspec(buf: np.ndarray, block_bytes, mpi_byte) -> list:
    """[buffer, (counts, displacements), MPI.BYTE] for Alltoallv (byte counts, int32)."""
    counts = [int(b) for b in block_bytes]
    displs = np.concatenate(([0], np.cumsum(counts)[:-1])).astype(int).tolist()
    return [buf, (counts, displs), mpi_byte]


def _pingpong(comm, mpi_byte, size: int, iters_scale: float) -> dict | None:
    """Warm up, then time `iters_for(size)` round trips. Rank 0 returns the row, rank 1 None."""
    rank = comm.Get_rank()
    peer = 1 - rank
    send_buf = [np.full(size, SIDE_BYTE[rank], dtype=np.uint8), mpi_byte]
    recv_arr = np.zeros(size, dtype=np.uint8)
    recv_buf = [recv_arr, mpi_byte]
    iters = iters_for(size, iters_scale)
    _rounds(comm, rank, peer, send_buf, recv_buf, warmup_for(iters), [])
    stamps: list[int] = []
    cpu0 = time.process_time()
    stamps.append(time.perf_counter_ns())
    _rounds(comm, rank, peer, send_buf, recv_buf, iters, stamps)
    cpu_s = time.process_time() - cpu0
    want = SIDE_BYTE[peer]
    if recv_arr[0] != want or recv_arr[-1] != want:
        raise RuntimeError(
            f"rank {rank} received {recv_arr[0]:#x}..{recv_arr[-1]:#x}, expected {want:#x}"
        )
    peer_cpu_s = comm.sendrecv(cpu_s, dest=peer, source=peer)
    if rank != 0:
        return None
    one_way_ns = np.diff(np.asarray(stamps, dtype=np.int64)) / 2
    return p2p_row("mpi4py", "", 1, size, one_way_ns, (cpu_s + peer_cpu_s) / 2)


def _rounds(comm, rank: int, peer: int, send_buf, recv_buf, n: int, stamps: list) -> None:
    """n round trips; rank 0 appends perf_counter_ns() after each."""
    send, recv, now = comm.Send, comm.Recv, time.perf_counter_ns
    if rank == 0:
        for _ in range(n):
            send(send_buf, peer, TAG_PAYLOAD)
            recv(recv_buf, peer, TAG_PAYLOAD)
            stamps.append(now())
    else:
        for _ in range(n):
            recv(recv_buf, peer, TAG_PAYLOAD)
            send(send_buf, peer, TAG_PAYLOAD)


if __name__ == "__main__":
    sys.exit(main())
