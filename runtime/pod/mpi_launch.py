"""The launcher of a pod over several hosts (`PodConfig.fabric_kind == "mpi"`, MULTIHOST.md §5).

```python
with Pod.launch(PodConfig(num_dies=4, hosts=(0, 0, 1, 1))) as pod:   # -> an MpiPod
    results = pod.run(fn, arg)
```

The launcher is not an MPI rank. It binds a zmq ROUTER (127.0.0.1 for emulated hosts, the
address of `net_if` for real ones) and runs `mpirun` with the flags MULTIHOST §2 verified;
every rank is a die (`runtime.pod.die_mpi`, rank = die id) that connects a DEALER back. The
leader of each host (its lowest rank) makes that host's regions (the lowest rank of each
machine its control segment) and connects a second DEALER ("a<host>") served by a thread:
aborts, kills and reports of stopped dies go through it while the dies run. Once they are
ready, the launcher lists the listening sockets of mpirun's process tree on its machine and
logs one warning naming those a network other than loopback and `net_if` reaches: Open MPI
binds btl/tcp's and PRRTE's oob/tcp listeners to every address (docs/architecture.md §7).

The control channel (`runtime.pod.die_mpi.Channel`): every frame both ways is HMAC-SHA256
signed with a per-pod random key that reaches the dies only through mpirun's environment
(`-x XPOD_KEY`, never the command line); a frame that fails the MAC, version, sender or
sequence check is dropped and logged. Pickles only travel inside signed frames.

Teardown: `close` aborts, sends stop (the dies free their windows, finalize, and each host
leader unlinks its host's segments), waits for mpirun, then SIGTERM, then SIGKILL. A die that
dies: prterun SIGTERMs the others, each sends `bye(die, dead same-host dies)` and unlinks its
own and the dead dies' regions; the launcher raises `DieCrashed` naming the dies that never
said bye (the byes' reports let it decide before mpirun exits), and removes what is left
(locally for emulated hosts, with an epilogue `mpirun ... xpod clean --pod ID` on every real
host). mpirun gets SIGTERM when the launcher dies (PR_SET_PDEATHSIG) and takes the dies with
it.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import pickle
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from memory.errors import PodError
from memory.region import region_name
from runtime.pod import control as C
from runtime.pod.common import (
    ABORT_GRACE_S,
    ABORT_REPLY_S,
    SIGTERM_GUARD,
    DieCrashed,
    DieHung,
    PodApi,
    resync_die,
    root_error,
)
from runtime.pod.config import PodConfig
from runtime.pod.die_mpi import (
    Channel,
    bind_address,
    endpoint,
    exposed,
    find_mpirun,
    listeners,
    mpirun_command,
)
from runtime.pod.proc import parent_death_signal

log = logging.getLogger(__name__)

STOP_GRACE_S = 10.0  # close(): how long mpirun may take to finalize every die
BUSY_GRACE_S = 1.0  # the same when dies are busy, crashed or hung
CRASH_VERDICT_S = 1.5  # after the first sign of a crash, how long byes may take to arrive
POLL_S = 0.05
STATE_EVERY_S = 1.0


# -- mpirun ---------------------------------------------------------------------------------------


def _pdeathsig() -> None:  # preexec_fn of mpirun: it dies with the launcher
    parent_death_signal(signal.SIGTERM)


# -- the pod ---------------------------------------------------------------------------------------


class MpiPod(PodApi):
    """A running multi-host pod: the interface of `runtime.pod.Pod` (run, abort, close, ...)."""

    def __init__(self, config: PodConfig, pod_id: str | None = None):
        self.config = config
        self.pod_id = pod_id or secrets.token_hex(4)
        self.layout = config.layout()
        self.closed = False
        self.last_cpu_s: list[float] = []
        n = config.num_dies
        self.hosts = list(config.hosts) or [0] * n
        self.leaders = {h: self.hosts.index(h) for h in sorted(set(self.hosts))}
        self.pids = [0] * n
        self.procs: list = []  # [mpirun]: this launcher's only child (a Pod's: its dies)
        self._mapped: dict = {}  # die -> Region the launcher attached (`region`)
        self.mpirun: subprocess.Popen | None = None
        self.tail: collections.deque[str] = collections.deque(maxlen=40)
        self.notice: str | None = None  # prterun's line about a dead rank
        self.byes: dict[int, list[int]] = {}
        self.stopped: dict[int, float] = {}  # die -> first seen stopped (monotonic)
        self._epoch = 0
        self._acks: set[int] = set()  # hosts that have not yet acknowledged the last abort
        self._running = False
        self._ctx: zmq.Context | None = None
        self._sock = None
        self._chan = Channel(b"", "launcher")
        self._readers: list[threading.Thread] = []
        self.timings: dict[str, float] = {}
        self.exposed: list[tuple[str, str, int]] = []  # (process, address, port): §7's warning

    # -- launch ---------------------------------------------------------------------------------

    @classmethod
    def launch(cls, config: PodConfig, pod_id: str | None = None) -> MpiPod:
        """Start mpirun with `config.num_dies` dies and wait until every die is ready.

        Raises:
            PodError if mpi4py or mpirun is missing, if mpirun fails or a die fails to start
            (with mpirun's last lines of output), or if the dies are not ready in time.
        """
        pod = cls(config, pod_id)
        try:
            pod._start()
        except BaseException:
            pod.close(fast=True)
            raise
        return pod

    def _start(self) -> None:
        t0 = time.monotonic()
        cfg = self.config
        mpirun = find_mpirun()
        SIGTERM_GUARD.acquire(self)
        key = secrets.token_bytes(32)
        self._chan = Channel(key, "launcher")
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.linger = 0
        self._sock.bind(f"tcp://{bind_address(cfg)}:0")
        endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        env = dict(os.environ)
        env.update(
            XPOD_POD=self.pod_id,
            XPOD_LAUNCHER=endpoint,
            XPOD_KEY=key.hex(),
            XPOD_CONFIG=json.dumps(cfg.to_dict()),
            PYTHONPATH=os.pathsep.join(p for p in sys.path if p),
            PYTHONUNBUFFERED="1",
            # PMIx's gds/shmem2 leaves a 16 MiB /dev/shm/sm_segment.* behind per mpirun
            # (open-mpi/ompi#11543 suggests the hash store for Open MPI 5)
            PMIX_MCA_gds="hash",
        )
        names = ["XPOD_POD", "XPOD_LAUNCHER", "XPOD_KEY", "XPOD_CONFIG", "PYTHONPATH",
                 "PYTHONUNBUFFERED"]  # fmt: skip
        if not cfg.host_names:
            # Open MPI's built-in shared-memory BTL makes a segment at init even though the
            # pod runs self,tcp; a die killed before it is unlinked would leave it in /dev/shm.
            # It goes into the pod's run directory, which the teardown (or `xpod clean`) removes.
            run_dir = os.path.join("/dev/shm", C.run_dir_name(self.pod_id))
            os.makedirs(run_dir, mode=0o700, exist_ok=True)
            env["OMPI_MCA_btl_sm_backing_directory"] = run_dir
            counts = collections.Counter(self.hosts)
            env["XPOD_HOSTS"] = ",".join(str(counts[h]) for h in sorted(counts))
            names.append("XPOD_HOSTS")
        for opt in ("XPOD_MPI_POISON",):
            if opt in env:
                names.append(opt)
        exports = [a for name in names for a in ("-x", name)]
        cmd = mpirun_command(cfg, mpirun, exports + [sys.executable, "-m", "runtime.pod.die_mpi"])
        self.mpirun = subprocess.Popen(
            cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, preexec_fn=_pdeathsig, start_new_session=True,
        )  # fmt: skip
        self.procs = [self.mpirun]
        for stream, out in ((self.mpirun.stdout, sys.stdout), (self.mpirun.stderr, sys.stderr)):
            t = threading.Thread(target=self._read, args=(stream, out), daemon=True)
            t.start()
            self._readers.append(t)
        self._wait_ready()
        self._warn_exposed()
        self.timings["launch_s"] = time.monotonic() - t0

    def _warn_exposed(self) -> None:
        """One warning line naming the listening sockets of mpirun and its local children
        that a network other than loopback and `net_if` reaches (docs/architecture.md §7)."""
        import psutil

        try:
            kids = psutil.Process(self.mpirun.pid).children(recursive=True)
        except psutil.Error:
            return
        dies = {p: r for r, p in enumerate(self.pids)}  # real hosts: only this machine's are kids
        names = {self.mpirun.pid: "prterun"}
        for p in sorted(kids, key=lambda p: dies.get(p.pid, -1)):
            names[p.pid] = f"die {dies[p.pid]}" if p.pid in dies else f"pid {p.pid}"
        found = listeners(names)
        self.exposed = exposed(found, self.config.net_if)
        if not self.exposed:
            return
        by: dict[str, list[str]] = {}
        for who, address, port in sorted(self.exposed, key=lambda e: ":" in e[1]):
            by.setdefault(who, []).append(endpoint(address, port))
        where = "; ".join(f"{who} {' '.join(eps)}" for who, eps in by.items())
        log.warning(
            "pod %s: MPI listens beyond --net-if %s (Open MPI binds these to every address): %s;"
            " keep other networks off them with a firewall rule or a network namespace"
            " (docs/architecture.md §7)", self.pod_id, self.config.net_if or "lo", where,
        )  # fmt: skip

    def _read(self, stream, out) -> None:
        """Echo mpirun's output (the dies' prints; not Open MPI's banner that osc/rdma is not
        tested after failures), keep its tail and prterun's crash line."""
        banner: list[str] | None = None
        for raw in iter(stream.readline, b""):
            line = raw.decode(errors="replace")
            self.tail.append(line.rstrip())
            if "noticed that process rank" in line and self.notice is None:
                self.notice = line.strip()
            if not line.strip(" \0\n") or "help-mpi-ft.txt" in line:
                continue  # prterun's NUL line, its count of FT banners
            if line.startswith("-----"):
                if banner is None:
                    banner = [line]
                    continue
                lines, banner = banner + [line], None
                if any("post-failure" in ln for ln in lines):
                    continue
            elif banner is not None:
                banner.append(line)
                continue
            else:
                lines = [line]
            with contextlib.suppress(ValueError, OSError):
                out.write("".join(lines))
        stream.close()

    def _tail_text(self) -> str:
        lines = [ln for ln in self.tail if ln.strip() and set(ln.strip()) != {"-"}]
        return "\n".join(lines[-12:]) or "(no output)"

    def _wait_ready(self) -> None:
        pending = set(range(self.config.num_dies))
        watchers = set(self.leaders)
        deadline = time.monotonic() + self.config.ready_timeout_s
        while pending or watchers:
            if time.monotonic() > deadline:
                raise PodError(
                    f"pod {self.pod_id}: dies {sorted(pending)} not ready after"
                    f" {self.config.ready_timeout_s:g} s; mpirun says:\n{self._tail_text()}"
                )
            for _, kind, f in self._poll(0.1):
                if kind == "ready":
                    self.pids[f["die"]] = f["pid"]
                    pending.discard(f["die"])
                elif kind == "watch":
                    watchers.discard(f["host"])
                elif kind == "err":
                    raise self._remote_error(f)
            if self.mpirun.poll() is not None:
                time.sleep(0.1)  # the readers' last lines
                raise PodError(
                    f"pod {self.pod_id}: mpirun exited during start-up (code"
                    f" {self.mpirun.returncode}); dies {sorted(pending)} not ready; mpirun"
                    f" says:\n{self._tail_text()}"
                )

    # -- messages --------------------------------------------------------------------------------

    def _send(self, to: str, kind: str, **fields: Any) -> None:
        with contextlib.suppress(zmq.ZMQError):
            self._sock.send_multipart([to.encode(), *self._chan.pack(kind, **fields)])

    def _poll(self, timeout_s: float) -> list[tuple]:
        """Authenticated messages that arrived within `timeout_s`; byes, abort acks and
        stopped-die reports are recorded here, the rest returned."""
        out = []
        if not self._sock.poll(int(timeout_s * 1000)):
            return out
        while True:
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return out
            ident = frames[0].decode(errors="replace")
            msg = self._chan.unpack(frames[1:], ident)
            if msg is None:
                continue
            name, kind, f = msg
            if kind == "bye":
                self.byes[f["die"]] = list(f["dead"])
            elif kind == "aborted":
                self._acks.discard(f["host"])
            elif kind == "stopped":
                now = time.monotonic()
                seen = set(f["dies"])
                for d in [d for d in self.stopped if self.hosts[d] == f["host"] and d not in seen]:
                    del self.stopped[d]
                for d in seen:
                    self.stopped.setdefault(d, now)
            else:
                out.append(msg)

    def _crash_sign(self) -> bool:
        return bool(self.byes) or self.mpirun is None or self.mpirun.poll() is not None

    # -- run ------------------------------------------------------------------------------------

    def run(self, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None,
            abort_grace_s: float = ABORT_GRACE_S) -> list:  # fmt: skip
        """Run `fn(die, *args)` on every die at once (SPMD); return the results by die id.

        As `Pod.run`: `fn` must be importable by the dies (it is pickled by reference; the
        dies get the launcher's sys.path). Raises the root die's exception (die_id set, the
        remote traceback as a note), DieCrashed if a die died, DieHung if one stopped.
        """
        if self.closed:
            raise PodError(f"pod {self.pod_id} is closed")
        bad = not isinstance(timeout_s, int | float) or isinstance(timeout_s, bool)
        if timeout_s is not None and (bad or not 0 < timeout_s < float("inf")):
            raise ValueError(f"pod.run: timeout_s {timeout_s!r} must be None or seconds > 0")
        try:
            blob = pickle.dumps((fn, args))
        except (pickle.PicklingError, TypeError, AttributeError) as e:
            raise TypeError(
                f"pod.run: cannot send {fn!r} and its arguments to the dies: {e}"
            ) from e
        self._send_run(blob, "while the pod was idle (found at the next pod.run)")
        self._running = True
        return self._collect(timeout_s, abort_grace_s)

    def _send_run(self, blob: bytes, when: str) -> None:
        self._poll(0)
        if self._crash_sign():
            self._crashed(when)
        deadline = time.monotonic() + ABORT_REPLY_S
        while self._acks and time.monotonic() < deadline:  # the last abort reached every host
            self._poll(POLL_S)
        for r in range(self.config.num_dies):
            self._send(f"d{r}", "run", blob=blob, epoch=self._epoch)

    def _collect(self, timeout_s: float | None, grace_s: float, internal: bool = False) -> list:
        n = self.config.num_dies
        results: list[Any] = [None] * n
        cpu = [0.0] * n
        errors: list[tuple[int, BaseException]] = []
        pending = set(range(n))
        start = time.monotonic()
        first_err_at = aborted_at = None
        overdue_err = None
        states_at = start
        while pending:
            for _, kind, f in self._poll(POLL_S):
                r = f.get("die")
                if kind == "ok" and r in pending:
                    pending.discard(r)
                    results[r], cpu[r] = pickle.loads(f["result"]), f["cpu"]
                elif kind == "err" and r in pending:
                    pending.discard(r)
                    errors.append((r, self._remote_error(f)))
            if not pending:
                break
            if self._crash_sign():
                self._crashed("during pod.run" if not internal else "in a resync")
            now = time.monotonic()
            if errors and first_err_at is None:
                first_err_at = now
            late = first_err_at is not None and now - first_err_at >= grace_s
            overdue = timeout_s is not None and now - start > timeout_s
            if aborted_at is None and (late or overdue):
                if internal:
                    self._hung(sorted(pending), f"did not answer within {timeout_s:g} s")
                self.abort()
                aborted_at = now
                if overdue and not errors:
                    overdue_err = PodError(
                        f"pod.run: dies {sorted(pending)} still running after"
                        f" {timeout_s:g} s; aborted"
                    )
            cause = errors[0][1] if errors else overdue_err
            if aborted_at is not None and now - aborted_at > ABORT_REPLY_S:
                self._hung(
                    sorted(pending), f"did not answer the abort within {ABORT_REPLY_S:g} s", cause
                )
            if now - states_at >= STATE_EVERY_S:
                states_at = now
                self._check_stopped(pending, cause)
        self._running = False
        if internal:
            return results
        self.last_cpu_s = cpu
        if errors or overdue_err is not None:
            err = root_error(errors, overdue_err)
            self._resync()
            raise err
        return results

    def _check_stopped(self, pending: set[int], cause) -> None:
        """DieHung for a die stopped (SIGSTOP) longer than the pod's timeout_s. Emulated hosts:
        the launcher reads the states itself (a stopped host leader cannot report)."""
        now = time.monotonic()
        if not self.config.host_names:
            import psutil

            for r in range(self.config.num_dies):
                try:
                    stopped = psutil.Process(self.pids[r]).status() in ("stopped", "tracing-stop")
                except psutil.Error:
                    stopped = False
                if stopped:
                    self.stopped.setdefault(r, now)
                else:
                    self.stopped.pop(r, None)
        limit = self.config.timeout_s
        late = [r for r, t in self.stopped.items() if r in pending and now - t > limit]
        if late:
            self._hung(sorted(late), f"stayed stopped for more than {limit:g} s", cause)

    def _resync(self) -> None:
        """After a failed run every die is idle: discard what was left in flight (as Pod)."""
        self._broadcast(resync_die, (1, None))
        counters = [c for c in self._broadcast(resync_die, (2, None)) if c]
        if counters:
            top = [max(col) for col in zip(*counters, strict=True)]
            self._broadcast(resync_die, (3, top))

    def _broadcast(self, fn, args: tuple, timeout_s: float = 10.0) -> list:
        """Run an internal fn on every idle die (no abort, no resync); DieHung past timeout_s."""
        self._send_run(pickle.dumps((fn, args)), "in a resync")
        self._running = True
        return self._collect(timeout_s, ABORT_GRACE_S, internal=True)

    def abort(self) -> None:
        """Make every die's current wait raise PodAborted: a new abort epoch to every host
        leader, which stores it in its host's control segment."""
        if self._sock is None or self.closed:
            return
        self._epoch += 1
        self._acks = set(self.leaders)
        for h in self.leaders:
            self._send(f"a{h}", "abort", epoch=self._epoch)

    def _remote_error(self, f: dict) -> BaseException:
        r = f["die"]
        try:
            err = pickle.loads(f["error"])
        except Exception as e:  # noqa: BLE001 - an exception class the launcher cannot rebuild
            err = PodError(f"die {r} raised an error that cannot be unpickled here: {e}")
        if not isinstance(err, BaseException):
            err = PodError(f"die {r} raised {err!r}")
        with contextlib.suppress(AttributeError):
            err.die_id = r
        err.add_note(f"--- raised on die {r}; remote traceback:\n{f['tb'].rstrip()}")
        return err

    # -- failures ---------------------------------------------------------------------------------

    def _verdict(self) -> list[int]:
        """After a crash sign: wait for mpirun to exit (the survivors' byes come first), then
        the dead: those reported dead by a host-mate plus those that never said bye."""
        t0 = time.monotonic()
        deadline = t0 + CRASH_VERDICT_S
        n = self.config.num_dies
        while time.monotonic() < deadline:
            self._poll(POLL_S)
            reported = {d for dead in self.byes.values() for d in dead}
            if len(set(self.byes) | reported) == n or self.mpirun.poll() is not None:
                break
        if self.mpirun.poll() is not None:
            self._poll(0.05)  # byes still in flight
        reported = {d for dead in self.byes.values() for d in dead}
        return sorted(set(range(n)) - set(self.byes))

    def _crashed(self, when: str) -> None:
        dead = self._verdict()
        what = ", ".join(f"die {r} (pid {self.pids[r]}, host {self.hosts[r]})" for r in dead)
        self.close(fast=True)
        err = DieCrashed(f"{what or 'a die'} died {when}; pod {self.pod_id} closed")
        err.die_id = dead[0] if dead else None
        err.dies = dead
        if self.notice:
            err.add_note(self.notice)
        raise err

    def _hung(self, dies: list[int], why: str, cause: BaseException | None = None) -> None:
        """Kill the dies that stopped answering (mpirun then ends the others), close the pod,
        raise DieHung naming them."""
        for r in dies:
            if self.config.host_names:
                self._send(f"a{self.hosts[r]}", "kill", die=r)
            else:
                with contextlib.suppress(OSError):
                    os.kill(self.pids[r], signal.SIGKILL)
        what = ", ".join(f"die {r} (pid {self.pids[r]})" for r in dies)
        self.close(fast=True)
        err = DieHung(f"{what} {why}; killed; pod {self.pod_id} closed")
        err.die_id = dies[0]
        raise err from cause

    # -- teardown -------------------------------------------------------------------------------

    def close(self, fast: bool = False) -> None:
        """Stop every die, wait for mpirun, remove every segment left. Safe to call twice."""
        if self.closed:
            return
        self.closed = True
        t0 = time.monotonic()
        crashed = False
        try:
            p = self.mpirun
            if p is not None and p.poll() is None:
                self.abort()
                for r in range(self.config.num_dies):
                    self._send(f"d{r}", "stop")
                grace = BUSY_GRACE_S if (fast or self._running) else STOP_GRACE_S
                crashed = not _wait(p, grace)
                for sig in (signal.SIGTERM, signal.SIGKILL):
                    if p.poll() is None:
                        with contextlib.suppress(OSError):
                            p.send_signal(sig)
                        _wait(p, 2.0)
            crashed = crashed or (p is not None and p.returncode not in (0, None))
        finally:
            for r in self._mapped.values():
                r.close()
            self._mapped = {}
            for t in self._readers:
                t.join(2.0)
            if self._sock is not None:
                self._sock.close(linger=0)
                self._ctx.term()
                self._sock = None
            self._cleanup(crashed)
            SIGTERM_GUARD.release(self)
            self.timings["close_s"] = time.monotonic() - t0

    def _cleanup(self, crashed: bool) -> None:
        """Every die is gone: remove what no die removed (a whole lost host, say)."""
        if not self.config.host_names:
            C.remove_pod(self.pod_id)
        elif crashed and self.mpirun is not None:
            hosts = ",".join(f"{h}:1" for h in self.config.host_names)
            cmd = mpirun_command(
                self.config.replace(
                    num_dies=len(self.config.host_names),
                    hosts=tuple(range(len(self.config.host_names))),
                    die_cpus=(),
                ),
                find_mpirun(),
                [sys.executable, "-m", "runtime.cli", "clean", "--pod", self.pod_id],
            )
            cmd[cmd.index("--map-by") + 1] = "ppr:1:node"
            if "--host" in cmd:
                cmd[cmd.index("--host") + 1] = hosts
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                subprocess.run(cmd, capture_output=True, timeout=30, check=False)

    # -- conveniences ---------------------------------------------------------------------------

    def region(self, die_id: int):
        """The launcher's mapping of a die's region, for control-plane reads (stats, the
        serving engine's words): every host is this machine (emulated hosts) or PodError."""
        if self.config.host_names:
            raise PodError(
                "a pod over real hosts: the launcher maps no region (read it inside pod.run)"
            )
        if self.closed:
            raise PodError(f"pod {self.pod_id} is closed")
        r = self._mapped.get(die_id)
        if r is None:
            from memory.region import Region, RegionHandle

            handle = RegionHandle(region_name(self.pod_id, die_id), die_id)
            r = self._mapped[die_id] = Region.attach(handle, self.layout)
        return r

    def __repr__(self) -> str:
        state = "closed" if self.closed else "running"
        return f"MpiPod({self.pod_id}, {self.config.num_dies} dies, {state})"


def _wait(p: subprocess.Popen, timeout_s: float) -> bool:
    try:
        p.wait(timeout_s)
    except subprocess.TimeoutExpired:
        return False
    return True


__all__ = ["MpiPod", "bind_address"]
