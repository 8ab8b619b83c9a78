"""The p2p peers of `xpod bench p2p` (`run_peer`): the same ping-pong as the xpod rows over
other transports.

Each peer runs in two fresh processes, side 0 (the pinger, which times every round trip) and side 1
(the ponger, which answers). One round trip = side 0 hands `size_bytes` to side 1, side 1 hands
`size_bytes` back. One-way latency is half of each round trip (the osu_latency definition); one
sample per timed iteration, after a warm-up. `cpu_s_per_die` is the mean over both sides of the
`time.process_time()` spent in the timed loop, so a spinning transport shows its cost.

| transport | processes    | one hand-off                                                     |
| --------- | ------------ | ---------------------------------------------------------------- |
| shm-floor | fork, 2      | copy into the peer's shm payload area, then store a flag: 1 copy |
| zmq-ipc   | fork, 2      | pyzmq PAIR over ipc:// (zero-copy send from 64 KiB)              |
| pipe      | fork, 2      | multiprocessing.Pipe send_bytes / recv_bytes_into                |
| mpi4py    | mpirun -np 2 | comm.Send / comm.Recv of numpy uint8 buffers (bench/mpi_peer.py) |

shm-floor is the floor for any Python protocol over shared memory: no descriptor, no ring, no
copy-out by the receiver. Its segment, created by the parent and unlinked by the parent:

    /xpod-peer.<pid>.<hex>, mode 0o600. Glossary: flag[s], payload[s] = side s's inbound mailbox.
    0         8          64        72          4096            4096+A          4096+2A
    | flag[0] | pad      | flag[1] | pad       | payload[0]     | payload[1]     |
    A = max(sizes) rounded up to a page. The one writer of flag[s] and payload[s] is side 1-s.
    Hand-off number v (1, 2, ...; one per round trip, the same v both ways): the sender copies its
    payload into payload[peer], THEN stores v into flag[peer]; the peer polls flag[peer] until it
    reads v. The flag sits on its own cache line so polling it does not bounce the payload lines.
"""

from __future__ import annotations

import mmap
import multiprocessing as mp
import os
import secrets
import shutil
import tempfile
import time
from collections.abc import Callable

import numpy as np
import posix_ipc

from bench.common import p2p_row
from bench.peers.mpi import run_mpi
from bench.peers.procs import JOIN_GRACE_S, run_group

PEER_TRANSPORTS = ("shm-floor", "zmq-ipc", "pipe", "mpi4py")

# Iterations per size: ITERS_SMALL up to ITERS_SMALL_MAX_BYTES, then falling as size**-0.433, which
# gives ~30 at 64 MiB (a 64 MiB pipe round trip costs ~0.15 s here). Never fewer than ITERS_MIN.
ITERS_SMALL = 2000
ITERS_SMALL_MAX_BYTES = 4096
ITERS_DECAY = 0.433
ITERS_MIN = 5

SIDE_BYTE = (0xA0, 0xB1)  # every payload byte names its sender, so a missed copy is visible
PAGE_BYTES = 4096
FLAG_IDX = (0, 8)  # flag[s] as an index into the 'q' cast of the segment (64 bytes apart)
PAYLOAD_OFF = PAGE_BYTES
NP_COPY_MIN_BYTES = 1 << 20  # np.copyto from here: ~2x memoryview slice assignment at 8 MiB
YIELD_EVERY_POLLS = 64  # one core per side: spin, and yield rarely in case a core is shared
ZMQ_ZERO_COPY_MIN_BYTES = 64 << 10  # pyzmq's advice: copy=False only pays off for large frames

# A round-trip loop of one side: run n round trips; side 0 appends perf_counter_ns() after each.
Rounds = Callable[[int, list], None]


def iters_for(size_bytes: int, iters_scale: float = 1.0) -> int:
    """Timed iterations for one size: ~2000 up to 4 KiB, ~180 at 1 MiB, ~30 at 64 MiB, x scale."""
    base = float(ITERS_SMALL)
    if size_bytes > ITERS_SMALL_MAX_BYTES:
        base *= (ITERS_SMALL_MAX_BYTES / size_bytes) ** ITERS_DECAY
    return max(ITERS_MIN, round(base * iters_scale))


def warmup_for(iters: int) -> int:
    return max(3, iters // 10)


def run_peer(
    transport: str,
    sizes: list[int],
    iters_scale: float = 1.0,
    pin: bool = True,
    timeout_s: float = 300,
) -> list[dict]:
    """Ping-pong over one peer transport in two fresh processes; one `p2p` row per size.

    Arguments:
        transport: one of PEER_TRANSPORTS.
        sizes: payload sizes in bytes, each > 0, measured in this order.
        iters_scale: multiplies the iteration count of every size (quick mode uses ~0.2).
        pin: pin the two processes to two distinct cores when the machine has two.
        timeout_s: deadline for the whole run; on expiry the processes are killed.
    Returns:
        rows built by `bench.common.p2p_row(transport, "", 1, size, one_way_ns, cpu_s_per_die)`.
    Raises:
        ValueError on a bad argument; RuntimeError if a process fails, times out or (mpi4py) MPI is
        unavailable. No process or segment is left behind in any case.
    """
    if transport not in PEER_TRANSPORTS:
        raise ValueError(f"transport {transport!r}: expected one of {', '.join(PEER_TRANSPORTS)}")
    sizes = [int(s) for s in sizes]
    if not sizes or min(sizes) <= 0:
        raise ValueError(f"sizes {sizes!r}: expected a non-empty list of positive byte counts")
    if not iters_scale > 0:
        raise ValueError(f"iters_scale {iters_scale!r}: must be > 0")
    if transport == "mpi4py":
        return run_mpi(sizes, iters_scale, pin, timeout_s)
    if transport == "shm-floor":
        results = _run_shm_floor(sizes, iters_scale, pin, timeout_s)
    elif transport == "zmq-ipc":
        results = _run_zmq(sizes, iters_scale, pin, timeout_s)
    else:
        results = _run_pipe(sizes, iters_scale, pin, timeout_s)
    rows = []
    for size, r0, r1 in zip(sizes, results[0], results[1], strict=True):
        one_way_ns = np.diff(np.asarray(r0["stamps_ns"], dtype=np.int64)) / 2
        rows.append(p2p_row(transport, "", 1, size, one_way_ns, (r0["cpu_s"] + r1["cpu_s"]) / 2))
    return rows


def _run_shm_floor(sizes: list[int], iters_scale: float, pin: bool, timeout_s: float) -> list:
    name = f"/xpod-peer.{os.getpid()}.{secrets.token_hex(4)}"
    area_bytes = _payload_area_bytes(sizes)
    try:
        shm = posix_ipc.SharedMemory(
            name, posix_ipc.O_CREX, mode=0o600, size=PAYLOAD_OFF + 2 * area_bytes
        )
    except (posix_ipc.Error, OSError) as e:
        raise RuntimeError(f"shm-floor: shm_open({name}): {e}") from e
    shm.close_fd()
    try:
        args = (name, area_bytes, sizes, iters_scale)
        return _run_pair("shm-floor", _shm_side, [args, args], pin, timeout_s)
    finally:
        posix_ipc.unlink_shared_memory(name)


def _run_zmq(sizes: list[int], iters_scale: float, pin: bool, timeout_s: float) -> list:
    tmp_dir = tempfile.mkdtemp(prefix="xpod-peer-zmq.")
    try:
        args = (f"ipc://{tmp_dir}/pair", sizes, iters_scale)
        return _run_pair("zmq-ipc", _zmq_side, [args, args], pin, timeout_s)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)


def _run_pipe(sizes: list[int], iters_scale: float, pin: bool, timeout_s: float) -> list:
    end0, end1 = mp.get_context("fork").Pipe(duplex=True)
    try:
        side_args = [(end0, sizes, iters_scale), (end1, sizes, iters_scale)]
        return _run_pair("pipe", _pipe_side, side_args, pin, timeout_s)
    finally:
        end0.close()
        end1.close()


def _run_pair(
    transport: str, side_main: Callable, side_args: list[tuple], pin: bool, timeout_s: float
) -> list:
    """Fork side 0 and side 1 of `side_main`; return [result0, result1]; kill both on failure."""
    return run_group(transport, side_main, side_args, pin, timeout_s)


def measure_sides(side: int, sizes: list[int], iters_scale: float, prepare: Callable) -> list[dict]:
    """Warm up then time each size. prepare(size) -> Rounds. Side 0 returns the time stamps."""
    out = []
    for size in sizes:
        rounds: Rounds = prepare(size)
        iters = iters_for(size, iters_scale)
        rounds(warmup_for(iters), [])
        stamps: list[int] = []
        cpu0 = time.process_time()
        stamps.append(time.perf_counter_ns())
        rounds(iters, stamps)
        cpu_s = time.process_time() - cpu0
        out.append({"stamps_ns": stamps if side == 0 else None, "cpu_s": cpu_s})
    return out


def check_payload(transport: str, side: int, got: int, first: int, last: int, size: int) -> None:
    want = SIDE_BYTE[1 - side]
    if got != size or first != want or last != want:
        raise RuntimeError(
            f"{transport}: side {side} received {got} bytes starting {first:#x} ending {last:#x}; "
            f"expected {size} bytes of {want:#x}"
        )


def _payload_area_bytes(sizes: list[int]) -> int:
    return -(-max(sizes) // PAGE_BYTES) * PAGE_BYTES


def _shm_side(side: int, name: str, area_bytes: int, sizes: list[int], iters_scale: float):
    shm = posix_ipc.SharedMemory(name)
    try:
        # The mapping lives until this process exits, right after the run: closing it earlier
        # would first need every view below released.
        seg = memoryview(mmap.mmap(shm.fd, shm.size))
    finally:
        shm.close_fd()
    flags = seg[:PAYLOAD_OFF].cast("q")
    inbox = seg[PAYLOAD_OFF + side * area_bytes :][:area_bytes]
    outbox = seg[PAYLOAD_OFF + (1 - side) * area_bytes :][:area_bytes]
    counter = [0]  # hand-off number, advanced in lockstep by both sides

    def prepare(size: int) -> Rounds:
        src = np.full(size, SIDE_BYTE[side], dtype=np.uint8)
        if size >= NP_COPY_MIN_BYTES:
            push = _np_push(np.frombuffer(outbox, dtype=np.uint8, count=size), src)
        else:
            push = _mv_push(outbox[:size], memoryview(src))
        loop = _shm_ping if side == 0 else _shm_pong

        def rounds(n: int, stamps: list) -> None:
            counter[0] = loop(
                n, counter[0], flags, FLAG_IDX[side], FLAG_IDX[1 - side], push, stamps
            )
            check_payload("shm-floor", side, size, inbox[0], inbox[size - 1], size)

        return rounds

    return measure_sides(side, sizes, iters_scale, prepare)


def _mv_push(dst: memoryview, src: memoryview) -> Callable[[], None]:
    def push() -> None:
        dst[:] = src

    return push


def _np_push(dst: np.ndarray, src: np.ndarray) -> Callable[[], None]:
    def push() -> None:
        np.copyto(dst, src)

    return push


def _shm_ping(n: int, v: int, flags, mine: int, peer: int, push, stamps: list) -> int:
    """Side 0: n x (push, publish v, wait for the answer v). Returns the last v."""
    now, yield_ = time.perf_counter_ns, os.sched_yield
    for _ in range(n):
        v += 1
        push()
        # Payload first, flag last. x86-64 (TSO) keeps stores in program order, so the peer that
        # reads v also reads the payload; a weakly ordered CPU would need a fence between them.
        flags[peer] = v
        polls = 0
        while flags[mine] != v:
            polls += 1
            if polls == YIELD_EVERY_POLLS:
                polls = 0
                yield_()
        stamps.append(now())
    return v


def _shm_pong(n: int, v: int, flags, mine: int, peer: int, push, stamps: list) -> int:
    """Side 1: n x (wait for v, push, publish v). Returns the last v."""
    yield_ = os.sched_yield
    for _ in range(n):
        v += 1
        polls = 0
        while flags[mine] != v:
            polls += 1
            if polls == YIELD_EVERY_POLLS:
                polls = 0
                yield_()
        push()
        flags[peer] = v  # payload first, flag last: see _shm_ping
    return v


def _zmq_side(side: int, addr: str, sizes: list[int], iters_scale: float) -> list[dict]:
    import zmq  # after the fork: a zmq context must never cross one

    ctx = zmq.Context()
    sock = ctx.socket(zmq.PAIR)
    # Side 1 closes right after its last answer: with linger 0 that answer could be dropped.
    sock.linger = int(JOIN_GRACE_S * 1000)
    try:
        if side == 0:
            sock.bind(addr)
        else:
            sock.connect(addr)

        return zmq_rounds(sock, "zmq-ipc", side, sizes, iters_scale)
    finally:
        sock.close()
        ctx.term()


def zmq_rounds(sock, transport: str, side: int, sizes: list[int], iters_scale: float) -> list:
    """The ping-pong of one side of a connected pyzmq PAIR socket (zmq-ipc here, zmq-tcp in
    `bench.peers.tcp`): side 0 pings and times, side 1 answers; zero-copy sends from
    ZMQ_ZERO_COPY_MIN_BYTES."""

    def prepare(size: int) -> Rounds:
        payload = bytes([SIDE_BYTE[side]]) * size
        copy = size < ZMQ_ZERO_COPY_MIN_BYTES
        send, recv, now = sock.send, sock.recv, time.perf_counter_ns

        def ping(n: int, stamps: list) -> None:
            for _ in range(n):
                send(payload, copy=copy)
                msg = recv(copy=copy)
                stamps.append(now())
            _check_zmq(transport, side, msg, size)

        def pong(n: int, stamps: list) -> None:
            for _ in range(n):
                msg = recv(copy=copy)
                send(payload, copy=copy)
            _check_zmq(transport, side, msg, size)

        return ping if side == 0 else pong

    return measure_sides(side, sizes, iters_scale, prepare)


def _check_zmq(transport: str, side: int, msg, size: int) -> None:
    view = memoryview(msg)  # bytes when copied, zmq.Frame otherwise
    check_payload(transport, side, view.nbytes, view[0], view[-1], size)


def _pipe_side(side: int, conn, sizes: list[int], iters_scale: float) -> list[dict]:
    def prepare(size: int) -> Rounds:
        payload = bytes([SIDE_BYTE[side]]) * size
        buf = bytearray(size)
        send, recv_into, now = conn.send_bytes, conn.recv_bytes_into, time.perf_counter_ns

        def ping(n: int, stamps: list) -> None:
            for _ in range(n):
                send(payload)
                got = recv_into(buf)
                stamps.append(now())
            check_payload("pipe", side, got, buf[0], buf[size - 1], size)

        def pong(n: int, stamps: list) -> None:
            for _ in range(n):
                got = recv_into(buf)
                send(payload)
            check_payload("pipe", side, got, buf[0], buf[size - 1], size)

        return ping if side == 0 else pong

    try:
        return measure_sides(side, sizes, iters_scale, prepare)
    finally:
        conn.close()
