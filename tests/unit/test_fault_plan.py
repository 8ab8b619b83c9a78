"""Fault plans in one process (runtime.engine.faults, fault_hook, fault_watch): what fires a
fault (the die, the die at a gate, or the shell), when `step=` fires in the die, how a hit names
its fault, and why a fault that never fired did not."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import numpy as np
import pytest

from memory import layout as L
from memory.errors import LinkError
from runtime.engine.fault_hook import GATE_SHIFT, STEPS_ARMED, fault_hook
from runtime.engine.fault_watch import FaultWatch
from runtime.engine.faults import FaultPlan, parse_faults


@pytest.mark.parametrize(
    "text, phase, in_die, gated",
    [
        ("kill:die=1,step=5", "step", True, False),  # the die kills itself at its step 5
        ("stop:die=3,step=5,for=1s", "step", True, False),  # an expert die of a split pod too
        ("kill:die=0,step=5,gen=1", "step", True, False),
        ("kill:master=0,step=5", "gate", True, True),  # the shell, while die 0 waits
        ("stop:output=1,step=5", "gate", True, True),
        ("kvfault:die=1,step=5", "gate", True, True),
        ("kill:die=1,at=2s,step=5", "", False, False),  # timed: the shell, once both are due
        ("kill:master=0,at=2s", "", False, False),
        ("kill:die=1,step=5,layer=1", "dispatch", True, False),  # before that collective
        ("err:die=1,step=5", "dispatch", True, False),
        ("delay:die=0,step=2,phase=kv,for=1s", "kv", True, False),
    ],
)
def test_who_fires_a_fault(text, phase, in_die, gated):
    (f,) = parse_faults(text, 2, output_procs=True, num_dies=4)
    assert (f.phase, f.in_die, f.gated) == (phase, in_die, gated)
    plan = FaultPlan([f])
    assert (f in plan.die_side, f in plan.armed) == (in_die, not in_die)


def test_every_fault_has_its_plan_position():
    fs = parse_faults("kill:die=1,step=5; err:die=0,step=9; stop:master=1,step=3", 2)
    assert [f.uid for f in fs] == [0, 1, 2]


def test_a_step_fault_of_another_incarnation_is_not_installed():
    a, b = parse_faults("kill:die=1,step=5,gen=1; kill:die=0,step=9", 2)
    plan = FaultPlan([a, b])
    assert plan.unfired_die_side(0) == (b,)
    assert plan.unfired_die_side(1) == (a, b)


def test_the_shell_fires_by_the_step_of_the_targets_part():
    plan = FaultPlan(parse_faults("kill:die=3,at=0.1s,step=12; stop:master=0,at=0.1s,step=4", 4))
    steps = {("die", 3): 11, ("master", 0): 4}  # a PD pod: decode die 3, prefill master 0
    due = plan.due(1.0, lambda f: steps[(f.target, f.index)])
    assert [f.text for f in due] == ["stop:master=0,at=0.1s,step=4"]
    steps[("die", 3)] = 12
    assert [f.index for f in plan.due(1.0, lambda f: steps[(f.target, f.index)])] == [3]


# -- the die's hook -----------------------------------------------------------------------------


class FakeDie:
    """What `fault_hook` reads of a die: its id, its serving words, the launcher's abort."""

    def __init__(self, die_id: int = 1):
        self.die_id = die_id
        self.layout = SimpleNamespace(serve_word=lambda w: w)
        self.words = {die_id: np.zeros(L.SERVE_WORDS, np.int64)}
        self.ctx = SimpleNamespace(abort=None)

    def hits(self) -> tuple[int, int]:
        w = int(self.words[self.die_id][L.SV_FAULT_HITS])
        return w & 0xFFFFFFFF, (w >> 32) - 1


def test_a_step_fault_fires_once_at_the_first_step_from_s_once_armed():
    die = FakeDie()
    (f,) = parse_faults("kill:die=1,step=5", 2)
    f.kind = "err"  # the same trigger, a fault that raises instead of killing the test
    hook = fault_hook(die, [f])
    hook(7, -1, "step")  # the warm-up's steps (not armed): nothing
    assert die.hits() == (0, -1)
    die.words[1][L.SV_FAULT_ARM] = STEPS_ARMED
    hook(4, -1, "step")
    hook(6, -1, "dispatch")  # another phase: not this fault's
    assert die.hits() == (0, -1)
    with pytest.raises(LinkError, match="step 6"):
        hook(6, -1, "step")  # step 5 was idle: the first step run from 5 on
    assert die.hits() == (1, f.uid)
    hook(7, -1, "step")  # once
    assert die.hits() == (1, f.uid)


def test_a_gate_waits_for_the_shell_to_release_it():
    die = FakeDie()
    faults = parse_faults("err:die=1,step=2; kill:master=1,step=3", 2)
    gate = faults[1]
    hook = fault_hook(die, [gate])
    die.words[1][L.SV_FAULT_ARM] = STEPS_ARMED
    hook(2, -1, "gate")  # not yet
    done = threading.Event()
    t = threading.Thread(target=lambda: (hook(3, -1, "gate"), done.set()))
    t.start()
    while die.hits()[0] < 1:  # the die recorded the hit, naming the gate's plan position
        pass
    assert die.hits() == (1, gate.uid) and not done.is_set()
    die.words[1][L.SV_FAULT_ARM] = STEPS_ARMED | 1 << GATE_SHIFT  # the shell fired it
    t.join(10)
    assert done.is_set()


def test_two_hits_between_looks_are_told_apart_by_the_latest_and_the_steps():
    fs = parse_faults("err:die=1,step=9; err:die=1,step=4; delay:die=1,step=6,for=1s", 2)
    plan = FaultPlan(fs)
    got = FaultWatch._hit_faults(plan, 1, 2, last=0, gen=0)  # two new hits, the latest uid 0
    assert [f.step for f in got] == [4, 9]
    assert [f.step for f in FaultWatch._hit_faults(plan, 1, 1, last=2, gen=0)] == [6]


# -- why a fault did not fire -------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, end_s, steps, gen, why",
    [
        (
            "kill:die=1,step=100",
            5.0,
            40,
            0,
            "the step was never reached: step=100, and die 1's part ran at most 40 steps",
        ),  # fmt: skip
        (
            "stop:master=0,at=30s",
            5.0,
            40,
            0,
            "the time at=30s was after the end (the engine ran 5.00 s)",
        ),  # fmt: skip
        (
            "kill:die=0,step=3,gen=2",
            5.0,
            40,
            1,
            "incarnation 2 never ran (the run ended in incarnation 1",
        ),  # fmt: skip
        ("delay:die=0,step=4,phase=kv,for=1s", 5.0, 40, 0, "transfer 4 was never reached"),
        ("err:die=1,at=1s", 5.0, 40, 0, "ran no dispatch once it was due"),
        ("kill:die=1,step=10", 5.0, 40, 1, "a restart counts its steps from 0 again"),
    ],
)
def test_why_a_fault_did_not_fire(text, end_s, steps, gen, why):
    (f,) = parse_faults(text, 2)
    plan = FaultPlan([f])
    ((g, reason),) = plan.not_fired(end_s, {(f.target, f.index): steps}, gen)
    assert g is f and why in reason, reason


def test_a_fired_fault_is_not_reported():
    a, b = parse_faults("kill:die=1,step=5; kill:die=0,step=100", 2)
    a.fired_at = 1.0
    plan = FaultPlan([a, b])
    assert [f.text for f, _ in plan.not_fired(9.0, {}, 0)] == ["kill:die=0,step=100"]
