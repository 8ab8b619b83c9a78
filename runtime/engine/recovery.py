"""The engine's side of reliability (`Engine` inherits it): what the supervisor
(`runtime.engine.supervisor`) reads of the processes and the pod, the steps of a restart
(teardown, re-admission, relaunch), the KV-fault and fault-arming words it writes into dies,
and the pod thread's loop that answers a transient link fault with an iteration rollback.

Split from `engine.py`, which starts, serves and stops: this part talks to the processes and
the dies' serving words on the supervisor's behalf.
"""

from __future__ import annotations

import contextlib
import logging
import time

from memory import layout as L
from memory.errors import LinkError, PeerTimeout, PodError
from runtime.engine.executor import ServeSpec, drop_loop, rollback_point, serve_main
from runtime.engine.fault_hook import GATE_SHIFT, STEPS_ARMED
from runtime.engine.faults import proc_state
from runtime.engine.records import EngineError, TrackedRequest
from runtime.pod.launcher import ABORT_GRACE_S

log = logging.getLogger(__name__)
MAX_ROLLBACKS = 3  # rollbacks of one step before a restart (vllm-ascend's max_reinference_times)
ROLLBACK_FAULTS = (LinkError, PeerTimeout)  # the root errors a rollback answers
TEARDOWN_JOIN_S = 10.0  # the pod thread ends once its dies are killed: its pod.run raises
DOWN_STATES = ("", "T", "t", "Z", "X")  # procfs states of a process that cannot make progress
GATE_OPEN = (1 << 22) - 1  # a gate count no die reaches: every gate open (the engine closes)


class EngineRecovery:
    """Supervision and recovery methods of `runtime.engine.Engine` (see the module doc)."""

    @property
    def gen(self) -> int:
        """The incarnation: 0 at launch, +1 per restart."""
        return self.tracker.gen

    def sentinels(self) -> dict:
        """sentinel -> ("master" | "output", group, process) of the current incarnation."""
        out = {}
        for what, procs in (("master", self.masters), ("output", self.outputs)):
            for g, p in enumerate(list(procs)):
                with contextlib.suppress(ValueError):  # closed by a teardown meanwhile
                    out[p.sentinel] = (what, g, p)
        return out

    def processes(self) -> list[tuple[str, int, int]]:
        """(kind, index, pid) of every die, master and output process now."""
        out = []
        pod = self.pod
        if pod is not None and not pod.closed:
            for r, p in enumerate(list(pod.procs)):
                with contextlib.suppress(ValueError):
                    out.append(("die", r, p.pid))
        for what, procs in (("master", self.masters), ("output", self.outputs)):
            for g, p in enumerate(list(procs)):
                with contextlib.suppress(ValueError):  # closed by a restart on another thread
                    out.append((what, g, p.pid))
        return out

    def in_state(self, states: tuple[str, ...]) -> list[tuple[str, int, int, str]]:
        """(kind, index, pid, procfs state) of the processes in one of `states` ("": gone)."""
        out = []
        for what, i, pid in self.processes():
            st = proc_state(pid)
            if st in states:
                out.append((what, i, pid, st))
        return out

    def pid_of(self, what: str, index: int) -> int:
        """The pid of die / master / output `index` now (0 if there is none)."""
        return next((pid for w, i, pid in self.processes() if w == what and i == index), 0)

    def _serve_words(self, word: int, every_die: bool = False) -> list[int]:
        """The word of every group's die (`every_die`: of every die, a split pod's expert
        dies too)."""
        pod = self.pod
        if pod is None or pod.closed or self.recovering:
            return []
        i = pod.layout.serve_word(word)
        n = self.config.pod_dies if every_die else self.config.dies
        try:
            return [int(pod.region(g).words[i]) for g in range(n)]
        except (PodError, IndexError, ValueError, TypeError):
            return []

    def progress_words(self) -> list[int]:
        """Every die's progress word (`memory.layout.unpack_progress`); [] while down."""
        return self._serve_words(L.SV_PROGRESS, every_die=True)

    def fault_hits(self) -> list[int]:
        """Every die's count of die-side injected faults it fired, a split pod's expert dies
        too ([] while down)."""
        return self._serve_words(L.SV_FAULT_HITS, every_die=True)

    def fault_times(self) -> list[int]:
        """Every die's `fault_at` word: when its latest die-side fault fired (monotonic ns)."""
        return self._serve_words(L.SV_FAULT_AT, every_die=True)

    def die_step(self) -> int:
        """Die 0's step in the current incarnation (0 while down)."""
        steps = self._serve_words(L.SV_VOTE_STEP)
        return steps[0] if steps else 0

    def part_steps(self) -> dict[tuple[str, int], int]:
        """(target, index) -> the step its part reached in the current incarnation ({} while
        down): a group's die (and its master and output process) its vote step, the steps of
        its own part (a PD pod's prefill or decode dies); a split pod's expert die the
        attention step it serves (its progress word's; `runtime.engine.faults`)."""
        votes = self._serve_words(L.SV_VOTE_STEP)
        if not votes:
            return {}
        out = {}
        for g, s in enumerate(votes):
            for what in ("die", "master", "output"):
                out[(what, g)] = s
        progress = self._serve_words(L.SV_PROGRESS, every_die=True)
        for d in range(len(votes), len(progress)):
            out[("die", d)] = max(0, L.unpack_progress(progress[d])[0])
        return out

    def busy(self) -> bool:
        """Do the masters have requests (so the dies must be making progress)? A PD request
        between its prefill and its KV's landing asks nothing of any die (the KV link has its
        own deadline and probe)."""
        t = self.tracker
        n = len(t.reqs) - len(t.pending)
        if t.pd is not None and n > 0:
            n -= sum(
                1 for r in list(t.reqs.values()) if "prefilled" in r.pd and "landed" not in r.pd
            )
        return not self.recovering and n > 0

    def masked_blocks(self, group: int) -> list[int]:
        """KV blocks group's master masked (memory faults), from its latest stats."""
        return list((self.stats.get(group) or {}).get("kv_masked_blocks", []))

    def report_kv_fault(self, die: int, block: int = -1) -> None:
        """A memory fault report in die's `kv_fault` serving word (`block` -1: a block its next
        rows hold): the die drops the rows that hold it, its master masks it for good."""
        pod = self.pod
        if pod is None or pod.closed:
            raise EngineError("the pod is down")
        self.kv_fault_seq += 1
        i = pod.layout.serve_word(L.SV_KV_FAULT)
        pod.region(die).words[i] = (self.kv_fault_seq << 32) | (block + 1)

    def arm_fault(self, die: int, ordinal: int) -> None:
        """Arm die's die-side injected faults up to `ordinal` (its `fault_arm` word)."""
        self._arm(die, ordinal=ordinal)

    def arm_steps(self) -> None:
        """Let every die fire its faults planned at a step (`fault_arm` word's STEPS_ARMED
        bit; `runtime.engine.fault_hook`): after the launch's warm-up, so that a step of the
        warm-up never fires one; at once in a restart's new pod (its words start at 0)."""
        self.fault_arm = {}
        self.steps_armed = True
        if self.first_plan is not None and self.first_plan.die_side:
            for d in range(self.config.pod_dies):
                self._arm(d, now=True)

    def release_gate(self, die: int) -> None:
        """Let die go on from the fault gate it waits at (the shell fired the fault)."""
        self._arm(die, gate=1)

    def open_gates(self) -> None:
        """The engine closes: no gate holds a die any more (its fault does not fire)."""
        for d in range(self.config.pod_dies):
            self._arm(d, gate=GATE_OPEN)

    def _arm(self, die: int, ordinal: int | None = None, gate: int = 0, now: bool = False,
             ) -> None:  # fmt: skip
        """Write die's `fault_arm` word (this process is its only writer: the word is kept
        here too, and rewritten whole); not while a restart is under way, unless `now` (the
        restart's new pod) or a gate opens."""
        pod = self.pod
        if pod is None or pod.closed or (self.recovering and not (gate or now)):
            return
        st = self.fault_arm.setdefault(die, [0, 0])
        if ordinal is not None:
            st[0] = ordinal
        st[1] = min(GATE_OPEN, st[1] + gate)
        word = st[0] | (STEPS_ARMED if self.steps_armed else 0) | st[1] << GATE_SHIFT
        with contextlib.suppress(PodError, IndexError, ValueError):
            pod.region(die).words[pod.layout.serve_word(L.SV_FAULT_ARM)] = word

    def fail_now(self, detail: str) -> None:
        """Give up (the supervisor): every request ends with an error, the engine is down."""
        self.recovering = False
        self._fail(EngineError(detail))

    def begin_recovery(self) -> None:
        """Hold dispatches (requests wait in the tracker) and report "recovering"."""
        with self.lock:
            self.recovering = True
            self.tracker.hold = True

    def teardown_processes(self) -> None:
        """SIGKILL every die, master and output process (their state is rebuilt from the
        tracker's books) and close the pod; the run directory, the inbox and the threads of
        the shell stay."""
        with self.lock:
            for s in [*self.to_master, *self.to_output]:
                s.close(linger=0)
            self.to_master, self.to_output = [], []
        pod = self.pod
        procs = list(self.masters) + list(self.outputs)
        if pod is not None and not pod.closed:
            pod.abort()
            procs += list(pod.procs)
        for p in procs:
            with contextlib.suppress(Exception):
                p.kill()  # a stopped process dies of SIGKILL too
        for p in procs:
            with contextlib.suppress(Exception):
                p.join(5)
        runs = [t for t in self._threads if t.name == "xpod-pod-run"]
        for t in runs:
            t.join(TEARDOWN_JOIN_S)
            self._threads.remove(t)
        if pod is not None:
            pod.close(fast=True)
        for p in list(self.masters) + list(self.outputs):
            with contextlib.suppress(Exception):
                p.close()
        self.masters, self.outputs = [], []

    def readmit(self) -> list[TrackedRequest]:
        """Bump the incarnation and re-queue every request the masters had (held)."""
        with self.lock:
            self.pongs, self.stats = {}, {}
            return self.tracker.readmit(self.gen + 1)

    def launch_processes(self) -> None:
        """A new pod under the same id, new masters and output processes; wait until ready."""
        while self.ready.acquire(blocking=False):  # readies of the old incarnation
            pass
        self._launch_pod()
        self.arm_steps()  # no warm-up in a restart: its step faults count from its first step
        self._fork_group_processes()
        self._connect_and_run()

    def end_recovery(self) -> None:
        """Dispatch again: the re-queued requests first."""
        with self.lock:
            self.recovering = False
            self.alive_since = time.monotonic()
            self.tracker.hold = False
            self.tracker.dispatch_pending()
            self.tracker.deliver()

    def reliability(self) -> dict:
        """The supervisor's counters and the ledger's (`/metrics`, summaries, bench chaos)."""
        snap = self.supervisor.snapshot() if self.supervisor is not None else {}
        return {**snap, "ledger": dict(self.tracker.ledger), "gen": self.gen,
                "recovering": self.recovering}  # fmt: skip

    # -- the pod thread: a run, its rollbacks, or a fault -------------------------------------

    def _pod_loop(self, serve: ServeSpec, gen: int) -> None:
        pod, resume, tries = self.pod, None, {}
        grace = 0.0 if serve.rollback else ABORT_GRACE_S
        while True:
            try:
                self.pod_result = pod.run(serve_main, serve, resume, abort_grace_s=grace)
                return
            except BaseException as e:  # noqa: BLE001 - every failure is named: a rollback,
                t_fail = time.monotonic()  # a restart or the end
                if self.closing or gen != self.gen:
                    return
                if not (serve.rollback and isinstance(e, ROLLBACK_FAULTS) and not pod.closed):
                    self._fault(f"the pod failed: {type(e).__name__}: {e}", gen)
                    return
                # The probe: a deadline passed because a process is stopped or gone (a hung
                # die, or a die waiting for its stopped master) is not a lost write: restart.
                down = [f"{w} {i} (pid {p}, state {st or 'gone'})"
                        for w, i, p, st in self.in_state(DOWN_STATES)]  # fmt: skip
                if down:
                    self._fault(f"{type(e).__name__}: {e}; not a link fault:"
                                f" {', '.join(down)}", gen, "hang")  # fmt: skip
                    return
                try:
                    resume = min(pod.run(rollback_point, serve, timeout_s=5.0)) + 1
                except BaseException as e2:  # noqa: BLE001 - a fault during the rollback
                    self._fault(f"rollback after {type(e).__name__} failed: {e2}", gen)
                    return
                tries[resume] = tries.get(resume, 0) + 1
                at = max(self._serve_words(L.SV_FAULT_AT) or [0]) / 1e9
                stall = time.monotonic() - at if 0 < at <= t_fail else None
                rec = {"step": resume, "attempt": tries[resume], "error": f"{type(e).__name__}:"
                       f" {e}", "kind": "link" if isinstance(e, LinkError) else "deadline",
                       "rollback_s": time.monotonic() - t_fail, "stall_s": stall}  # fmt: skip
                if tries[resume] > MAX_ROLLBACKS:
                    with contextlib.suppress(BaseException):
                        pod.run(drop_loop, serve, timeout_s=5.0)
                    self._fault(f"step {resume} rolled back {MAX_ROLLBACKS} times; the last"
                                f" fault: {rec['error']}", gen, "rollbacks")  # fmt: skip
                    return
                self.rollbacks.append(rec)
                if self.supervisor is not None:
                    self.supervisor.on_rollback(rec)
                log.warning("rollback %d of step %d (%s): %.1f ms", tries[resume], resume,
                            rec["error"], rec["rollback_s"] * 1e3)  # fmt: skip

    def _fault(self, detail: str, gen: int, kind: str = "exit") -> None:
        """A process of incarnation `gen` died (or a step would not roll back): the supervisor
        restarts, or the engine fails."""
        sup = self.supervisor
        if sup is not None and (self.config.recover or sup.plan is not None):
            sup.report(kind, detail, gen)  # it fails the engine if recovery is off
        elif gen == self.gen:
            self._fail(EngineError(detail))
