"""The shell's supervisor (001 §6 mapped onto xpod's processes): one thread that watches the
engine's processes, detects a fault, and restarts the dies and masters with every accepted
request kept (token recomputation), or gives up cleanly.

Detection, each logged with what was seen and counted (`Supervisor.counts`, `/metrics`):
- **exit**: a master or output process exits (its sentinel, waited on with the tick), a die
  exits (`Pod.run` raises `DieCrashed` on the pod thread, reported here at once).
- **stall** (step progress, 001 §6.1's heartbeat through the loop): every die stores where it is
  in its `progress` serving word at each phase (`runtime.model.forward.Clock.mark`); the
  supervisor samples the words every `TICK_S` while requests are in the groups, and no change on
  any die for `stall_timeout_s` is a hang. The record names the culprit (a process in procfs
  state `T`, else the die whose progress is oldest) with its step, layer and phase.
- **heartbeat**: a ping every `PING_EVERY_S` through each master's loop and its die's step loop
  (`Engine.ping`); a group silent for `heartbeat_timeout_s` is a hang (a stopped master, or a
  stopped die of an idle pod, which the progress words cannot see).

Recovery (tier "restart", 001 §6.3 Stage 3, the xDeepServe v1 of RELIABILITY.md c.3 T3): hold
new dispatches, SIGKILL every die, master and output process of the engine, close the pod, bump
the engine's incarnation (messages of the old one are dropped: `RequestTracker.gen`), re-queue
every request the masters had as prompt + delivered tokens (`RequestTracker.readmit`), launch a
new pod under the same id and new masters, and dispatch again. Each stream continues from its
delivered tokens: same seed, same output indices, nothing repeated or skipped (the ledger
trims and counts). More than `max_restarts` in `restart_window_s`, or a restart that fails
`max_restarts` times in a row, gives up: every request ends once with an error (tier
"give_up").

Not built here (RELIABILITY.md c.3): the iteration rollback (T1), KV-block masking (T2), and a
partial restart of the dead die only (T3 v2).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import threading
import time
from collections import deque
from multiprocessing.connection import wait as mp_wait

from memory import layout as L
from runtime.engine.fault_watch import FaultWatch
from runtime.engine.faults import Fault, FaultPlan, proc_state
from runtime.model.forward import PHASES

log = logging.getLogger(__name__)
TICK_S = 0.02  # progress sampling and fault-plan period
PING_EVERY_S = 0.25
IDLE_PING_S = 1.0  # an idle engine: a heartbeat a second (each ping wakes every master and die:
# ~1 % of a core at 4 Hz), and the silence allowed grows by as much; a stopped process is still
# seen in procfs every PING_EVERY_S, so an idle stop is detected as fast as before
CAUSES = {  # detection -> the injected kinds it can be the detection of
    "exit": ("kill",), "stall": ("stop",), "hang": ("stop",), "heartbeat": ("stop",),
    "link": ("err",), "deadline": ("drop", "stop"), "rollbacks": ("drop", "err"),
    "pool_exit": ("kill",),  # a KV pool server exited (restarted by the pool, not the pod)
}  # fmt: skip
RECENT_FAULT_S = 30.0  # an injected fault this recent is the cause of what is detected


class Supervisor(FaultWatch):
    """Watches `engine` (a `runtime.engine.Engine`) from its own thread; see the module doc."""

    def __init__(self, engine, plan: FaultPlan | None = None, fault_log: str = ""):
        cfg = engine.config
        self.engine = engine
        self.plan = plan
        self.fault_log = fault_log
        self.stall_timeout_s = cfg.stall_timeout_s
        self.heartbeat_timeout_s = cfg.heartbeat_timeout_s
        self.reports: queue.Queue = queue.Queue()
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_w, False)
        self.stop = False
        self.busy = threading.Lock()  # held while it acts (a restart included)
        self.log_lock = threading.Lock()
        self.thread: threading.Thread | None = None
        self.restarts: deque[float] = deque()
        self.events: list[dict] = []  # one per detection (and its recovery)
        self.fired: list[Fault] = []
        self.kv_pending: list[Fault] = []  # KV faults written, not seen masked yet
        self.hits_seen: dict[tuple[int, int], int] = {}  # (incarnation, die) -> fault hits
        self.hits_lock = threading.Lock()
        self.counts: dict[str, dict[str, int]] = {
            "injected": {}, "verified": {}, "detected": {}, "recovered": {}, "failed": {},
        }  # fmt: skip
        self.recovery_s: dict[str, list[float]] = {
            "detect": [], "teardown": [], "launch": [], "recompute": [], "rollback": [],
            "stall": [],
        }  # fmt: skip
        self.recovering = False
        self._progress: list[int] = []
        self._changed = 0.0
        self._pinged = 0.0
        self._looked = 0.0  # the last procfs look for stopped processes
        self._epoch = 0.0  # when the current incarnation started answering
        self._stopped_since: dict[int, float] = {}  # pid -> first seen stopped
        self.max_steps: dict[tuple[str, int], int] = {}  # (target, index) -> steps its part ran
        self.not_fired: list[tuple[Fault, str]] | None = None  # set by finish()
        self.pool_seen = (0, 0)  # KV pool server deaths and restarts logged (`_pool_watch`)

    # -- thread ---------------------------------------------------------------------------------

    def start(self) -> None:
        self._epoch = self._changed = time.monotonic()
        self.thread = threading.Thread(target=self._run, name="xpod-engine-supervisor",
                                       daemon=True)  # fmt: skip
        self.thread.start()

    def quiesce(self) -> None:
        """The engine is closing: wait until a restart under way is over; act no more."""
        self._wake()
        with self.busy:
            pass

    def close(self) -> None:
        """End the thread (after the engine stopped every process it forked)."""
        self.stop = True
        self._wake()
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(5)
        if self.plan is not None:
            self.plan.release()
        for fd in (self.wake_r, self.wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)

    def report(self, kind: str, detail: str, gen: int) -> None:
        """A fault seen elsewhere (the pod thread: a die exited); acted on at once."""
        self.reports.put((kind, detail, gen, time.monotonic()))
        self._wake()

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            os.write(self.wake_w, b"!")

    def _run(self) -> None:
        # This thread lives until the engine closed every process: the processes a restart
        # forks from it have it as their parent, and its end would send them their parent-death
        # signal (PR_SET_PDEATHSIG follows the forking thread, not the process).
        eng = self.engine
        watching = True
        while not self.stop:
            if not watching or eng.closing or eng.failure is not None:
                with contextlib.suppress(OSError):
                    mp_wait([self.wake_r], 1.0)
                    os.read(self.wake_r, 4096)
                continue
            sentinels = eng.sentinels()
            pool_s = eng.pool.sentinels() if eng.pool is not None else []
            # idle: the progress words need no sampling (exits still wake the wait at once);
            # a tick every 20 ms was ~2 % of a core for an idle server
            pending = self.plan is not None and (self.plan.armed or self.plan.die_side)
            tick = TICK_S if pending or self.recovering or eng.busy() else PING_EVERY_S
            try:
                waits = [*sentinels, self.wake_r, *pool_s]
                ready = mp_wait(waits, tick)
            except OSError:  # a sentinel closed under us (a restart): look again
                ready = []
            if self.wake_r in ready:
                with contextlib.suppress(OSError):
                    os.read(self.wake_r, 4096)
            if self.stop or eng.closing or eng.failure is not None:
                continue
            now = time.monotonic()
            try:
                with self.busy:
                    if eng.closing:
                        continue
                    self._inject(now)
                    self._pool_watch()
                    self._kv_masked(now)
                    self._die_side(now)
                    incident = self._from_reports() or self._exits(ready, sentinels)
                    incident = incident or self._stalled(now) or self._silent(now)
                    if incident is not None:
                        self._recover(*incident)
            except Exception as e:  # noqa: BLE001 - the supervisor must not die silently
                log.exception("supervisor: %s", e)
                eng.fail_now(f"the supervisor failed: {type(e).__name__}: {e}")
                watching = False

    def on_rollback(self, rec: dict) -> None:
        """An iteration rollback the pod thread ran (`Engine._pod_loop`): detected (link /
        deadline) and recovered (tier "rollback"), logged with its step and time."""
        now = time.monotonic()
        self._progress, self._changed = [], now  # the re-run writes the same progress words
        self._die_side(now)  # the hit behind it may not have been seen by a tick yet
        with self.log_lock:
            cause = self._cause(now, rec["kind"])
        if cause is not None:
            cause.extra["detected"] = True
        self._count("detected", rec["kind"])
        self._count("recovered", "rollback")
        self.recovery_s["rollback"].append(rec["rollback_s"])
        if rec.get("stall_s") is not None:
            self.recovery_s["stall"].append(rec["stall_s"])
        fault = cause.text if cause else ""
        self._log({"event": "detected", "kind": rec["kind"], "detail": rec["error"],
                   "gen": self.engine.gen, "fault": fault,
                   "detect_s": (now - cause.fired_at) if cause else None})  # fmt: skip
        self._log({"event": "recovered", "tier": "rollback", "kind": rec["kind"],
                   "gen": self.engine.gen, "fault": fault, "step": rec["step"],
                   "attempt": rec["attempt"], "parts": {"rollback": rec["rollback_s"],
                                                        "stall": rec.get("stall_s")},
                   "requests_resumed": 0})  # fmt: skip

    def _count(self, what: str, key: str) -> None:
        c = self.counts[what]
        c[key] = c.get(key, 0) + 1

    def _log(self, rec: dict) -> None:
        rec = {"t": time.time(), "mono": time.monotonic(), **rec}
        with self.log_lock:  # the recompute timer logs too
            self.events.append(rec)
            if self.fault_log:
                with open(self.fault_log, "a") as fh:
                    fh.write(json.dumps(rec) + "\n")

    # -- detection ------------------------------------------------------------------------------

    def _from_reports(self):
        while True:
            try:
                kind, detail, gen, when = self.reports.get_nowait()
            except queue.Empty:
                return None
            if gen == self.engine.gen:
                self._self_killed(detail, when)
                return kind, detail, when

    def _exits(self, ready: list, sentinels: dict):
        for s in ready:
            if s in sentinels:
                what, i, p = sentinels[s]
                return "exit", f"{what} {i} (pid {p.pid}) exited ({p.exitcode})", time.monotonic()
        return None

    def _stalled(self, now: float):
        """A hang under load: no die's progress word changed for `stall_timeout_s`."""
        words = self.engine.progress_words()
        busy = self.engine.busy() and not self._pool_waits_only()
        if not words or words != self._progress or not busy:
            self._progress, self._changed = words, now
            return None
        if now - self._changed < self.stall_timeout_s:
            return None
        culprit = self._stopped() or self._oldest(words)
        return "stall", f"no progress for {now - self._changed:.2f} s: {culprit}", now

    def _silent(self, now: float):
        """A hang seen by the heartbeat: a group silent for `heartbeat_timeout_s`, or any
        process of the engine stopped that long (an output process too, which the heartbeat
        does not cross: its group's tokens would just pile up)."""
        eng = self.engine
        if now - self._pinged >= (PING_EVERY_S if eng.busy() else IDLE_PING_S):
            self._pinged = now
            try:
                eng.ping()
            except Exception:  # noqa: BLE001 - down or closing: the loop ends
                return None
        if now - self._looked >= PING_EVERY_S:  # procfs: cheap beside waking every process
            self._looked = now
            for what, i, pid in eng.processes():
                if proc_state(pid) in ("T", "t"):
                    since = self._stopped_since.setdefault(pid, now)
                    if now - since > self.heartbeat_timeout_s:
                        seen = f"{what} {i} (pid {pid}) stopped for {now - since:.2f} s"
                        return "heartbeat", seen, now
                else:
                    self._stopped_since.pop(pid, None)
        limit = self.heartbeat_timeout_s + (0.0 if eng.busy() else IDLE_PING_S - PING_EVERY_S)
        for g in range(eng.config.dies):
            _, when, _ = eng.pongs.get(g, (0, self._epoch, 0))
            age = now - max(when, self._epoch)
            if age > limit:
                if self._die_exited():  # the pod thread reports that exit once its teardown ends
                    return None
                culprit = self._stopped() or f"group {g} (its master or die)"
                return "heartbeat", f"group {g} silent for {age:.2f} s: {culprit}", now
        return None

    def _die_exited(self) -> bool:
        """Whether a die of the current pod has exited (or the pod is being torn down for it):
        a group's silence is then its consequence, not a hang (under load the teardown that
        precedes `DieCrashed` may outlast the heartbeat timeout)."""
        pod = self.engine.pod
        if pod is None:
            return False
        if pod.closed:
            return True
        for p in list(pod.procs):
            with contextlib.suppress(ValueError):  # a process closed by a teardown meanwhile
                if p.exitcode is not None:
                    return True
        return False

    def _stopped(self) -> str:
        """The engine's processes in procfs state T (stopped), named."""
        out = []
        for what, i, pid, _ in self.engine.in_state(("T", "t")):
            where = ""
            if what == "die":
                where = " at " + describe_progress(self.engine.progress_words()[i])
            out.append(f"{what} {i} (pid {pid}) is stopped{where}")
        return "; ".join(out)

    def _pool_waits_only(self) -> bool:
        """Is every request the masters hold waiting for a KV pool load (by their latest
        stats)? The dies then have nothing to run: no progress is no hang (a stopped pool
        server costs its loads their timeout, then they are recomputed: KVPOOL.md §4.8)."""
        eng = self.engine
        if eng.pool is None:
            return False
        t = eng.tracker
        waiting = sum(int((eng.stats.get(g) or {}).get("pool_waiting", 0))
                      for g in range(eng.config.dies))  # fmt: skip
        return waiting > 0 and len(t.reqs) - len(t.pending) <= waiting

    @staticmethod
    def _oldest(words: list[int]) -> str:
        i = min(range(len(words)), key=lambda k: words[k])
        return f"die {i} is behind: " + describe_progress(words[i])

    # -- recovery -------------------------------------------------------------------------------

    def _cause(self, when: float, how: str) -> Fault | None:
        """The injected fault behind a detection of kind `how` at `when`: the latest recent one
        of a kind that detection can see (`CAUSES`; a delay is never a cause: a detection it
        provokes has none, and counts as a false recovery)."""
        kinds, pool = CAUSES.get(how, ()), how.startswith("pool")
        recent = [f for f in self.fired if f.verified and 0 <= when - f.fired_at < RECENT_FAULT_S
                  and not f.extra.get("detected") and f.kind in kinds
                  and (f.target == "pool") == pool]  # fmt: skip
        return recent[-1] if recent else None

    def _recover(self, kind: str, detail: str, when: float) -> None:
        eng = self.engine
        cause = self._cause(when, kind)
        detect_s = (when - cause.fired_at) if cause is not None else None
        if cause is not None:
            cause.extra["detected"] = True
        self._count("detected", kind)
        rec = {"event": "detected", "kind": kind, "detail": detail, "gen": eng.gen,
               "fault": cause.text if cause else "", "detect_s": detect_s}  # fmt: skip
        log.warning("fault detected (%s): %s", kind, detail)
        self._log(rec)
        if not eng.config.recover:
            self._count("failed", kind)
            eng.fail_now(detail)
            return
        self.recovering = True
        try:
            self._restart(kind, detail, when, detect_s, cause.text if cause else "")
        finally:
            self.recovering = False

    def _restart(self, kind: str, detail: str, when: float, detect_s: float | None,
                 fault: str = "") -> None:  # fmt: skip
        eng, cfg = self.engine, self.engine.config
        attempts = 0
        while True:
            now = time.monotonic()
            while self.restarts and now - self.restarts[0] > cfg.restart_window_s:
                self.restarts.popleft()
            if len(self.restarts) >= cfg.max_restarts or attempts >= cfg.max_restarts:
                msg = (f"{detail}; {len(self.restarts)} restarts in {cfg.restart_window_s:g} s"
                       f" (at most {cfg.max_restarts}): giving up")  # fmt: skip
                self._count("failed", kind)
                self._log({"event": "give_up", "kind": kind, "detail": msg})
                log.error("recovery: %s", msg)
                eng.fail_now(msg)
                return
            if eng.closing:
                return
            self.restarts.append(now)
            attempts += 1
            t0 = time.monotonic()
            eng.begin_recovery()
            eng.teardown_processes()
            t1 = time.monotonic()
            resumed = eng.readmit()
            try:
                eng.launch_processes()
            except Exception as e:  # noqa: BLE001 - a fault during recovery: try again
                log.error("recovery: the relaunch failed: %s", e)
                self._log({"event": "relaunch_failed", "detail": str(e)})
                detail = f"{detail}; relaunch failed: {e}"
                continue
            t2 = time.monotonic()
            eng.end_recovery()
            self._progress, self._changed = [], t2
            self._epoch = self._pinged = t2
            self._stopped_since.clear()
            self._count("recovered", "restart")
            parts = {"detect": detect_s, "teardown": t1 - t0, "launch": t2 - t1}
            for k, v in parts.items():
                if v is not None:
                    self.recovery_s[k].append(v)
            rec = {"event": "recovered", "tier": "restart", "kind": kind, "gen": eng.gen,
                   "fault": fault,
                   "since_detect_s": t2 - when, "parts": parts,
                   "requests_resumed": len(resumed), "attempts": attempts}  # fmt: skip
            self._log(rec)
            log.warning("recovered (restart %d, %d requests resumed): teardown %.3f s, launch"
                        " %.3f s", eng.gen, len(resumed), t1 - t0, t2 - t1)  # fmt: skip
            self._watch_recompute(resumed, t2, rec)
            return

    def _watch_recompute(self, resumed: list, t_launched: float, rec: dict) -> None:
        """Record, once the first resumed request has a token again, the recompute time."""

        def wait() -> None:
            deadline = t_launched + 30
            while time.monotonic() < deadline and not self.stop:
                firsts = [t.t_resumed for t in resumed if t.t_resumed]
                if firsts or all(t.done.is_set() for t in resumed):
                    if firsts:
                        v = min(firsts) - t_launched
                        self.recovery_s["recompute"].append(v)
                        rec["parts"]["recompute"] = v
                        self._log({"event": "resumed", "gen": rec["gen"], "recompute_s": v,
                                   "fault": rec.get("fault", "")})  # fmt: skip
                    return
                time.sleep(0.005)

        if resumed:
            threading.Thread(target=wait, name="xpod-recompute-timer", daemon=True).start()

    def snapshot(self) -> dict:
        """Counters and recovery times (for `/metrics`, summaries and `xpod bench chaos`)."""
        return {"counts": {k: dict(v) for k, v in self.counts.items()},
                "recovery_s": {k: list(v) for k, v in self.recovery_s.items()},
                "restarts": sum(self.counts["recovered"].values()),
                "faults": [f.record() for f in self.fired],
                "unfired": [f.text for f in (self.plan.unfired if self.plan else [])],
                "plan": self.fault_summary()}  # fmt: skip


def describe_progress(word: int) -> str:
    """`step S, layer L, after PHASE (STATE)` of a die's progress word."""
    step, layer, phase, state = L.unpack_progress(word)
    st = L.PROGRESS_STATES[state] if state < len(L.PROGRESS_STATES) else str(state)
    if st in ("vote", "park"):
        return f"step {step}, {st}"
    ph = PHASES[phase] if phase < len(PHASES) else str(phase)
    where = f"layer {layer}" if layer >= 0 else "outside the layers"
    return f"step {step}, {where}, after {ph}"
