"""A die of a multi-host pod: one MPI rank (`mpirun ... python -m runtime.pod.die_mpi`).

Started by `runtime.pod.mpi_launch.MpiPod` with the pod id, the launcher's zmq endpoint, the
pod's key and its PodConfig in the environment. Rank = die id. The host of every die comes
from `XPOD_HOSTS` (emulated hosts: blocks of consecutive ranks) or from MPI's shared-memory
split (real hosts, ordered by their lowest rank). Start-up:

1. the host leader (lowest rank of its host) creates the control segment (itself as
   "launcher", so `xpod clean` works per host) and every region of its host; host barrier;
   the other dies attach them and write their pid in the control segment;
2. every die makes its `comm.fabric_mpi.MpiFabric` (one window over its own region,
   collective), its `Die`, and says `ready(die, pid, host)`; the host leader also starts a
   thread with a second socket for aborts (it bumps the host's abort word), kills and
   reports of stopped dies;
3. serve `run` / `stop` from the launcher as `runtime.pod.die._serve` does; between runs the
   die polls its socket with fabric progress (a remote write lands only while the target is
   inside MPI).

Stop: free the window, barrier, the leader unlinks its host's segments, finalize. SIGTERM
(prterun ending the job after a rank died, or mpirun after its launcher died) is taken by a
thread (`sigwait`: it runs even while the main thread is inside an MPI call): say
`bye(die, dead host-mates)`, unlink this die's region and the dead host-mates' regions, the
control segment if none of the host's regions is left, exit.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import hmac
import importlib.util
import json
import logging
import os
import pickle
import shutil
import signal
import sys
import threading
import time
import traceback
from typing import Any

import msgpack
import zmq

from comm.fabric import hosts_of
from memory.errors import PodError
from memory.heap import keep_freed_memory
from memory.region import Region, RegionHandle, region_name, unlink_segment
from runtime.pod import control as C
from runtime.pod.config import PodConfig
from runtime.pod.proc import limit_blas_threads, parent_death_signal

log = logging.getLogger(__name__)
VERSION = 1  # of the control channel's messages
IDLE_POLL_MS = (1, 10, 50)  # between runs: socket poll timeouts (first 100 ms, first 2 s, then)
STATE_EVERY_S = 1.0
INSTALL_HINT = "pip install -e '.[multihost]'"


class Channel:
    """Signs the frames one socket sends (as `name`) and checks the frames it receives."""

    def __init__(self, key: bytes, name: str):
        self.key = key
        self.name = name
        self.seq = 0
        self.seen: dict[str, int] = {}
        self.dropped = 0

    def pack(self, kind: str, **fields: Any) -> list[bytes]:
        self.seq += 1
        body = msgpack.packb([kind, VERSION, self.name, self.seq, fields], use_bin_type=True)
        return [hmac.new(self.key, body, hashlib.sha256).digest(), body]

    def unpack(self, frames: list[bytes], sender: str | None = None) -> tuple | None:
        """(sender, kind, fields) of a frame that passes every check; None (logged) if not.
        `sender`: the identity the frame came from (a ROUTER knows it), checked if given."""
        try:
            mac, body = frames
            if not hmac.compare_digest(mac, hmac.new(self.key, body, hashlib.sha256).digest()):
                raise ValueError("bad MAC")
            kind, version, name, seq, fields = msgpack.unpackb(body, raw=False)
            if version != VERSION:
                raise ValueError(f"version {version}, expected {VERSION}")
            if sender is not None and name != sender:
                raise ValueError(f"sender {name!r} on the socket of {sender!r}")
            if seq <= self.seen.get(name, 0):
                raise ValueError(f"replayed sequence number {seq} from {name!r}")
            self.seen[name] = seq
            return name, kind, fields
        except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError) as e:
            self.dropped += 1
            log.warning("%s: dropped a control frame: %s", self.name, e)
            return None


def find_mpirun() -> str:
    """The venv's `mpirun` (next to sys.executable), else one on PATH; PodError naming the
    install command if it or mpi4py is missing."""
    if importlib.util.find_spec("mpi4py") is None:
        raise PodError(f"a multi-host pod needs mpi4py and Open MPI 5: {INSTALL_HINT}")
    here = os.path.join(os.path.dirname(sys.executable), "mpirun")
    found = here if os.access(here, os.X_OK) else shutil.which("mpirun")
    if not found:
        raise PodError(f"a multi-host pod needs mpirun (Open MPI >= 5): {INSTALL_HINT}")
    return found


def bind_address(config: PodConfig) -> str:
    """Where the launcher's ROUTER listens: loopback for emulated hosts, else the IPv4
    address of `net_if` (an interface name or a CIDR)."""
    if not config.host_names:
        return "127.0.0.1"
    import ipaddress

    for a in net_if_addresses(config.net_if):
        if ipaddress.ip_address(a).version == 4:
            return a
    raise PodError(f"net_if {config.net_if!r}: no IPv4 address on this machine (set --net-if)")


def local_addresses() -> dict[str, list[str]]:
    """Every IPv4 and IPv6 address of this machine (its network namespace), by interface."""
    import psutil

    out: dict[str, list[str]] = {}
    for name, addrs in psutil.net_if_addrs().items():
        for a in addrs:
            if a.family.name in ("AF_INET", "AF_INET6"):
                out.setdefault(name, []).append(a.address.split("%")[0])  # fe80::1%eth0
    return out


def net_if_addresses(net_if: str) -> list[str]:
    """This machine's addresses on `net_if`: an interface name or a CIDR (either family)."""
    import ipaddress

    net = None
    with contextlib.suppress(ValueError):
        net = ipaddress.ip_network(net_if, strict=False) if "/" in net_if else None
    out = []
    for name, addrs in local_addresses().items():
        for a in addrs:
            if (net is None and name == net_if) or (net and ipaddress.ip_address(a) in net):
                out.append(a)
    return out


def listeners(names: dict[int, str]) -> list[tuple[str, str, int]]:
    """(name, address, port) of every listening TCP socket and bound UDP socket of the
    processes `names` maps (pid -> name); a process that is gone or hidden is skipped."""
    import psutil

    out = []
    for pid, name in names.items():
        try:
            conns = psutil.Process(pid).net_connections("inet")
        except psutil.Error:
            continue
        for c in conns:
            if c.laddr and (c.status == psutil.CONN_LISTEN or c.type.name == "SOCK_DGRAM"):
                out.append((name, c.laddr.ip, c.laddr.port))
    return out


def exposed(found: list[tuple[str, str, int]], net_if: str) -> list[tuple[str, str, int]]:
    """The sockets of `found` another network reaches: bound to an address, or to a wildcard
    (`0.0.0.0`: every IPv4 address; `::`: every address, a dual-stack socket unless
    IPV6_V6ONLY, which psutil does not show), that is neither loopback nor `net_if`'s."""
    import ipaddress

    mine = [ipaddress.ip_address(a) for addrs in local_addresses().values() for a in addrs]
    allowed = {ipaddress.ip_address(a) for a in net_if_addresses(net_if or "lo")}
    out = []
    for entry in found:
        ip = ipaddress.ip_address(entry[1])
        reach = [ip]
        if ip.is_unspecified:
            reach = [a for a in mine if a.version == 4 or ip.version == 6]
        if any(not a.is_loopback and a not in allowed for a in reach):
            out.append(entry)
    return out


def endpoint(address: str, port: int) -> str:
    """`1.2.3.4:80`, `[::]:80`."""
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


# btl/tcp's largest fragment: 1 MiB instead of 128 KiB (MULTIHOST §2's hint; measured here,
# an 8 MiB zero-copy one-way 3.5 ms against 5.7 at the default, pyzmq over TCP 2.7)
TCP_MAX_SEND = "1048576"


def mpirun_command(config: PodConfig, mpirun: str, args: list[str]) -> list[str]:
    """mpirun and its flags (MULTIHOST §2) for `config`'s dies, running `args`."""
    n = config.num_dies
    cmd = [mpirun, "-np", str(n), "--oversubscribe"]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    cmd += ["--map-by", "slot", "--bind-to", "none"]
    if config.host_names:
        counts = collections.Counter(config.hosts)
        hosts = ",".join(f"{h}:{counts[i]}" for i, h in enumerate(config.host_names))
        cmd += ["--host", hosts]
    net = config.net_if or "lo"
    # mpi_ft_enable: a die whose TCP peer died gets an MPI error instead of aborting the job
    # (ob1's error handler aborts otherwise, before prterun's SIGTERM lets the dies say bye)
    for k, v in (("pml", "ob1"), ("btl", "self,tcp"), ("osc", "rdma"),
                 ("btl_tcp_if_include", net), ("mpi_yield_when_idle", "1"),
                 ("btl_tcp_max_send_size", TCP_MAX_SEND),
                 ("mpi_ft_enable", "true")):  # fmt: skip
        cmd += ["--mca", k, v]
    # Listening sockets (docs/architecture.md §7): if_include above and below only choose the
    # addresses the ranks and daemons publish and connect over; btl/tcp (every rank) and
    # PRRTE's oob/tcp (prterun, prted) bind their listeners to 0.0.0.0 and [::] whatever the
    # parameters (`disable_family` / `disable_ipv6_family` too), so the launcher warns about
    # them (`exposed`). PMIx's server (prterun's, each prted's) serves only its host's ranks:
    # pinned to loopback, its default, which would fall back to a public interface on a
    # machine without one.
    cmd += ["--pmixmca", "ptl_base_if_include", "lo"]
    if config.host_names:
        cmd += ["--prtemca", "oob_tcp_if_include", net]
        # how mpirun starts its daemons on the other hosts: ssh by default; a command of the
        # same form (`agent HOST CMD...`) from XPOD_MPI_AGENT (the network-namespace tests')
        agent = os.environ.get("XPOD_MPI_AGENT")
        if agent:
            cmd += ["--prtemca", "plm_ssh_agent", agent]
    return cmd + args


class _State:
    """What the SIGTERM thread needs to clean up for this die (filled in as start-up goes)."""

    def __init__(self, pod_id: str, me: int, endpoint: str, key: bytes):
        self.pod_id, self.me, self.endpoint, self.key = pod_id, me, endpoint, key
        self.host_dies: list[int] = [me]  # the dies of this die's host
        self.machine_dies: list[int] = [me]  # the dies sharing this machine's /dev/shm
        self.host = 0
        self.ctl: C.Control | None = None
        self.stopping = False  # a normal stop: the leader unlinks


def host_split(world, num_dies: int) -> list[int]:
    """The host of every rank: `XPOD_HOSTS` counts, else the COMM_TYPE_SHARED split ordered by
    each host's lowest world rank (MULTIHOST appendix)."""
    spec = os.environ.get("XPOD_HOSTS")
    if spec:
        return hosts_of(spec, num_dies)
    from mpi4py import MPI

    node = world.Split_type(MPI.COMM_TYPE_SHARED)
    mine = world.allgather(node.allreduce(world.Get_rank(), op=MPI.MIN))
    node.Free()
    order = sorted(set(mine))
    return [order.index(m) for m in mine]


def main() -> int:
    """The entry point of a rank."""
    # SIGTERM may reach any thread (MPI's progress threads unblock every signal): its Python
    # handler only wakes the cleanup thread through the wakeup fd, which runs even while the
    # main thread is inside an MPI call.
    rfd, wfd = os.pipe()
    os.set_blocking(wfd, False)
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    signal.set_wakeup_fd(wfd, warn_on_full_buffer=False)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the launcher's to handle
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    env = os.environ
    pod_id, endpoint = env["XPOD_POD"], env["XPOD_LAUNCHER"]
    key = bytes.fromhex(env.pop("XPOD_KEY"))
    config = PodConfig.from_dict(json.loads(env["XPOD_CONFIG"]))
    ppid = os.getppid()
    parent_death_signal(signal.SIGTERM)  # prterun (or prted) dies: so does this die
    if os.getppid() != ppid:
        return 3
    import mpi4py

    mpi4py.rc.thread_level = "multiple"  # the DMA engine's thread pushes too
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    me = world.Get_rank()
    logging.basicConfig(format=f"die {me} %(levelname)s %(name)s: %(message)s")
    st = _State(pod_id, me, endpoint, key)
    threading.Thread(target=_on_sigterm, args=(st, rfd), daemon=True, name="sigterm").start()
    keep_freed_memory()
    limit_blas_threads(1)
    zctx = zmq.Context()
    sock = zctx.socket(zmq.DEALER)
    sock.setsockopt_string(zmq.IDENTITY, f"d{me}")
    sock.linger = 1000
    sock.connect(endpoint)
    chan = Channel(key, f"d{me}")
    try:
        die, fabric, regions = _start(st, config, world, MPI)
    except BaseException as e:  # noqa: BLE001 - reported to the launcher, then exit non-zero
        _send_error(sock, chan, me, e)
        if st.machine_dies[0] == me:
            _unlink_local(st)
        sock.close()
        zctx.term()
        os._exit(1)
    leader = st.host_dies[0] == me
    if leader:
        threading.Thread(target=_watch, args=(st, zctx), daemon=True, name="watch").start()
    sock.send_multipart(chan.pack("ready", die=me, pid=os.getpid(), host=st.host))
    _serve(die, sock, chan)
    st.stopping = True
    die.close()
    fabric.close()
    for r in st.host_dies:
        regions[r].close()
    with contextlib.suppress(BufferError, ValueError):
        st.ctl.close()
    world.Barrier()  # every die of every host is done with every segment
    if st.machine_dies[0] == me:
        _unlink_local(st)
    MPI.Finalize()
    sock.close()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # the watch thread's socket would hold zmq's term()


def _unlink_local(st: _State) -> None:
    """The machine leader's teardown: every region of this machine's dies, then the control
    segment."""
    for r in st.machine_dies:
        unlink_segment(region_name(st.pod_id, r))
    shutil.rmtree(os.path.join("/dev/shm", C.run_dir_name(st.pod_id)), ignore_errors=True)
    unlink_segment(C.ctl_name(st.pod_id))


def _start(st: _State, config: PodConfig, world, MPI):
    """Segments, fabric and Die of this rank (collective; a failure anywhere fails all).

    The control segment is per machine (/dev/shm): its lowest rank makes it. Emulated hosts
    share the machine's, real hosts have one each. Regions are made by their host's leader.
    """
    from comm.fabric_mpi import MpiFabric
    from runtime.pod.die import Die, pin_die

    n, me, pod_id = config.num_dies, st.me, st.pod_id
    if world.Get_size() != n:
        raise PodError(f"mpirun started {world.Get_size()} ranks for {n} dies")
    machine = world.Split_type(MPI.COMM_TYPE_SHARED)
    st.machine_dies = sorted(machine.allgather(me))
    hosts = host_split(world, n)
    if config.hosts and list(config.hosts) != hosts:
        raise PodError(f"hosts: the dies landed on hosts {hosts}, the pod asked {config.hosts}")
    st.host = hosts[me]
    st.host_dies = [r for r in range(n) if hosts[r] == st.host]
    pin_die(me, config)
    layout = config.layout()
    regions: list = [None] * n
    err = None

    def step(fn) -> None:
        nonlocal err
        if err is None:
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 - every rank must learn of it
                err = e
        if not machine.allreduce(err is None, op=MPI.LAND) and err is None:
            err = PodError("another die of this machine failed to start (see its error)")

    def make_ctl() -> None:
        if st.machine_dies[0] == me:
            st.ctl = C.Control.create(pod_id, n, host_leader=True)

    def make_regions() -> None:
        if st.ctl is None:
            st.ctl = C.Control.attach(pod_id)
        st.ctl.words[C.W_DIE_PID + me] = os.getpid()
        if st.host_dies[0] == me:
            for r in st.host_dies:
                regions[r] = Region.create(region_name(pod_id, r), r, layout)

    def attach() -> None:
        for r in st.host_dies:
            if regions[r] is None:
                regions[r] = Region.attach(RegionHandle(region_name(pod_id, r), r), layout)

    for fn in (make_ctl, make_regions, attach):
        step(fn)
    machine.Free()
    if not world.allreduce(err is None, op=MPI.LAND):
        raise err or PodError("a die of another host failed to start (see its error)")
    poison = os.environ.get("XPOD_MPI_POISON", "") not in ("", "0")
    mode = "rma" if config.fabric == "mpi-rma" else "store"
    fabric = MpiFabric(me, world, regions[me], regions, hosts, layout, poison, mode)
    die = Die(me, config, regions, st.ctl, fabric)
    if config.a2a_max_batch:
        from comm import kernels

        kernels.warm()
    return die, fabric, regions


def _serve(die, sock, chan: Channel) -> None:
    """Run commands until stop (or the launcher's socket stays silent and mpirun ends us)."""
    fab = die.fab
    idle_since = time.monotonic()
    while True:
        idle = time.monotonic() - idle_since
        timeout = IDLE_POLL_MS[0 if idle < 0.1 else 1 if idle < 2.0 else 2]
        if not sock.poll(timeout):
            if fab is not None:
                try:
                    fab.progress()  # a peer still finishing may be writing into this die
                except PodError:  # a peer died: mpirun's SIGTERM comes next (say bye then)
                    fab = None
            continue
        msg = chan.unpack(sock.recv_multipart())
        if msg is None:
            continue
        _, kind, f = msg
        die.commands += 1
        if kind == "stop":
            return
        if kind != "run":
            continue
        try:
            fn, args = pickle.loads(f["blob"])
        except Exception as e:  # noqa: BLE001 - e.g. a function the die cannot import
            _send_error(sock, chan, die.die_id, e)
            continue
        die._arm_abort(f["epoch"])
        cpu0 = time.process_time()
        try:
            result = fn(die, *args)
        except BaseException as e:  # noqa: BLE001 - every error goes back to the launcher
            _send_error(sock, chan, die.die_id, e)
            idle_since = time.monotonic()
            continue
        cpu_s = time.process_time() - cpu0
        try:
            blob = pickle.dumps(result)
        except (pickle.PicklingError, TypeError, AttributeError) as e:
            _send_error(sock, chan, die.die_id, TypeError(f"result cannot be pickled: {e}"))
        else:
            sock.send_multipart(chan.pack("ok", die=die.die_id, result=blob, cpu=cpu_s))
        idle_since = time.monotonic()


def _send_error(sock, chan: Channel, me: int, e: BaseException) -> None:
    tb = traceback.format_exc()
    try:
        blob = pickle.dumps(e)
    except (pickle.PicklingError, TypeError, AttributeError):
        blob = pickle.dumps(RuntimeError(f"{type(e).__name__}: {e}"))
    with contextlib.suppress(zmq.ZMQError):
        sock.send_multipart(chan.pack("err", die=me, error=blob, tb=tb))


def _watch(st: _State, zctx) -> None:
    """The host leader's thread: aborts (the host's abort word), kills, stopped dies."""
    import psutil

    sock = zctx.socket(zmq.DEALER)
    name = f"a{st.host}"
    sock.setsockopt_string(zmq.IDENTITY, name)
    sock.linger = 0
    sock.connect(st.endpoint)
    chan = Channel(st.key, name)
    sock.send_multipart(chan.pack("watch", host=st.host))
    words = st.ctl.words
    reported: list[int] = []
    try:
        while True:
            if sock.poll(int(STATE_EVERY_S * 1000)):
                msg = chan.unpack(sock.recv_multipart())
                if msg is None:
                    continue
                _, kind, f = msg
                if kind == "abort":
                    words[C.W_ABORT] = max(words[C.W_ABORT], f["epoch"])
                    sock.send_multipart(chan.pack("aborted", host=st.host, epoch=f["epoch"]))
                elif kind == "kill" and f["die"] in st.host_dies:
                    with contextlib.suppress(OSError):
                        os.kill(words[C.W_DIE_PID + f["die"]], signal.SIGKILL)
                continue
            stopped = []
            for r in st.host_dies:
                with contextlib.suppress(psutil.Error):
                    proc = psutil.Process(words[C.W_DIE_PID + r])
                    if proc.status() in ("stopped", "tracing-stop"):
                        stopped.append(r)
            if stopped or reported:
                sock.send_multipart(chan.pack("stopped", host=st.host, dies=stopped))
            reported = stopped
    except (zmq.ZMQError, ValueError):
        return  # the context is going away (exit)


def _on_sigterm(st: _State, rfd: int) -> None:
    """SIGTERM: goodbye to the launcher, then this host's share of the cleanup, then exit.

    The bye's socket is connected at start-up (its own zmq context, so its term() waits for
    nothing else): prterun SIGKILLs what its SIGTERM did not end soon enough. A die on its way
    out marks its pid word negative first, so a host-mate does not report it dead.
    """
    zctx = zmq.Context()
    sock = zctx.socket(zmq.DEALER)
    sock.setsockopt_string(zmq.IDENTITY, f"b{st.me}")
    sock.linger = 300  # the bye leaves before term() returns (or the launcher is gone)
    sock.connect(st.endpoint)
    chan = Channel(st.key, f"b{st.me}")
    while os.read(rfd, 1) != bytes([signal.SIGTERM]):
        pass
    ctl = st.ctl
    with contextlib.suppress(Exception):
        if ctl is None:
            ctl = C.Control.attach(st.pod_id)
        ctl.words[C.W_DIE_PID + st.me] = -os.getpid()
    dead = [r for r in st.host_dies if r != st.me and not _runs(ctl, r)]
    gone = [r for r in st.machine_dies if r != st.me and not _runs(ctl, r)]
    for r in [st.me, *gone]:  # first: prterun SIGKILLs what outlives its SIGTERM for long
        unlink_segment(region_name(st.pod_id, r))
    if not [s for s in C.list_pods().get(st.pod_id, []) if not s.endswith((".ctl", ".run"))]:
        # the last one out (two at once is harmless): the run directory, the control segment
        shutil.rmtree(os.path.join("/dev/shm", C.run_dir_name(st.pod_id)), ignore_errors=True)
        unlink_segment(C.ctl_name(st.pod_id))
    with contextlib.suppress(Exception):
        sock.send_multipart(chan.pack("bye", die=st.me, dead=dead))
        sock.close()
        zctx.term()
    os._exit(0)


def _runs(ctl, r: int) -> bool:
    """Die r runs, or left in order (its pid word negative: it cleans up after itself)."""
    try:
        pid = ctl.words[C.W_DIE_PID + r]
    except Exception:  # noqa: BLE001 - no control segment: nobody to judge by
        return True
    return pid < 0 or C.pid_runs(pid)


if __name__ == "__main__":
    sys.exit(main())
