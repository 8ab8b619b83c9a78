"""The cross-host peers of `xpod bench p2p --hosts 1,1 --peers` (`run_cross_host_peers`): two
"hosts" of one die each, talking over TCP even on one box, measured like xpod's ping-pong.

| transport    | processes    | one sample                                                        |
| ------------ | ------------ | ----------------------------------------------------------------- |
| mpi4py-tcp   | mpirun -np 2 | Send/Recv ping-pong over btl/tcp, round trip / 2                  |
| rma-raw      | mpirun -np 2 | RMA send (Put; Flush; flag Accumulate; Flush) + 8 B ack: a cycle  |
| rma-pingpong | mpirun -np 2 | the same RMA send both ways, round trip / 2                       |
| zmq-tcp      | fork, 2      | pyzmq PAIR over tcp://<net_if's address>:<free port>, round trip/2 |

The MPI transports run in one mpirun of `bench/rma_peer.py` (which documents their window and
flags) with no shared-memory BTL (`--mca pml ob1 --mca btl self,tcp --mca osc rdma`), TCP bound
to `net_if`, and `mpi_yield_when_idle 1` (MULTIHOST.md §2: spinning idle ranks starve the others
when ranks outnumber cores). rma-raw is the bar of MULTIHOST.md for xpod's cross-host send: it is
reported as the whole cycle, not halved. zmq-tcp is the zmq-ipc peer of `bench.peers.p2p` over
TCP: side 0 binds a free port and hands its number to side 1 through a pipe.
Every row: `hosts: "1,1"`, `cross_host: True`, `timing` ("round_trip/2" or "send+ack cycle").
"""

from __future__ import annotations

import fcntl
import ipaddress
import multiprocessing as mp
import os
import socket
import struct
import sys
import time
from importlib.util import find_spec

import numpy as np

from bench.common import p2p_row
from bench.peers.mpi import mpirun, run_mpirun
from bench.peers.p2p import zmq_rounds
from bench.peers.procs import JOIN_GRACE_S, run_group
from bench.rma_peer import HOSTS, RMA_TRANSPORTS, TIMING
from runtime.pod.die_mpi import TCP_MAX_SEND

CROSS_HOST_TRANSPORTS = ("mpi4py-tcp", "rma-raw", "rma-pingpong", "zmq-tcp")
INSTALL_HINT = "pip install -e '.[multihost]'"
SIOCGIFADDR = 0x8915  # ioctl: the IPv4 address of an interface (linux/sockios.h)


def run_cross_host_peers(
    sizes: list[int],
    iters_scale: float,
    timeout_s: float,
    net_if: str = "lo",
    transports: tuple[str, ...] | list[str] = CROSS_HOST_TRANSPORTS,
    pin: bool = True,
) -> list[dict]:
    """Ping-pong between two emulated hosts over each transport; one `p2p` row per size.

    Arguments:
        sizes: payload sizes in bytes, each > 0, measured in this order.
        iters_scale: multiplies the iteration count of every size (`bench.peers.iters_for`).
        timeout_s: deadline for the whole run; on expiry every process is killed.
        net_if: the interface (or a CIDR, e.g. "169.254.77.0/24") MPI's TCP and zmq use.
        transports: some of CROSS_HOST_TRANSPORTS, rows come back in this order.
        pin: pin the two processes to two distinct cores when the machine has two.
    Returns:
        rows of `bench.common.p2p_row(transport, "", 1, size, samples_ns, cpu_s_per_die)` plus
        `hosts: "1,1"`, `cross_host: True` and `timing`.
    Raises:
        ValueError on a bad argument; RuntimeError if a process fails or times out, or if an MPI
        transport is asked for without mpi4py or mpirun. No process is left behind in any case.
    """
    transports = list(transports)
    bad = [t for t in transports if t not in CROSS_HOST_TRANSPORTS]
    if bad or not transports or len(set(transports)) != len(transports):
        raise ValueError(
            f"transports {transports!r}: expected distinct names among "
            f"{', '.join(CROSS_HOST_TRANSPORTS)}"
        )
    sizes = [int(s) for s in sizes]
    if not sizes or min(sizes) <= 0:
        raise ValueError(f"sizes {sizes!r}: expected a non-empty list of positive byte counts")
    if not iters_scale > 0:
        raise ValueError(f"iters_scale {iters_scale!r}: must be > 0")
    if not net_if or net_if.startswith("-") or "," in net_if:
        raise ValueError(f"net_if {net_if!r}: expected one interface name or CIDR")
    zmq_host = _ipv4_of(net_if) if "zmq-tcp" in transports else ""
    deadline = time.monotonic() + timeout_s
    by_transport: dict[str, list[dict]] = {}
    mpi_transports = [t for t in transports if t in RMA_TRANSPORTS]
    if mpi_transports:
        cmd = cross_host_command(sizes, iters_scale, net_if, mpi_transports, pin)
        rows = run_mpirun(cmd, len(sizes) * len(mpi_transports), timeout_s)
        for row in rows:
            by_transport.setdefault(row["transport"], []).append(row)
    if "zmq-tcp" in transports:
        left_s = deadline - time.monotonic()
        if left_s <= 0:
            raise RuntimeError(f"zmq-tcp: no time left of {timeout_s} s after the MPI peers")
        by_transport["zmq-tcp"] = _run_zmq_tcp(sizes, iters_scale, zmq_host, pin, left_s)
    out = []
    for transport in transports:
        for row in by_transport[transport]:
            row.update(hosts=HOSTS, cross_host=True, net_if=net_if)
            out.append(row)
    return out


def cross_host_command(
    sizes: list[int], iters_scale: float, net_if: str, transports: list[str], pin: bool = True
) -> list[str]:
    """The mpirun command line of the MPI cross-host peers (`bench/rma_peer.py`, 2 ranks).

    Raises RuntimeError, naming the extra to install, without mpi4py or an mpirun."""
    if find_spec("mpi4py") is None:
        raise RuntimeError(f"MPI cross-host peers: no mpi4py in this Python: {INSTALL_HINT}")
    launcher = mpirun()
    if launcher is None:
        raise RuntimeError(f"MPI cross-host peers: no mpirun here or on PATH: {INSTALL_HINT}")
    cmd = [launcher, "-np", "2", "--oversubscribe"]
    cmd += ["--bind-to", "core" if pin and len(os.sched_getaffinity(0)) >= 2 else "none"]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    for key, value in (
        ("osc", "rdma"),
        ("pml", "ob1"),
        ("btl", "self,tcp"),  # no shared-memory BTL: TCP even between ranks on one box
        ("btl_tcp_if_include", net_if),
        ("mpi_yield_when_idle", "1"),
        ("btl_tcp_max_send_size", TCP_MAX_SEND),  # as a multi-host pod's mpirun
    ):
        cmd += ["--mca", key, value]
    cmd += [sys.executable, "-m", "bench.rma_peer", "--sizes", ",".join(str(s) for s in sizes)]
    return cmd + ["--iters-scale", repr(iters_scale), "--transports", ",".join(transports)]


def _run_zmq_tcp(
    sizes: list[int], iters_scale: float, host: str, pin: bool, timeout_s: float
) -> list[dict]:
    """zmq-tcp rows: two forked sides (`bench.peers.procs.run_group`), side 0 times."""
    reader, writer = mp.get_context("fork").Pipe(duplex=False)  # the port: side 0 -> side 1
    try:
        side_args = [(writer, host, sizes, iters_scale), (reader, host, sizes, iters_scale)]
        pin = pin and len(os.sched_getaffinity(0)) >= 2
        results = run_group("zmq-tcp", _zmq_tcp_side, side_args, pin, timeout_s)
    finally:
        reader.close()
        writer.close()
    rows = []
    for size, r0, r1 in zip(sizes, results[0], results[1], strict=True):
        one_way_ns = np.diff(np.asarray(r0["stamps_ns"], dtype=np.int64)) / 2
        cpu_s = (r0["cpu_s"] + r1["cpu_s"]) / 2
        rows.append(p2p_row("zmq-tcp", "", 1, size, one_way_ns, cpu_s, timing=TIMING["mpi4py-tcp"]))
    return rows


def _zmq_tcp_side(side: int, conn, host: str, sizes: list[int], iters_scale: float) -> list:
    """One side of zmq-tcp: side 0 binds a free port and sends its number, side 1 connects."""
    import zmq  # after the fork: a zmq context must never cross one

    ctx = zmq.Context()
    sock = ctx.socket(zmq.PAIR)
    # Side 1 closes right after its last answer: with linger 0 that answer could be dropped.
    sock.linger = int(JOIN_GRACE_S * 1000)
    try:
        if side == 0:
            conn.send(sock.bind_to_random_port(f"tcp://{host}"))
        else:
            if not conn.poll(JOIN_GRACE_S * 4):
                raise RuntimeError("zmq-tcp: side 0 sent no port")
            sock.connect(f"tcp://{host}:{conn.recv()}")

        return zmq_rounds(sock, "zmq-tcp", side, sizes, iters_scale)
    finally:
        sock.close()
        ctx.term()
        conn.close()


def _ipv4_of(net_if: str) -> str:
    """The IPv4 address zmq-tcp binds to: 127.0.0.1 for "lo", the interface's own address for
    another name, or the address of a local interface inside a CIDR."""
    if net_if == "lo":
        return "127.0.0.1"
    try:
        network = ipaddress.ip_network(net_if, strict=False)
    except ValueError:
        address = _if_address(net_if)
        if address is None:
            raise ValueError(f"net_if {net_if!r}: no such interface with an IPv4 address") from None
        return address
    for _, name in socket.if_nameindex():
        address = _if_address(name)
        if address is not None and ipaddress.ip_address(address) in network:
            return address
    raise ValueError(f"net_if {net_if!r}: no local interface has an IPv4 address in it")


def _if_address(name: str) -> str | None:
    """IPv4 address of interface `name` (SIOCGIFADDR), None if it has none or does not exist."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            ifreq = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
        except OSError:
            return None
    return socket.inet_ntoa(ifreq[20:24])
