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
   The root error (a die's own error, not a peer's `PodAborted` / `PeerRefused` consequence of
   it) is re-raised with its die id and remote traceback; dies still waiting are aborted (abort
   epoch in the control segment) after a short grace. A die that does not answer the abort
   within `ABORT_REPLY_S`, or that stays stopped (SIGSTOP) longer than `timeout_s`, is hung: it
   is killed, the pod is closed and `DieHung` names it.
3. close (normal exit, exception, Ctrl-C, SIGTERM, a crashed or hung die): abort every wait,
   stop the dies (pipe, then SIGKILL after a grace), reap them, unlink every region, unlink the
   control segment last.
A launcher killed with SIGKILL cannot tear down: its dies get SIGTERM from the kernel
(PR_SET_PDEATHSIG), see that their launcher is gone, unlink their own regions, and the last one
out unlinks the control segment (`runtime.pod.die`).
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
import time
from collections.abc import Callable
from multiprocessing.connection import wait as mp_wait
from typing import Any

import psutil

from memory.errors import ConfigError, PodError, ShmError
from memory.region import Region, region_name
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
from runtime.pod.die import die_main

log = logging.getLogger(__name__)

STOP_GRACE_S = 2.0  # close(): how long idle dies may take to exit before SIGKILL
CRASH_GRACE_S = 0.1  # the same when a die crashed or hung (the others were just aborted)
POLL_S = 0.1  # run() wakes at least this often to check its deadlines
STATE_EVERY_S = 1.0  # and reads the pending dies' process states (stopped?) this often: the
# limit is the pod's timeout_s; at 4 Hz it was most of an idle serving shell's CPU


def check_memory_model() -> None:
    """docs/protocols.md §3.2: publish order relies on total store order; refuse other CPUs."""
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


class Pod(PodApi):
    """A running pod. Build with `Pod.launch`; use as a context manager."""

    def __init__(self, config: PodConfig, pod_id: str | None = None):
        self.config = config
        self.pod_id = pod_id or secrets.token_hex(4)
        self.layout = config.layout()
        self.ctl: C.Control | None = None
        self.regions: list[Region] = []
        self.procs: list[Any] = []
        self.conns: list[Any] = []
        self.closed = False
        self._running = False  # inside run(): the dies are busy with the caller's function
        self.last_cpu_s: list[float] = []

    # -- launch ---------------------------------------------------------------------------------

    @classmethod
    def launch(cls, config: PodConfig | None = None, pod_id: str | None = None,
               **overrides: Any) -> Pod:  # fmt: skip
        """Create the segments, start `config.num_dies` dies and wait until all are ready.

        Arguments:
            config: the pod configuration (default PodConfig()).
            pod_id: the id of a closed pod to launch again under (a serving engine's restart
                keeps its run directory); default a new random one.
            overrides: PodConfig fields to change (`Pod.launch(num_dies=8)`).
        Raises:
            ConfigError for a bad configuration (before anything is created), ShmError if a
            segment cannot be created, PodError if a die fails to start.
        """
        config = config or PodConfig()
        if overrides:
            config = config.replace(**overrides)
        check_memory_model()
        if config.fabric_kind == "mpi":  # dies on several hosts: mpirun, MPI RMA
            from runtime.pod.mpi_launch import MpiPod

            return MpiPod.launch(config, pod_id)  # type: ignore[return-value]
        if config.a2a_max_batch:
            from comm import kernels

            kernels.warm()  # compiled once here (or loaded from the disk cache): dies fork with it
        if pod_id is not None and (
            not isinstance(pod_id, str)
            or C.list_pods().get(pod_id)
            and f"xpod.{pod_id}.ctl" in C.list_pods()[pod_id]
        ):
            raise PodError(f"pod id {pod_id!r}: in use (or not a str)")
        pod = cls(config, pod_id)
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

    def run(self, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None,
            abort_grace_s: float = ABORT_GRACE_S) -> list:  # fmt: skip
        """Run `fn(die, *args)` on every die at once (SPMD); return the results by die id.

        Arguments:
            fn: a module-level function (it is pickled by reference to the dies).
            args: picklable arguments, the same for every die.
            timeout_s: optional deadline for the whole call; the dies are aborted after it.
            abort_grace_s: after a die's error, how long the others may finish before they are
                aborted (0: at once, as an iteration rollback wants).
        Raises:
            the root die's exception (same type, `die_id` set, remote traceback and the other
            dies' errors in its notes); DieCrashed if a die process died, DieHung if one stopped
            answering (the pod is closed then).
        """
        if self.closed:
            raise PodError(f"pod {self.pod_id} is closed")
        bad = not isinstance(timeout_s, int | float) or isinstance(timeout_s, bool)
        if timeout_s is not None and (bad or not 0 < timeout_s < float("inf")):
            raise ValueError(f"pod.run: timeout_s {timeout_s!r} must be None or seconds > 0")
        n = self.config.num_dies
        epoch = self.ctl.words[C.W_ABORT]
        msg = ("run", fn, args, epoch)
        try:
            blob = pickle.dumps(msg)
        except (pickle.PicklingError, TypeError, AttributeError) as e:
            raise TypeError(
                f"pod.run: cannot send {fn!r} and its arguments to the dies: {e}"
            ) from e
        self._send_all(blob, "while the pod was idle (found at the next pod.run)")
        self._running = True  # until every die has answered (not if Ctrl-C ends the wait)
        return self._collect(n, timeout_s, abort_grace_s)

    def _send_all(self, blob: bytes, when: str) -> None:
        """Send one message to every die; a die found dead is DieCrashed (pod closed)."""
        for r, p in enumerate(self.procs):
            if not p.is_alive():
                self._crashed(r, when)
        for r, conn in enumerate(self.conns):
            try:
                conn.send_bytes(blob)
            except OSError:  # BrokenPipeError / ConnectionResetError: that die is gone
                self._crashed(r, when)

    def _collect(self, n: int, timeout_s: float | None, grace_s: float = ABORT_GRACE_S) -> list:
        results: list[Any] = [None] * n
        cpu = [0.0] * n
        errors: list[tuple[int, BaseException]] = []
        watch = _Watch(self, timeout_s, grace_s)
        while watch.pending:
            for r, reply in self._replies(watch.pending, POLL_S, "during pod.run"):
                watch.pending.discard(r)
                if reply[0] == "ok":
                    results[r], cpu[r] = reply[1], reply[2]
                else:
                    errors.append((r, self._remote_error(r, reply)))
            watch.step(errors)
        self._running = False
        self.last_cpu_s = cpu
        if errors or watch.overdue_err is not None:
            err = root_error(errors, watch.overdue_err)
            self._resync()
            raise err
        return results

    def _replies(self, pending: set[int], timeout: float, when: str):
        """(die, reply) for every die of `pending` that answered within `timeout`; a dead die
        (its sentinel fires, or its pipe breaks) is DieCrashed at once."""
        sentinels = {self.procs[r].sentinel: r for r in pending}
        ready = mp_wait([self.conns[r] for r in pending] + list(sentinels), timeout=timeout)
        out = []
        for obj in ready:
            if obj in sentinels:
                r = sentinels[obj]
                if self.conns[r].poll():  # it answered, then exited: take the answer first
                    continue
                self._crashed(r, when)
        for obj in ready:
            if obj in sentinels:
                continue
            r = self.conns.index(obj)
            try:
                out.append((r, obj.recv()))
            except (EOFError, OSError):
                self._crashed(r, when)
        return out

    def _hung(self, dies: list[int], why: str, cause: BaseException | None = None) -> None:
        """Kill the dies that stopped answering, close the pod, raise DieHung naming them."""
        what = []
        for r in dies:
            p = self.procs[r]
            what.append(f"die {r} (pid {p.pid}, {_proc_state(p.pid)})")
            with contextlib.suppress(OSError):
                os.kill(p.pid, signal.SIGKILL)
        self.close(fast=True)
        err = DieHung(f"{', '.join(what)} {why}; killed; pod {self.pod_id} closed")
        err.die_id = dies[0]
        raise err from cause

    def _resync(self) -> None:
        """After a failed run every die is idle: discard whatever was left in flight.

        Three phases, each on every die: first every DMA engine stops (a sender's engine could
        otherwise refill a ring its receiver has just emptied), then the p2p counters are
        realigned and each die reports its all-to-all operation numbers, then every die takes
        the maximum of each (a die that failed mid-collective may be one behind its peers).
        """
        self._broadcast(resync_die, (1, None))
        counters = [c for c in self._broadcast(resync_die, (2, None)) if c]
        if counters:
            top = [max(col) for col in zip(*counters, strict=True)]
            self._broadcast(resync_die, (3, top))

    def _broadcast(self, fn, args: tuple, timeout_s: float = 10.0) -> list:
        """Run an internal fn on every (idle) die and collect results (no abort, no resync); a
        die that does not answer within `timeout_s`, or is stopped for ABORT_REPLY_S, is hung."""
        self._send_all(pickle.dumps(("run", fn, args, self.ctl.words[C.W_ABORT])), "in a resync")
        pending = set(range(len(self.conns)))
        results: list = [None] * len(self.conns)
        start = time.monotonic()
        stopped: dict[int, float] = {}
        while pending:
            now = time.monotonic()
            if now - start > timeout_s:
                self._hung(sorted(pending), f"did not answer the launcher within {timeout_s:g} s")
            for r in pending:
                if _proc_state(self.procs[r].pid) in ("stopped", "tracing-stop"):
                    if now - stopped.setdefault(r, now) > ABORT_REPLY_S:
                        self._hung([r], f"stayed stopped during a resync for {ABORT_REPLY_S:g} s")
                else:
                    stopped.pop(r, None)
            for r, reply in self._replies(pending, POLL_S, "in a resync"):
                pending.discard(r)
                results[r] = reply[1] if reply[0] == "ok" else None
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

    def _crashed(self, r: int, when: str = "during pod.run") -> None:
        p = self.procs[r]
        p.join(1.0)
        pid, what = p.pid, _signal_name(p.exitcode)  # before close(), which closes the Process
        self.close(fast=True)
        err = DieCrashed(f"die {r} (pid {pid}) died {when}: {what}; pod {self.pod_id} closed")
        err.die_id = r
        raise err

    # -- teardown -------------------------------------------------------------------------------

    def close(self, fast: bool = False) -> None:
        """Stop every die and unlink every segment. Safe to call more than once.

        `fast` (a die crashed or hung): the others get CRASH_GRACE_S instead of STOP_GRACE_S
        to exit before SIGKILL."""
        if self.closed:
            return
        self.closed = True
        try:
            # Dies inside a run (Ctrl-C or SIGTERM of the launcher mid-run) read the stop only
            # after their function returns, so a long grace only delays their SIGKILL.
            busy = fast or self._running
            self._stop_dies(CRASH_GRACE_S if busy else STOP_GRACE_S)
        finally:
            for region in self.regions:
                region.close()
                region.unlink()
            self.regions = []
            if self.ctl is not None:
                self.ctl.close()
                self.ctl.unlink()
            self._restore_sigterm()

    def _stop_dies(self, grace_s: float) -> None:
        # Abort first: a die blocked in a wait (on a crashed peer, say) reads the pipe only
        # after its wait ends; the abort word ends it within a few polls.
        self.abort()
        for conn in self.conns:
            try:
                conn.send(("stop",))
            except (OSError, ValueError):
                continue  # that die is already gone
        deadline = time.monotonic() + grace_s
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        alive = [p for p in self.procs if p.is_alive()]
        for p in alive:  # SIGKILL: a stopped or stuck die ignores anything gentler
            p.kill()
        for p in alive:
            p.join(5.0)
        for conn in self.conns:
            conn.close()
        for p in self.procs:
            if p.exitcode is not None:
                p.close()

    def _install_sigterm(self) -> None:
        SIGTERM_GUARD.acquire(self)

    def _restore_sigterm(self) -> None:
        SIGTERM_GUARD.release(self)

    # -- conveniences ---------------------------------------------------------------------------

    def region(self, die_id: int) -> Region:
        """The launcher's own mapping of a die's region (decode any field with it)."""
        return self.regions[die_id]

    def __repr__(self) -> str:
        state = "closed" if self.closed else "running"
        return f"Pod({self.pod_id}, {self.config.num_dies} dies, {state})"


class _Watch:
    """The deadlines of one `pod.run`: the abort after the first error (ABORT_GRACE_S) or after
    `timeout_s`, the answer to the abort (ABORT_REPLY_S), and dies stopped longer than the
    pod's timeout_s. `step` raises DieHung (through the pod) when one passes."""

    def __init__(self, pod: Pod, timeout_s: float | None, grace_s: float = ABORT_GRACE_S):
        self.pod, self.timeout_s, self.grace_s = pod, timeout_s, grace_s
        self.pending = set(range(pod.config.num_dies))
        self.start = time.monotonic()
        self.aborted_at: float | None = None
        self.first_err_at: float | None = None
        self.overdue_err: PodError | None = None
        self.stopped_since: dict[int, float] = {}
        self.states_at = self.start - STATE_EVERY_S  # the first step looks at once

    def step(self, errors: list) -> None:
        now = time.monotonic()
        if errors and self.first_err_at is None:
            self.first_err_at = now
        if not self.pending:
            return
        late = self.first_err_at is not None and now - self.first_err_at >= self.grace_s
        overdue = self.timeout_s is not None and now - self.start > self.timeout_s
        if self.aborted_at is None and (late or overdue):
            self.pod.abort()
            self.aborted_at = now
            if overdue and not errors:
                self.overdue_err = PodError(
                    f"pod.run: dies {sorted(self.pending)} still running after"
                    f" {self.timeout_s:g} s; aborted"
                )
        cause = errors[0][1] if errors else self.overdue_err
        if self.aborted_at is not None and now - self.aborted_at > ABORT_REPLY_S:
            self.pod._hung(
                sorted(self.pending), f"did not answer the abort within {ABORT_REPLY_S:g} s", cause
            )
        self._check_stopped(now, cause)

    def _check_stopped(self, now: float, cause) -> None:
        if now - self.states_at < STATE_EVERY_S:
            return
        self.states_at = now
        limit = self.pod.config.timeout_s
        for r in list(self.pending):
            if _proc_state(self.pod.procs[r].pid) in ("stopped", "tracing-stop"):
                since = self.stopped_since.setdefault(r, now)
                if now - since > limit:
                    self.pod._hung([r], f"stayed stopped for more than {limit:g} s", cause)
            else:
                self.stopped_since.pop(r, None)


def _proc_state(pid: int) -> str:
    """psutil's name for the state of `pid` ("running", "sleeping", "stopped", ...)."""
    try:
        return psutil.Process(pid).status()
    except psutil.Error:
        return "gone"


__all__ = ["DieCrashed", "DieHung", "Pod", "ShmError", "check_memory_model"]
