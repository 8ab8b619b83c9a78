"""The die side of fault injection (`runtime.engine.faults` has the grammar): a hook installed
in a die only when a planned fault targets it (or its group's master or output process), called
by the die's clock at every collective (`phase` dispatch / combine), by a prefill die's KV thread
(`kv`), by the serving loops at the start of every step they run (`step`: an attention or
colocated die's `run_step`, an expert die's first call of a step), and at the top of every step
of the serving loop, before its vote (`gate`).

Each hit is recorded in the die's `fault_hits` serving word (its own region) BEFORE the fault
acts, so the shell's supervisor sees every firing, even of a die that kills or stops itself:
`count | (uid + 1) << 32`, the number of hits and the plan position of the latest.

A gate is a fault the shell fires (a master's or output process's kill / stop, a KV fault
report) at the exact step: the die records the hit and waits, before it votes for the step,
until the shell has fired it and released the gate (its `fault_arm` word's gate count), so the
fault lands at step S however fast the steps are. Its peers wait in the vote meanwhile (the
vote has no op deadline: no rollback is provoked).

The `fault_arm` word, written by the shell only: bits 0-39 the ordinal of the last at=T fault
armed, bit 40 STEPS_ARMED (step and gate faults may fire: set after the launch's warm-up, at once
in a restart), bits 41-62 the gates released.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

from memory import layout as L
from memory.errors import LinkError, PodAborted

Hook = Callable[[int, int, str], None]  # (step, layer, phase)
STEPS_ARMED = 1 << 40  # the `fault_arm` word (module docstring)
ORDINAL_MASK = STEPS_ARMED - 1
GATE_SHIFT = 41
GATE_POLL_S = 0.0005  # a die at a gate sleeps this long between looks (the shell ticks 20 ms)


def fault_hook(die, faults: list) -> Hook:
    """The hook of `faults` (`runtime.engine.faults.Fault`, all targeting `die`): at (step,
    layer, phase) a collective raises `LinkError` (err), this die's writes of that collective
    arrive `for` seconds late (delay) or never until the abort (drop), or the die SIGKILLs
    (kill) or SIGSTOPs (stop: the shell resumes it after `for=T`) itself. A `step` fault fires
    at the first step run from its step on (an idle step has nothing to run); the others at
    their exact step, or (at=T) at the first match once the shell armed them."""
    me = die.die_id
    words = die.words[me]
    hits = die.layout.serve_word(L.SV_FAULT_HITS)
    fault_at = die.layout.serve_word(L.SV_FAULT_AT)
    arm = die.layout.serve_word(L.SV_FAULT_ARM)
    left = {id(f): f.times for f in faults}
    gates = [0]  # the gates this die has reached

    def due(f, step: int, layer: int, phase: str) -> bool:
        if left[id(f)] <= 0 or f.layer not in (-1, layer) or f.phase not in ("", phase):
            return False
        if f.ordinal:  # armed by the shell at its time: this step is the one
            if words[arm] & ORDINAL_MASK < f.ordinal:
                return False
            f.step, f.ordinal = step, 0
        if f.phase in ("step", "gate"):  # the first step from S on (S may be idle), once armed
            return step >= f.step and bool(words[arm] & STEPS_ARMED)
        return step == f.step

    def hook(step: int, layer: int, phase: str) -> None:
        for f in faults:
            if not due(f, step, layer, phase):
                continue
            left[id(f)] -= 1
            words[fault_at] = time.monotonic_ns()
            words[hits] = ((int(words[hits]) & 0xFFFFFFFF) + 1) | (f.uid + 1) << 32
            if f.phase == "gate":  # the shell fires it now; this die goes on once it did
                gates[0] += 1
                _gate(die, words, arm, gates[0], step)
                continue
            if f.kind == "kill":  # dies here (mid-collective for its peers at a phase)
                os.kill(os.getpid(), signal.SIGKILL)
            if f.kind == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
                continue
            if f.kind == "err":
                raise LinkError(f"die {me}: injected link error in the {phase} of step {step},"
                                f" layer {layer}")  # fmt: skip
            _hold(die, f, step, layer, phase)

    return hook


def _gate(die, words, arm: int, n: int, step: int) -> None:
    """Wait until the shell released gate `n` of this die (or the launcher aborted the run)."""
    abort = die.ctx.abort
    while words[arm] >> GATE_SHIFT < n:
        if abort is not None and abort[0][abort[1]] != abort[2]:
            raise PodAborted(f"die {die.die_id}: aborted at the fault gate of step {step}")
        time.sleep(GATE_POLL_S)


def _hold(die, f, step: int, layer: int, phase: str) -> None:
    """delay / drop: this die's writes of the collective are late (peers wait) for `for`
    seconds, or until the launcher aborts the run."""
    end = time.monotonic() + (f.for_s if f.kind == "delay" else 3600.0)
    abort = die.ctx.abort
    while time.monotonic() < end:
        if abort is not None and abort[0][abort[1]] != abort[2]:
            raise PodAborted(f"die {die.die_id}: aborted while its {phase} write of step {step},"
                             f" layer {layer} was held back")  # fmt: skip
        time.sleep(0.001)
