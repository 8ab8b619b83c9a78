"""The pod launcher: create the segments, start the dies, run SPMD functions, tear down.

```python
with Pod.launch(PodConfig(num_dies=4)) as pod:
    results = pod.run(fn, arg)      # fn(die, arg) on every die; list of results by die id
```

Lifecycle and the one teardown path:
1. launch: control segment first, then one region per die (owner-only, pod id in every name),
   then the die processes; wait until every die attached and said ready.
2. run: send `fn` and its args to every die over its private pipe (pickle never leaves the pod),
   wait on the pipes and on every die's process sentinel, so a crashed die is seen at once.
   The first error is re-raised with its die id and remote traceback; dies still waiting on
   the failed one are aborted (abort epoch in the control segment) after a short grace.
3. close (normal exit, exception, Ctrl-C, SIGTERM, a crashed die): stop the dies (pipe, then
   SIGTERM, then SIGKILL), reap them, unlink every region, unlink the control segment last.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import pickle
import platform
import secrets
import signal
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import wait as mp_wait
from typing import Any

from memory.errors import ConfigError, PodError, ShmError
from memory.region import Region, region_name
from runtime import control as C
from runtime.config import PodConfig
from runtime.die import die_main

log = logging.getLogger(__name__)

ABORT_GRACE_S = 0.5  # after a die's error, how long the others may finish before being aborted
STOP_GRACE_S = 2.0


class DieCrashed(PodError):
    """A die process exited while the pod was running; the pod has been torn down."""


def check_memory_model() -> None:
    """PROTOCOLS.md §3.2: publish order relies on total store order; refuse other CPUs."""
    machine = platform.machine().lower()
    if machine not in ("x86_64", "amd64", "i386", "i686"):
        raise ConfigError(
            f"this CPU ({machine}) does not guarantee total store order and xpod provides no"
            " fences; flags could become visible before their payloads. Run on x86-64."
        )


def _signal_name(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class _SigtermGuard:
    """SIGTERM -> SystemExit while any pod of this process is open, so `with` blocks tear down.

    One handler for all pods: installed when the first pod opens, the previous handler restored
    when the last one closes (pods may close in any order).
    """

    def __init__(self) -> None:
        self.pods: set[int] = set()
        self.previous = None

    def acquire(self, pod: Pod) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        if not self.pods:
            self.previous = signal.signal(signal.SIGTERM, _on_sigterm)
        self.pods.add(id(pod))

    def release(self, pod: Pod) -> None:
        if id(pod) not in self.pods or threading.current_thread() is not threading.main_thread():
            return
        self.pods.discard(id(pod))
        if not self.pods and self.previous is not None:
            signal.signal(signal.SIGTERM, self.previous)
            self.previous = None


def _on_sigterm(signum, frame):
    raise SystemExit(128 + signum)


_SIGTERM = _SigtermGuard()


class Pod:
    """A running pod. Build with `Pod.launch`; use as a context manager."""

    def __init__(self, config: PodConfig):
        self.config = config
        self.pod_id = secrets.token_hex(4)
        self.layout = config.layout()
        self.ctl: C.Control | None = None
        self.regions: list[Region] = []
        self.procs: list[Any] = []
        self.conns: list[Any] = []
        self.closed = False
        self.last_cpu_s: list[float] = []

    # -- launch ---------------------------------------------------------------------------------

    @classmethod
    def launch(cls, config: PodConfig | None = None, **overrides: Any) -> Pod:
        """Create the segments, start `config.num_dies` dies and wait until all are ready.

        Arguments:
            config: the pod configuration (default PodConfig()).
            overrides: PodConfig fields to change (`Pod.launch(num_dies=8)`).
        Raises:
            ConfigError for a bad configuration (before anything is created), ShmError if a
            segment cannot be created, PodError if a die fails to start.
        """
        config = config or PodConfig()
        if overrides:
            config = config.replace(**overrides)
        check_memory_model()
        pod = cls(config)
        try:
            pod._start()
        except BaseException:
            pod.close()
            raise
        return pod

    def _start(self) -> None:
        cfg = self.config
        self._install_sigterm()
        self.ctl = C.Control.create(self.pod_id, cfg.num_dies)
        for r in range(cfg.num_dies):
            self.regions.append(Region.create(region_name(self.pod_id, r), r, self.layout))
        ctx = mp.get_context(cfg.start_method)
        cfg_dict = cfg.to_dict()
        for r in range(cfg.num_dies):
            parent, child = ctx.Pipe()
            p = ctx.Process(
                target=die_main,
                args=(r, cfg_dict, self.pod_id, child, os.getpid()),
                name=f"xpod-{self.pod_id}-die{r}",
                daemon=True,
            )
            p.start()
            child.close()
            self.procs.append(p)
            self.conns.append(parent)
        self._wait_ready()

    def _wait_ready(self) -> None:
        pending = set(range(self.config.num_dies))
        deadline = time.monotonic() + self.config.ready_timeout_s
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                raise PodError(
                    f"pod {self.pod_id}: dies {sorted(pending)} not ready after"
                    f" {self.config.ready_timeout_s:g} s"
                )
            ready = mp_wait([self.conns[r] for r in pending], timeout=min(left, 0.5))
            for conn in ready:
                r = self.conns.index(conn)
                try:
                    msg = conn.recv()
                except EOFError:
                    self.procs[r].join(1.0)
                    raise PodError(
                        f"die {r} exited during start-up ({_signal_name(self.procs[r].exitcode)})"
                    ) from None
                if msg[0] == "err":
                    raise self._remote_error(r, msg)
                pending.discard(r)

    # -- run ------------------------------------------------------------------------------------

    def run(self, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None) -> list:
        """Run `fn(die, *args)` on every die at once (SPMD); return the results by die id.

        Arguments:
            fn: a module-level function (it is pickled by reference to the dies).
            args: picklable arguments, the same for every die.
            timeout_s: optional deadline for the whole call; the dies are aborted after it.
        Raises:
            the first die's exception (same type, `die_id` set, remote traceback in its notes);
            DieCrashed if a die process died (the pod is closed then).
        """
        if self.closed:
            raise PodError(f"pod {self.pod_id} is closed")
        n = self.config.num_dies
        epoch = self.ctl.words[C.W_ABORT]
        msg = ("run", fn, args, epoch)
        try:
            blob = pickle.dumps(msg)
        except (pickle.PicklingError, TypeError, AttributeError) as e:
            raise TypeError(
                f"pod.run: cannot send {fn!r} and its arguments to the dies: {e}"
            ) from e
        for conn in self.conns:
            conn.send_bytes(blob)
        return self._collect(n, timeout_s)

    def _collect(self, n: int, timeout_s: float | None) -> list:
        results: list[Any] = [None] * n
        cpu = [0.0] * n
        pending = set(range(n))
        first_err: BaseException | None = None
        err_at = 0.0
        aborted = False
        start = time.monotonic()
        sentinels = {p.sentinel: r for r, p in enumerate(self.procs)}
        while pending:
            ready = mp_wait([self.conns[r] for r in pending] + list(sentinels), timeout=0.2)
            for obj in ready:
                if obj in sentinels:
                    self._crashed(sentinels[obj])
                r = self.conns.index(obj)
                try:
                    reply = obj.recv()
                except (EOFError, OSError):
                    self._crashed(r)
                pending.discard(r)
                if reply[0] == "ok":
                    results[r], cpu[r] = reply[1], reply[2]
                elif first_err is None:
                    first_err, err_at = self._remote_error(r, reply), time.monotonic()
            now = time.monotonic()
            late = first_err is not None and now - err_at > ABORT_GRACE_S
            overdue = timeout_s is not None and now - start > timeout_s
            if pending and not aborted and (late or overdue):
                self.abort()
                aborted = True
                if overdue and first_err is None:
                    first_err = PodError(
                        f"pod.run: dies {sorted(pending)} still running after {timeout_s:g} s;"
                        " aborted"
                    )
        self.last_cpu_s = cpu
        if first_err is not None:
            self._resync()
            raise first_err
        return results

    def _resync(self) -> None:
        """After a failed run every die is idle: discard whatever was left in flight.

        Two phases, each on every die: first every DMA engine stops (a sender's engine could
        otherwise refill a ring its receiver has just emptied), then the counters are realigned.
        """
        for phase in (1, 2):
            self._broadcast(_resync_die, (phase,))

    def _broadcast(self, fn, args: tuple, timeout_s: float = 10.0) -> list:
        """Run an internal fn on every die and collect results (no abort, no resync)."""
        msg = pickle.dumps(("run", fn, args, self.ctl.words[C.W_ABORT]))
        for conn in self.conns:
            conn.send_bytes(msg)
        sentinels = {p.sentinel: r for r, p in enumerate(self.procs)}
        pending = set(range(len(self.conns)))
        results: list = [None] * len(self.conns)
        deadline = time.monotonic() + timeout_s
        while pending and time.monotonic() < deadline:
            for obj in mp_wait([self.conns[r] for r in pending] + list(sentinels), timeout=0.2):
                if obj in sentinels:
                    self._crashed(sentinels[obj])
                r = self.conns.index(obj)
                try:
                    results[r] = obj.recv()
                except (EOFError, OSError):
                    self._crashed(r)
                pending.discard(r)
        return results

    def abort(self) -> None:
        """Make every die's current wait raise PodAborted (bump the abort epoch)."""
        if self.ctl is not None:
            self.ctl.words[C.W_ABORT] = self.ctl.words[C.W_ABORT] + 1

    def _remote_error(self, r: int, reply: tuple) -> BaseException:
        _, blob, tb = reply
        try:
            err = pickle.loads(blob)
        except Exception as e:  # noqa: BLE001 - an exception class the launcher cannot rebuild
            err = PodError(f"die {r} raised an error that cannot be unpickled here: {e}")
        if not isinstance(err, BaseException):
            err = PodError(f"die {r} raised {err!r}")
        with contextlib.suppress(AttributeError):
            err.die_id = r
        err.add_note(f"--- raised on die {r}; remote traceback:\n{tb.rstrip()}")
        return err

    def _crashed(self, r: int) -> None:
        p = self.procs[r]
        p.join(1.0)
        pid, what = p.pid, _signal_name(p.exitcode)  # before close(), which closes the Process
        self.close()
        raise DieCrashed(
            f"die {r} (pid {pid}) died during pod.run: {what}; pod {self.pod_id} closed"
        )

    # -- teardown -------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop every die and unlink every segment. Safe to call more than once."""
        if self.closed:
            return
        self.closed = True
        try:
            self._stop_dies()
        finally:
            for region in self.regions:
                region.close()
                region.unlink()
            self.regions = []
            if self.ctl is not None:
                self.ctl.close()
                self.ctl.unlink()
            self._restore_sigterm()

    def _stop_dies(self) -> None:
        for conn in self.conns:
            try:
                conn.send(("stop",))
            except (OSError, ValueError):
                continue  # that die is already gone
        deadline = time.monotonic() + STOP_GRACE_S
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for sig_fn in ("terminate", "kill"):
            alive = [p for p in self.procs if p.is_alive()]
            if not alive:
                break
            for p in alive:
                getattr(p, sig_fn)()
            for p in alive:
                p.join(1.0)
        for conn in self.conns:
            conn.close()
        for p in self.procs:
            if p.exitcode is not None:
                p.close()

    def _install_sigterm(self) -> None:
        _SIGTERM.acquire(self)

    def _restore_sigterm(self) -> None:
        _SIGTERM.release(self)

    def __enter__(self) -> Pod:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- conveniences ---------------------------------------------------------------------------

    def region(self, die_id: int) -> Region:
        """The launcher's own mapping of a die's region (decode any field with it)."""
        return self.regions[die_id]

    def set_trace(self, enabled: bool) -> None:
        self.run(_set_trace, enabled)

    def trace_records(self, clear: bool = False) -> dict[int, list[tuple]]:
        """Every die's trace records, by die id."""
        return dict(enumerate(self.run(_get_trace, clear)))

    def write_trace(self, path: str, clear: bool = False) -> int:
        """Write every die's trace as Chrome trace JSON (Perfetto); returns the event count."""
        from comm.trace import write_chrome

        return write_chrome(path, self.trace_records(clear))

    def segment_names(self) -> list[str]:
        names = [region_name(self.pod_id, r) for r in range(self.config.num_dies)]
        return names + [C.ctl_name(self.pod_id)]

    def __repr__(self) -> str:
        state = "closed" if self.closed else "running"
        return f"Pod({self.pod_id}, {self.config.num_dies} dies, {state})"


def _resync_die(die, phase: int) -> int:
    from comm.p2p import resync

    if phase == 1:
        die.close()  # stop the DMA engine; a new one starts on demand
        return 0
    return resync(die)


def _set_trace(die, enabled: bool) -> None:
    die.trace.enabled = enabled


def _get_trace(die, clear: bool) -> list[tuple]:
    recs = die.trace.snapshot()
    if clear:
        die.trace.clear()
    return recs


__all__ = ["DieCrashed", "Pod", "ShmError", "check_memory_model"]
