"""The MPI side of the cross-host peers of `xpod bench p2p --hosts 1,1 --peers`, run under mpirun
by `bench.peers.tcp.run_cross_host_peers` (2 ranks, MPI over TCP even on one box):

    mpirun -np 2 --oversubscribe [--allow-run-as-root] --mca osc rdma --mca pml ob1 \\
        --mca btl self,tcp --mca btl_tcp_if_include lo --mca mpi_yield_when_idle 1 \\
        python -m bench.rma_peer --sizes 8,4096,8M --iters-scale 1.0 --transports mpi4py-tcp,rma-raw

Rank 0 prints one JSON row per (transport, size) on stdout (`bench.common.p2p_row`, with
`hosts: "1,1"`, `cross_host: True`, `timing`); rank 1 sends it its CPU seconds so that
`cpu_s_per_die` is the mean of both ranks. Same iteration counts and warm-up as the other peers
(`bench.peers.iters_for`, `warmup_for`).

| transport    | one sample       | one hand-off                                               |
| ------------ | ---------------- | ---------------------------------------------------------- |
| mpi4py-tcp   | round trip / 2   | comm.Send / comm.Recv of numpy uint8 buffers               |
| rma-raw      | send + ack cycle | Put(data); Flush; Accumulate(REPLACE, data flag); Flush,   |
|              | (whole)          | answered by Accumulate(REPLACE, ack flag); Flush           |
| rma-pingpong | round trip / 2   | the same send both ways (the answer carries `size` bytes)  |

rma-raw is the cycle MULTIHOST.md §2 measures (the bar for xpod's cross-host send): it is not
halved. Every rank's window is an anonymous shared mmap of its own, written only by the other
rank; a rank polls only its own words, with one `Win.Sync` per poll (over btl/tcp the target has
to be inside MPI for a Put to land):

    0            8      64          72     4096                   4096 + A
    | data flag  | pad  | ack flag  | pad  | payload               |
    A = max(sizes) rounded up to a page. Hand-off number `seq` (1, 2, ...; the same on both ranks,
    never reset between sizes or transports): the first and the last word of the payload carry
    seq, the rest SIDE_BYTE of the sender; the data flag becomes seq after the payload (Flush
    first: the Put is complete at the target before the Accumulate starts). The receiver checks
    both words of every message.
"""

from __future__ import annotations

import argparse
import json
import mmap
import sys
import time
import traceback

import numpy as np

from bench.common import p2p_row, parse_sizes
from bench.peers import SIDE_BYTE, iters_for, warmup_for

RMA_TRANSPORTS = ("mpi4py-tcp", "rma-raw", "rma-pingpong")
TIMING = {"mpi4py-tcp": "round_trip/2", "rma-raw": "send+ack cycle", "rma-pingpong": "round_trip/2"}
HOSTS = "1,1"  # two emulated hosts of one die each

TAG_PAYLOAD = 7
PAGE_BYTES = 4096
DATA_IDX = 0  # word index of the data flag in the 'q' cast of a window
ACK_IDX = 8  # ack flag: on its own cache line, 64 bytes after the data flag
PAYLOAD_OFF = PAGE_BYTES


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.rma_peer",
        description="MPI-over-TCP peers of xpod bench p2p --hosts 1,1 (2 ranks)",
    )
    parser.add_argument("--sizes", type=parse_sizes, required=True, help="e.g. 8,4096,8M")
    parser.add_argument("--iters-scale", type=float, default=1.0)
    parser.add_argument(
        "--transports", default=",".join(RMA_TRANSPORTS), help=", ".join(RMA_TRANSPORTS)
    )
    args = parser.parse_args(argv)
    transports = [t for t in args.transports.split(",") if t]
    bad = [t for t in transports if t not in RMA_TRANSPORTS]
    if bad or not transports:
        parser.error(f"--transports {args.transports!r}: expected some of {RMA_TRANSPORTS}")
    if not args.sizes or min(args.sizes) <= 0 or not args.iters_scale > 0:
        parser.error("--sizes must be positive byte counts and --iters-scale > 0")

    from mpi4py import MPI  # initialises MPI: only once the arguments are known to be good

    comm = MPI.COMM_WORLD
    try:
        if comm.Get_size() != 2:
            raise RuntimeError(f"needs exactly 2 ranks, got {comm.Get_size()}: mpirun -np 2")
        rma = None
        if any(t.startswith("rma-") for t in transports):
            rma = _Rma(MPI, comm, max(args.sizes))
        for transport in transports:
            for size in args.sizes:
                if transport == "mpi4py-tcp":
                    row = _sendrecv(MPI, comm, size, args.iters_scale)
                else:
                    row = rma.measure(transport, size, args.iters_scale)
                if row is not None:
                    print(json.dumps(row), flush=True)
        if rma is not None:
            rma.free()
    except BaseException:
        # Without the abort the other rank would wait in Recv or poll its flag forever.
        traceback.print_exc()
        sys.stderr.flush()
        comm.Abort(1)
        raise
    return 0


def _row(transport: str, size: int, samples_ns: np.ndarray, cpu_s: float, peer_cpu_s: float):
    return p2p_row(
        transport,
        "",
        1,
        size,
        samples_ns,
        (cpu_s + peer_cpu_s) / 2,
        hosts=HOSTS,
        cross_host=True,
        timing=TIMING[transport],
    )


def _timed(comm, rounds, iters: int) -> tuple[list[int], float, float]:
    """Warm up, then run `iters` timed rounds. Returns rank 0's stamps (perf_counter_ns before
    the first and after every round), this rank's CPU seconds and the peer's."""
    rounds(warmup_for(iters), [])
    stamps: list[int] = []
    cpu0 = time.process_time()
    stamps.append(time.perf_counter_ns())
    rounds(iters, stamps)
    cpu_s = time.process_time() - cpu0
    peer = 1 - comm.Get_rank()
    return stamps, cpu_s, comm.sendrecv(cpu_s, dest=peer, source=peer)


def _sendrecv(MPI, comm, size: int, iters_scale: float) -> dict | None:
    """mpi4py-tcp: Send/Recv ping-pong. Rank 0 returns the row, rank 1 None."""
    rank = comm.Get_rank()
    peer = 1 - rank
    send_buf = [np.full(size, SIDE_BYTE[rank], dtype=np.uint8), MPI.BYTE]
    recv_arr = np.zeros(size, dtype=np.uint8)
    recv_buf = [recv_arr, MPI.BYTE]
    send, recv, now = comm.Send, comm.Recv, time.perf_counter_ns

    def rounds(n: int, stamps: list) -> None:
        if rank == 0:
            for _ in range(n):
                send(send_buf, peer, TAG_PAYLOAD)
                recv(recv_buf, peer, TAG_PAYLOAD)
                stamps.append(now())
        else:
            for _ in range(n):
                recv(recv_buf, peer, TAG_PAYLOAD)
                send(send_buf, peer, TAG_PAYLOAD)

    stamps, cpu_s, peer_cpu_s = _timed(comm, rounds, iters_for(size, iters_scale))
    want = SIDE_BYTE[peer]
    if recv_arr[0] != want or recv_arr[-1] != want or recv_arr[size // 2] != want:
        raise RuntimeError(
            f"mpi4py-tcp: rank {rank} received {recv_arr[0]:#x}..{recv_arr[-1]:#x} "
            f"({size} bytes), expected {want:#x}"
        )
    if rank != 0:
        return None
    one_way_ns = np.diff(np.asarray(stamps, dtype=np.int64)) / 2
    return _row("mpi4py-tcp", size, one_way_ns, cpu_s, peer_cpu_s)


class _Rma:
    """One window per rank over its own anonymous mmap (flag page + payload area), locked for
    the whole run (`Lock_all(MODE_NOCHECK)`: passive target, no lock traffic per message)."""

    def __init__(self, MPI, comm, max_size: int) -> None:
        self.MPI, self.comm = MPI, comm
        self.rank = comm.Get_rank()
        self.peer = 1 - self.rank
        self.area_bytes = -(-max_size // PAGE_BYTES) * PAGE_BYTES
        self.mm = mmap.mmap(-1, PAYLOAD_OFF + self.area_bytes)
        self.mem = memoryview(self.mm)
        self.words = self.mem[:PAYLOAD_OFF].cast("q")
        self.win = MPI.Win.Create(self.mm, disp_unit=1, comm=comm)
        self.win.Lock_all(MPI.MODE_NOCHECK)
        self.src = bytearray([SIDE_BYTE[self.rank]]) * self.area_bytes
        self.flag = bytearray(8)  # the source word of every flag Accumulate
        self.seq = 0  # the last hand-off number, in lockstep on both ranks
        comm.Barrier()  # both windows exist and are locked before the first Put

    def free(self) -> None:
        self.comm.Barrier()  # the peer's last Flush into this window is done
        self.win.Unlock_all()
        self.win.Free()

    def measure(self, transport: str, size: int, iters_scale: float) -> dict | None:
        """Time one size of rma-raw or rma-pingpong. Rank 0 returns the row, rank 1 None."""
        rounds = self._rounds(transport, size)
        stamps, cpu_s, peer_cpu_s = _timed(self.comm, rounds, iters_for(size, iters_scale))
        want = SIDE_BYTE[self.peer]
        got = self.mem[PAYLOAD_OFF + size // 2] if size > 16 else want
        received = transport == "rma-pingpong" or self.rank == 1
        if received and got != want:
            raise RuntimeError(
                f"{transport}: rank {self.rank} payload byte {size // 2} of {size} is "
                f"{got:#x}, expected {want:#x}"
            )
        if self.rank != 0:
            return None
        samples_ns = np.diff(np.asarray(stamps, dtype=np.int64))
        if transport == "rma-pingpong":
            samples_ns = samples_ns / 2
        return _row(transport, size, samples_ns, cpu_s, peer_cpu_s)

    def _rounds(self, transport: str, size: int):
        """The round loop of one size: n(rounds, stamps); rank 0 appends a stamp per round."""
        MPI, win, peer, words = self.MPI, self.win, self.peer, self.words
        put, acc, flush, sync = win.Put, win.Accumulate, win.Flush, win.Sync
        now, replace = time.perf_counter_ns, MPI.REPLACE
        src = memoryview(self.src)
        stamp_first, stamp_last = _end_words(src, size)
        got_first, got_last = _end_words(self.mem[PAYLOAD_OFF:], size)
        mask = 0xFF if size < 8 else -1  # a payload under 8 bytes carries seq's low byte
        data_spec = [src[:size], MPI.BYTE]
        data_target = (PAYLOAD_OFF, size, MPI.BYTE)
        flag_word = memoryview(self.flag).cast("q")
        flag_spec = [self.flag, MPI.INT64_T]
        data_flag = (DATA_IDX * 8, 1, MPI.INT64_T)
        ack_flag = (ACK_IDX * 8, 1, MPI.INT64_T)
        check = self._check

        def send(seq: int) -> None:
            stamp_first[0] = stamp_last[0] = seq & mask
            put(data_spec, peer, target=data_target)
            flush(peer)
            flag_word[0] = seq
            acc(flag_spec, peer, target=data_flag, op=replace)
            flush(peer)

        def receive(seq: int) -> None:
            while words[DATA_IDX] < seq:
                sync()
            if words[DATA_IDX] != seq or got_first[0] != seq & mask or got_last[0] != seq & mask:
                check(transport, size, seq, got_first[0], got_last[0])

        def raw(n: int, stamps: list) -> None:
            seq = self.seq
            if self.rank == 0:
                for _ in range(n):
                    seq += 1
                    send(seq)
                    while words[ACK_IDX] < seq:
                        sync()
                    stamps.append(now())
            else:
                for _ in range(n):
                    seq += 1
                    receive(seq)
                    flag_word[0] = seq
                    acc(flag_spec, peer, target=ack_flag, op=replace)
                    flush(peer)
            self.seq = seq

        def pingpong(n: int, stamps: list) -> None:
            seq = self.seq
            if self.rank == 0:
                for _ in range(n):
                    seq += 1
                    send(seq)
                    receive(seq)
                    stamps.append(now())
            else:
                for _ in range(n):
                    seq += 1
                    receive(seq)
                    send(seq)
            self.seq = seq

        return raw if transport == "rma-raw" else pingpong

    def _check(self, transport: str, size: int, seq: int, first: int, last: int) -> None:
        raise RuntimeError(
            f"{transport}: rank {self.rank} message {seq} of {size} bytes: data flag "
            f"{self.words[DATA_IDX]}, payload words {first}..{last}; expected {seq} everywhere"
        )


def _end_words(buf: memoryview, size: int) -> tuple[memoryview, memoryview]:
    """Views of the first and the last 8 bytes of buf[:size] as one int64 each (of the first and
    the last byte when size < 8)."""
    if size < 8:
        return buf[:1].cast("B"), buf[size - 1 : size].cast("B")
    return buf[:8].cast("q"), buf[size - 8 : size].cast("q")


if __name__ == "__main__":
    sys.exit(main())
