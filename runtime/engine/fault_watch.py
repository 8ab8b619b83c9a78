"""The fault-plan half of the shell's supervisor (`runtime.engine.supervisor.Supervisor`
inherits it): firing the plan's faults (the shell's own, at their time or step; the dies' hits;
the gates a die waits at), verifying each, and at the end reporting what never fired and why.
`runtime.engine.faults` has the grammar, `runtime.engine.fault_hook` the die's side.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time

from runtime.engine.faults import Fault, FaultPlan

log = logging.getLogger("runtime.engine.supervisor")
KV_VERIFY_S = 10.0  # a KV fault the die's master has not masked by then did not fire


class FaultWatch:
    """Fault-plan methods of the supervisor: `plan`, `engine`, `fired`, `kv_pending`,
    `hits_seen`, `hits_lock`, `max_steps`, `not_fired`, `busy`, `events`, `log_lock`,
    `pool_seen` and its `_count` / `_log` / `_cause` are the supervisor's."""

    def _inject(self, now: float) -> None:
        plan = self.plan
        if plan is None:
            return
        plan.tick(now)
        if self.recovering or not (plan.armed or plan.die_side):
            return
        for f in plan.due_die_side(now - self.engine.started_at):  # idempotent: no read-back
            self.engine.arm_fault(f.index, f.ordinal)
        steps = self.engine.part_steps()
        self._note_steps(steps)
        due = plan.due(now - self.engine.started_at, lambda f: steps.get((f.target, f.index), 0),
                       self.engine.gen)  # fmt: skip
        for f in due:
            if f.kind == "kvfault":  # verified once the die's master reports the block masked
                f.extra["before"] = len(self.engine.masked_blocks(f.index))
                f.fired_at = time.monotonic()
                self.engine.report_kv_fault(f.index, f.block)
                self.kv_pending.append(f)
                continue
            plan.fire(f, self._pid(f))
            self._fired(f)

    def _pid(self, f: Fault) -> int:
        """The pid of f's target now (0 if there is none): a KV pool server is not one of the
        pod's processes (`Engine.processes`: a stopped one is no hang of the pod)."""
        if f.target != "pool":
            return self.engine.pid_of(f.target, f.index)
        pool = self.engine.pool
        h = pool.handle_of(f.index) if pool is not None else None
        return int(h.pid or 0) if h is not None else 0

    def _pool_watch(self) -> None:
        """A KV pool server that exited: handled by the pool's shell side at once (its DRAM
        entries leave the index, the masters fall back, it restarts), here or by the engine's
        receiver thread (`Engine._watch`), whichever saw it first; each death logged here as a
        `pool_exit` detection and a `pool_restart` recovery (or the pool going off), with the
        plan's kill behind it if any."""
        eng = self.engine
        pool = eng.pool
        if pool is None:
            return
        with eng.lock:  # the tracker's: the pool's index and the sockets to the masters
            try:
                pool.watch()
            except Exception as e:  # noqa: BLE001 - a pool that cannot restart costs hits,
                log.error("kv pool: the server's restart failed: %s: the pool is off", e)
                pool.down = True  # never requests: every prompt recomputes from now on
            deaths = pool.counters["pool_server_deaths"]
            restarts = pool.counters["pool_server_restarts"]
            pid = pool.handle.pid if pool.handle is not None else 0
            down = pool.down
        (dead0, up0), self.pool_seen = self.pool_seen, (deaths, restarts)
        now = time.monotonic()  # after a kill this tick may have fired (`_inject`)
        for k in range(deaths - dead0):
            with self.log_lock:
                cause = self._cause(now, "pool_exit")
            if cause is not None:
                cause.extra["detected"] = True
            self._count("detected", "pool_exit")
            fault = cause.text if cause else ""
            self._log({"event": "detected", "kind": "pool_exit", "gen": eng.gen,
                       "detail": f"a kv pool server exited ({dead0 + k + 1} deaths)",
                       "fault": fault,
                       "detect_s": (now - cause.fired_at) if cause else None})  # fmt: skip
            if k < restarts - up0:
                self._count("recovered", "pool_restart")
                self._log({"event": "recovered", "tier": "pool_restart", "kind": "pool_exit",
                           "gen": eng.gen, "fault": fault, "since_detect_s": 0.0,
                           "parts": {}, "requests_resumed": 0, "pid": pid})  # fmt: skip
            elif down:
                self._log({"event": "pool_off", "kind": "pool_exit", "fault": fault,
                           "detail": "out of restarts: every prompt recomputes"})  # fmt: skip

    def _release_pool(self) -> None:
        """SIGCONT to the pool servers the plan stopped (for a while or for good): the engine
        stops them next, which a stopped one could not answer."""
        plan = self.plan
        plan.release("pool")
        for f in self.fired:
            if f.target == "pool" and f.kind == "stop" and f.verified:
                with contextlib.suppress(OSError):
                    os.kill(f.pid, signal.SIGCONT)

    def _die_side(self, now: float) -> None:
        """Faults triggered in the dies (`runtime.engine.fault_hook`): a die records each hit
        in its `fault_hits` word (a count, and the plan position of the latest): die-side ones
        are then fired (and verified), gated ones are fired here, then their gate released.
        Called by the supervisor's tick, by the pod thread before it reports a rollback, and
        as the engine closes."""
        plan = self.plan
        if plan is None or not plan.die_side:
            return
        with self.hits_lock:
            self._die_side_locked(now, plan)

    def _die_side_locked(self, now: float, plan: FaultPlan) -> None:
        gen = self.engine.gen
        for d, word in enumerate(self.engine.fault_hits()):
            n, last = word & 0xFFFFFFFF, (word >> 32) - 1
            seen = self.hits_seen.get((gen, d), 0)
            if n <= seen:
                continue
            for f in self._hit_faults(plan, d, n - seen, last, gen):
                if f.gated:
                    self._fire_gated(f, d, plan)
                    continue
                f.fired_at, f.verified = self._hit_time(d, now), True
                f.pid = self.engine.pid_of("die", d)
                f.detail = f"die {d}: hook hit at step {f.step} ({f.phase})"
                if f.kind == "stop":  # the die stopped itself: verified in procfs, resumed
                    plan.verify_stopped(f)  # after for=T by the plan's tick
                self._fired(f)
            self.hits_seen[(gen, d)] = n

    @staticmethod
    def _hit_faults(plan: FaultPlan, die: int, new: int, last: int, gen: int) -> list[Fault]:
        """The `new` faults die fired since the last look, the latest (plan position `last`)
        last: the others (two hits between looks) by their step, then their at=T order."""
        cands = [f for f in plan.die_side if f.index == die and not f.fired_at
                 and not f.extra.get("gate_hit") and f.gen in (None, gen)]  # fmt: skip
        latest = next((f for f in cands if f.uid == last), None)
        rest = sorted((f for f in cands if f is not latest), key=lambda f: (f.step, f.ordinal))
        if latest is None:
            return rest[:new]
        return [*rest[: new - 1], latest]

    def _fire_gated(self, f: Fault, die: int, plan: FaultPlan) -> None:
        """A fault die waits for at the start of its step: fire it (a signal, or a KV fault
        report), then release the gate. Not while the engine closes (its gates are open)."""
        eng = self.engine
        if eng.closing:
            f.extra["gate_hit"] = True
            return
        if f.kind == "kvfault":  # verified once the die's master reports the block masked
            f.extra["before"] = len(eng.masked_blocks(f.index))
            f.fired_at = time.monotonic()
            eng.report_kv_fault(f.index, f.block)
            self.kv_pending.append(f)
        else:
            plan.fire(f, eng.pid_of(f.target, f.index))
            self._fired(f)
        eng.release_gate(die)

    def _fired(self, f: Fault) -> None:
        self.fired.append(f)
        key = f"{f.kind}-{f.target}"
        self._count("injected", key)
        if f.verified:
            self._count("verified", key)
        level = logging.WARNING if f.verified else logging.ERROR
        log.log(level, "fault injected: %s: %s", f.text, f.detail)
        self._log({"event": "injected", **f.record()})

    def _kv_masked(self, now: float) -> None:
        """KV faults (tier "mask"): the die dropped the rows that hold the block, its master
        masked it and recomputes them; nothing else pauses. Verified, detected and recovered
        at once when the master's stats show the block masked."""
        for f in list(self.kv_pending):
            masked = self.engine.masked_blocks(f.index)
            late = now - f.fired_at > KV_VERIFY_S
            if len(masked) <= f.extra["before"] and not late:
                continue
            self.kv_pending.remove(f)
            if late and len(masked) <= f.extra["before"]:
                f.detail = f"die {f.index} reported no masked block in {KV_VERIFY_S:g} s"
                self._fired(f)
                continue
            f.verified = True
            f.block = masked[-1]
            f.detail = f"die {f.index}: KV block {f.block} poisoned, masked by master {f.index}"
            self._fired(f)
            f.extra["detected"] = True
            self._count("detected", "kv")
            self._count("recovered", "mask")
            gen = self.engine.gen
            self._log({"event": "detected", "kind": "kv", "detail": f.detail, "gen": gen,
                       "fault": f.text, "detect_s": now - f.fired_at})  # fmt: skip
            self._log({"event": "recovered", "tier": "mask", "kind": "kv", "gen": gen,
                       "fault": f.text, "since_detect_s": 0.0, "parts": {},
                       "requests_resumed": 0, "block": f.block})  # fmt: skip

    def _self_killed(self, detail: str, when: float) -> None:
        """A die-side kill (a die that SIGKILLed itself at a phase) is verified by its exit."""
        plan = self.plan
        if plan is None:
            return
        for f in plan.die_side:
            key = f"die {f.index} (pid "
            if f.kind == "kill" and not f.fired_at and key in detail:
                pid = detail[detail.index(key) + len(key) :].split(")")[0]
                f.pid = int(pid) if pid.isdigit() else 0
                f.fired_at = self._hit_time(f.index, when)
                f.verified = "SIGKILL" in detail
                f.detail = f"die {f.index} killed itself before a {f.phase}: {detail}"
                self._fired(f)
                return

    def _hit_time(self, die: int, seen: float) -> float:
        """When die's latest die-side fault fired (its `fault_at` word, CLOCK_MONOTONIC as
        `time.monotonic()`), or `seen` if that word is unreadable or not before it."""
        words = self.engine.fault_times()
        at = words[die] / 1e9 if die < len(words) else 0.0
        return at if 0 < at <= seen else seen

    def _note_steps(self, steps: dict[tuple[str, int], int]) -> None:
        """The most steps each target's part ran in one incarnation (why a fault never fired)."""
        top = self.max_steps
        for k, v in steps.items():
            if v > top.get(k, 0):
                top[k] = v

    def finish(self, end_s: float) -> list[tuple[Fault, str]]:
        """The engine is closing (its pod still mapped): take the last die-side hits and
        steps, then report every planned fault that never fired, with why: a warning each and
        a `not_fired` record in the fault log. Returns them (also kept in `not_fired`)."""
        plan = self.plan
        if plan is None:
            return []
        with self.busy:
            now = time.monotonic()
            if self.engine.pod is not None and not self.engine.pod.closed:
                self._die_side(now)
                self._note_steps(self.engine.part_steps())
            self._kv_masked(now)  # the masters' final stats are in
            for f in list(self.kv_pending):  # written, never seen masked: fired, not verified
                self.kv_pending.remove(f)
                f.detail = f"die {f.index} reported no masked block before the engine closed"
                self._fired(f)
            self.not_fired = plan.not_fired(end_s, self.max_steps, self.engine.gen)
            self._release_pool()
        for f, why in self.not_fired:
            log.warning("planned fault %r did not fire: %s", f.text, why)
            self._log({"event": "not_fired", "fault": f.text, "kind": f.kind,
                       "target": f.target, "index": f.index, "reason": why})  # fmt: skip
        return self.not_fired

    def fault_summary(self) -> dict:
        """What became of the plan: planned, fired, verified, detected and recovered counts,
        and the faults that did not fire (their texts; `not_fired_reasons` says why). While
        the engine runs, `pending` are those not fired yet."""
        plan = self.plan
        if plan is None:
            return {}
        named = [e for e in self.events if e.get("fault")]
        out = {"planned": len(plan.faults), "fired": len(self.fired),
               "verified": sum(f.verified for f in self.fired),
               "detected": sum(e["event"] == "detected" for e in named),
               "recovered": sum(e["event"] == "recovered" for e in named),
               "pending": len(plan.unfired)}  # fmt: skip
        if self.not_fired is not None:
            out["not_fired"] = [f.text for f, _ in self.not_fired]
            out["not_fired_reasons"] = [why for _, why in self.not_fired]
        return out
