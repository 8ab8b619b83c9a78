"""Fault injection for the serving engine (off by default, free when off: nothing in a die, a
master or the hot path changes; the shell's supervisor fires the faults by signal).

A plan is a `;`-separated list of faults, each `KIND:TARGET=N,WHEN[,for=T]`:

```
kill:die=2,step=300          SIGKILL die 2 once its step counter reaches 300
stop:die=1,at=4s,for=0.3s    SIGSTOP die 1 four seconds after launch, SIGCONT 0.3 s later
stop:master=0,at=2s          SIGSTOP master 0 for good (a hang: detected, then a restart)
kill:output=3,step=50        SIGKILL output process 3 (needs output processes)
kill:die=0,step=20,gen=1     SIGKILL die 0 at step 20 of the first restarted incarnation
kvfault:die=0,step=80        a memory fault in die 0's KV: a block its next rows hold
kvfault:die=1,at=3s,block=5  a memory fault in block 5 of die 1 (in use or not)
err:die=1,step=40,layer=2,phase=combine   die 1's combine of layer 2 at step 40 raises
                                          LinkError (a link fault): an iteration rollback
drop:die=0,step=40,layer=1   die 0's dispatch writes of layer 1 at step 40 never arrive (a lost
                             write: its peers' op deadline passes): an iteration rollback
delay:die=0,step=40,for=0.2s the same writes 0.2 s late (below the op deadline: nothing happens)
kill:die=2,step=40,layer=1,phase=combine  die 2 SIGKILLs itself right before that combine
kill:pool=0,at=10s           SIGKILL KV pool server 0 (needs the pool: EngineConfig.kv_pool)
stop:pool=0,at=5s,for=2s     SIGSTOP it, SIGCONT 2 s later (its loads time out: recomputed)
```

- KIND: `kill` (SIGKILL), `stop` (SIGSTOP; `for=T` sends SIGCONT after T, else never) or
  `kvfault` (die targets only: the shell writes a fault report into the die's `kv_fault` serving
  word, as a runtime reports an uncorrectable memory error; `block=B`, else a block the die's
  next rows hold; the die poisons it and drops the rows that hold it, the master masks it for
  good and recomputes its holders: the KV-masking tier), or die-side collective faults (hooks
  installed in the targeted die only, `ServeSpec.faults`): `err` (the collective raises
  `LinkError`), `drop` (this die's writes of that collective are held back until the abort: to
  its peers a lost completion word), `delay` (held back `for=T`); keys `layer=L` (default any
  MoE layer), `phase=dispatch|combine|kv` (default dispatch; kv: a PD prefill die's KV thread
  mid-transfer, after it marked the transfer started, `step` = its transfer number: `delay`
  holds the copy back, `kill` kills the die mid-transfer), `times=N` (fire on N attempts of
  that step: N > 3 escalates a rollback to a restart). These take `step=S` (the die's own
  step counter) or `at=T` (the shell arms the die through its `fault_arm` serving word at T;
  the hook fires at the die's next matching collective). A `kill` of a die with `phase=` is
  die-side too: the die SIGKILLs itself right before that collective (mid-dispatch or
  mid-combine for its peers, a window no signal from outside can hit); verified by its exit.
- TARGET: `die`, `master`, `output` or `pool` and its index (a die index = its DP group; a
  pool index = a KV pool server, 0..servers-1, with `kv_pool` on only). A pool server is
  outside the pod (KVPOOL.md §4.8): `kill` / `stop` at `at=T` only (it has no steps, and no
  incarnation: it outlives the pod's restarts); the shell sees a killed one exit and restarts
  it (`runtime.engine.pool_shell.PoolShell.watch`, logged as a `pool_exit` detection and a
  `pool_restart` recovery), a stopped one costs its loads their timeout (recomputed), never
  a pod restart.
- WHEN: `step=S` and / or `at=T` (seconds since the engine launched); with both, the later
  one. `gen=G`: only in incarnation G (0 = as launched, +1 per restart; default any). Each
  fault fires once; a fault due while a restart is under way waits.
- What `step=S` counts: the steps of the target's own part in the current incarnation (each
  incarnation counts from 0; the launch's warm-up step is step 1). A part is the set of dies
  that step in lockstep: every die of a colocated pod; in a PD pod the prefill dies, and apart
  from them the decode dies (each part's own steps: a decode die's step 12 is the 12th step
  the decode dies ran, whatever the prefill dies did); in a split pod the attention dies, whose
  steps the expert dies serve (an expert die's step S is the attention dies' step S). A master
  or output process counts the steps of its group's die. A step counts whether or not that
  die had rows in it (a lockstep step of its part), and only while the part runs: an idle,
  parked part does not step.
- A fault at `step=S` alone fires at the first step its part runs from S on, exactly there on
  any machine, however fast the steps (`runtime.engine.fault_hook`): a die's `kill` / `stop` is
  fired by the die itself at the start of that step (phase "step"; `stop` then waits for the
  shell's SIGCONT after `for=T`); a master's or output process's `kill` / `stop` and a
  `kvfault` are fired by the shell while the group's die waits for it at the top of that step,
  before its vote (phase "gate"). With `at=T` too, the shell fires it once it sees both its
  time and its step (within a tick). The warm-up steps of a launch never fire one.

Every firing is verified, and a fault that did not fire is a failure of the run: a killed
process must be gone (or a zombie) within `VERIFY_S`, a stopped one in state `T` (procfs), a
KV fault reported back by the die's master (the block masked), a die-side fault by the die's
`fault_hits` serving word. A planned fault that never fired is reported when the engine closes
(`FaultPlan.not_fired`: the step never reached, the incarnation never ran, the time after the
end): on stderr, in the fault log (`"event": "not_fired"`) and in the summaries.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field

KINDS = ("kill", "stop", "kvfault", "err", "drop", "delay")
DIE_SIDE = ("err", "drop", "delay")  # fired inside the die, by a hook
PHASES = ("dispatch", "combine", "kv")  # the collectives a die-side fault may hit
TARGETS = ("die", "master", "output", "pool")
POOL_KINDS = ("kill", "stop")  # what a plan may do to a KV pool server
NOT_BUILT = ("random",)
VERIFY_S = 0.5  # a fired fault must show (process gone / stopped) within this
_TIME = re.compile(r"^(\d+(?:\.\d*)?|\.\d+)(ms|s)?$")


class FaultSpecError(ValueError):
    """A fault plan that cannot be parsed (the message names the fault and the field)."""


@dataclass
class Fault:
    """One fault of a plan, and what happened to it."""

    kind: str
    target: str
    index: int
    step: int = 0
    at_s: float = 0.0
    for_s: float | None = None
    gen: int | None = None
    block: int = -1  # kvfault: the block (-1: one the die's next rows hold)
    layer: int = -1  # err / drop / delay: the MoE layer (-1: the first one the step runs)
    phase: str = ""  # err / drop / delay: "dispatch" or "combine" ("": the first of them)
    times: int = 1  # err / drop / delay: attempts of the step it fires on
    ordinal: int = 0  # err / drop / delay at=T: fires once the die's fault_arm word reaches it
    text: str = ""
    fired_at: float = 0.0  # time.monotonic() of the signal
    pid: int = 0
    verified: bool = False
    detail: str = ""
    resumed_at: float = 0.0  # a `stop ... for=T`: when SIGCONT went out
    uid: int = -1  # its position in the plan (a die names the fault it fired by it)
    extra: dict = field(default_factory=dict)

    @property
    def in_die(self) -> bool:
        """Triggered by a hook inside a die: err / drop / delay, a kill at a phase, a kill /
        stop of a die at the start of a step (phase "step"), or a fault the shell fires while
        the die waits at the start of the step (phase "gate": a master's or output process's
        kill / stop, a KV fault)."""
        return self.kind in DIE_SIDE or (
            self.kind in ("kill", "stop", "kvfault") and self.phase in ("step", "gate", *PHASES)
        )

    @property
    def gated(self) -> bool:
        """Fired by the shell while the group's die waits for it at the start of its step."""
        return self.phase == "gate"

    @property
    def name(self) -> str:
        return f"{self.target} {self.index}"

    def record(self) -> dict:
        """A JSON-able record (the fault log, `xpod bench chaos`)."""
        return {"fault": self.text, "kind": self.kind, "target": self.target,
                "index": self.index, "pid": self.pid, "fired_at": self.fired_at,
                "verified": self.verified, "detail": self.detail}  # fmt: skip


def _seconds(text: str, what: str) -> float:
    m = _TIME.match(text.strip())
    if not m:
        raise FaultSpecError(f"{what}: {text!r} is not a time (like 2, 0.3s or 300ms)")
    v = float(m.group(1))
    return v / 1000 if m.group(2) == "ms" else v


def read_plan(text: str) -> str:
    """A plan, or `@FILE`: the plan in that file (long plans of `xpod bench chaos`)."""
    if not text.startswith("@"):
        return text
    try:
        with open(text[1:]) as fh:
            return fh.read()
    except OSError as e:
        raise FaultSpecError(f"fault plan file {text[1:]!r}: {e.strerror}") from None


def parse_faults(text: str, num_groups: int, output_procs: bool = False,
                 num_dies: int | None = None, pool_servers: int = 0) -> list[Fault]:  # fmt: skip
    """The faults of a plan (see the module docstring; `@FILE` reads it from a file);
    FaultSpecError names a bad one. `num_dies`: the pod's dies when more than the groups (a
    split pod's expert dies, which a plan may kill or stop); `pool_servers`: the engine's KV
    pool servers (0: no pool, and a `pool=N` target is refused)."""
    num_dies = num_groups if num_dies is None else num_dies
    text = read_plan(text or "")
    faults = []
    for part in (p.strip() for p in (text or "").split(";")):
        if not part:
            continue
        kind, sep, rest = part.partition(":")
        kind = kind.strip()
        if kind in NOT_BUILT:
            raise FaultSpecError(
                f"fault {part!r}: kind {kind!r} is not built (kinds: {', '.join(KINDS)}; xpod"
                " bench chaos draws seeded mixes)"
            )
        if kind not in KINDS or not sep:
            raise FaultSpecError(f"fault {part!r}: expected KIND:TARGET=N,... with KIND one of"
                                 f" {', '.join(KINDS)}")  # fmt: skip
        f = Fault(kind, "", -1, text=part)
        for item in (i.strip() for i in rest.split(",")):
            key, eq, val = item.partition("=")
            key, val = key.strip(), val.strip()
            if not eq or not val:
                raise FaultSpecError(f"fault {part!r}: {item!r} is not key=value")
            if key in TARGETS:
                if f.target:
                    raise FaultSpecError(f"fault {part!r}: two targets ({f.target}, {key})")
                if key == "pool" and not pool_servers:
                    raise FaultSpecError(f"fault {part!r}: pool={val}: the engine has no KV pool"
                                         " (kv_pool / --kv-pool is off)")  # fmt: skip
                top = {"die": num_dies, "pool": pool_servers}.get(key, num_groups)
                if not val.isdigit() or int(val) >= top:
                    raise FaultSpecError(f"fault {part!r}: {key}={val}: must be an index in"
                                         f" [0, {top})")  # fmt: skip
                f.target, f.index = key, int(val)
            elif key == "step":
                if not val.isdigit() or int(val) < 1:
                    raise FaultSpecError(f"fault {part!r}: step={val}: must be an int >= 1")
                f.step = int(val)
            elif key == "block":
                if kind != "kvfault" or not val.isdigit():
                    raise FaultSpecError(f"fault {part!r}: block={val}: an int >= 0, for kvfault")
                f.block = int(val)
            elif key == "gen":
                if not val.isdigit():
                    raise FaultSpecError(f"fault {part!r}: gen={val}: must be an int >= 0")
                f.gen = int(val)
            elif key == "at":
                f.at_s = _seconds(val, f"fault {part!r}: at")
            elif key == "for":
                if kind not in ("stop", "delay"):
                    raise FaultSpecError(f"fault {part!r}: for= applies to stop and delay only")
                f.for_s = _seconds(val, f"fault {part!r}: for")
            elif key in ("layer", "times"):
                if kind not in (*DIE_SIDE, "kill") or not val.isdigit():
                    raise FaultSpecError(f"fault {part!r}: {key}={val}: an int, for"
                                         f" {'/'.join(DIE_SIDE)}")  # fmt: skip
                setattr(f, key, int(val))
            elif key == "phase":
                if kind not in (*DIE_SIDE, "kill") or val not in ("dispatch", "combine", "kv"):
                    raise FaultSpecError(f"fault {part!r}: phase={val}: dispatch, combine or kv"
                                         f" (a PD prefill die's KV thread), for"
                                         f" {'/'.join(DIE_SIDE)}")  # fmt: skip
                f.phase = val
            else:
                raise FaultSpecError(f"fault {part!r}: unknown key {key!r} (die, master,"
                                     " output, pool, step, at, for, gen, block, layer, phase,"
                                     " times)")  # fmt: skip
        if not f.target:
            raise FaultSpecError(f"fault {part!r}: no target (die=N, master=N, output=N or"
                                 " pool=N)")  # fmt: skip
        if f.target == "pool":
            _check_pool(f, part)
        expert = f.target == "die" and f.index >= num_groups
        if expert and (kind not in ("kill", "stop") or f.phase or f.layer >= 0):
            raise FaultSpecError(f"fault {part!r}: die {f.index} is an expert die of a split"
                                 " pod: kill or stop it (at a step or a time)")  # fmt: skip
        if kind in ("kvfault", *DIE_SIDE) and f.target != "die":
            raise FaultSpecError(f"fault {part!r}: {kind} targets a die (die=N)")
        if f.step and not f.at_s and not (f.phase or f.layer >= 0 or f.times != 1):
            if f.target == "die" and kind in ("kill", "stop"):
                f.phase = "step"  # fired by the die at the start of its step S
            elif kind in ("kill", "stop", "kvfault"):
                f.phase = "gate"  # fired by the shell while the die waits at step S
        if kind == "kill" and (f.phase in PHASES or f.layer >= 0 or f.times != 1):
            if f.target != "die":
                raise FaultSpecError(f"fault {part!r}: a kill at a layer / phase targets a die")
            f.phase = f.phase or "dispatch"
        if f.in_die and f.phase not in ("step", "gate"):
            if bool(f.step) == bool(f.at_s) or f.gen is not None:
                raise FaultSpecError(f"fault {part!r}: {kind} takes step=S (the die's own step)"
                                     " or at=T (armed by the shell then: the die's next"
                                     " collective)")  # fmt: skip
            if kind == "delay" and f.for_s is None:
                raise FaultSpecError(f"fault {part!r}: delay needs for=T")
            f.phase = f.phase or "dispatch"
        if f.target == "output" and not output_procs:
            raise FaultSpecError(f"fault {part!r}: output processes are off (--output-procs)")
        if not f.step and not f.at_s:
            raise FaultSpecError(f"fault {part!r}: say when (step=S and / or at=T)")
        f.uid = len(faults)
        faults.append(f)
    for d in {f.index for f in faults}:  # the arming order of a die's at=T die-side faults
        timed = sorted((f for f in faults if f.in_die and f.index == d and f.at_s),
                       key=lambda f: f.at_s)  # fmt: skip
        for k, f in enumerate(timed):
            f.ordinal = k + 1
    return faults


def _check_pool(f: Fault, part: str) -> None:
    """A KV pool server's fault: kill or stop, at a time (module docstring)."""
    if f.kind not in POOL_KINDS:
        raise FaultSpecError(f"fault {part!r}: a pool server can be killed or stopped, not"
                             f" {f.kind}")  # fmt: skip
    if f.step or f.gen is not None or f.phase or f.layer >= 0 or f.times != 1:
        raise FaultSpecError(f"fault {part!r}: a pool server has no steps, incarnations or"
                             " collectives: say when with at=T only")  # fmt: skip
    if not f.at_s:
        raise FaultSpecError(f"fault {part!r}: say when with at=T (seconds since launch)")


def proc_state(pid: int) -> str:
    """procfs state letter of `pid` ("" if it is gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read()
    except OSError:
        return ""
    return stat[stat.rfind(b")") + 2 :][:1].decode()


class FaultPlan:
    """The armed faults of an engine; the supervisor calls `due`, `fire` and `tick`."""

    def __init__(self, faults: list[Fault]):
        self.faults = faults
        self.armed = [f for f in faults if not f.in_die]  # fired by the supervisor
        self.die_side = [f for f in faults if f.in_die]  # by hooks in the dies
        self.resume: list[Fault] = []  # stopped for a while: SIGCONT due

    def due(self, since_launch_s: float, step_of: Callable[[Fault], int], gen: int = 0,
            ) -> list[Fault]:  # fmt: skip
        """Faults whose time has come in incarnation `gen` (removed from the armed list);
        `step_of(f)`: the step f's target's part has reached (the module docstring)."""
        out = [f for f in self.armed
               if since_launch_s >= f.at_s and (not f.step or step_of(f) >= f.step)
               and (f.gen is None or f.gen == gen)]  # fmt: skip
        for f in out:
            self.armed.remove(f)
        return out

    def fire(self, f: Fault, pid: int) -> None:
        """Send the fault's signal to `pid` and verify it took (`verified`, `detail`)."""
        f.pid, f.fired_at = pid, time.monotonic()
        if pid <= 0 or not proc_state(pid):
            f.detail = f"{f.name} has no live process (pid {pid})"
            return
        sig = signal.SIGKILL if f.kind == "kill" else signal.SIGSTOP
        try:
            os.kill(pid, sig)
        except OSError as e:
            f.detail = f"{sig.name} to pid {pid}: {e}"
            return
        want = ("", "Z", "X") if f.kind == "kill" else ("T", "t")
        deadline = f.fired_at + VERIFY_S
        while True:
            st = proc_state(pid)
            if st in want:
                f.verified = True
                f.detail = f"{sig.name} pid {pid}: state {st or 'gone'}"
                break
            if time.monotonic() > deadline:
                f.detail = f"{sig.name} pid {pid}: still in state {st!r} after {VERIFY_S} s"
                break
            time.sleep(0.002)
        if f.kind == "stop" and f.for_s is not None and f.verified:
            self.resume.append(f)

    def verify_stopped(self, f: Fault) -> None:
        """A die that stopped itself (a `stop` at a step): verified in procfs within
        `VERIFY_S` (it counted the hit just before it stopped), then resumed after `for=T`."""
        deadline = time.monotonic() + VERIFY_S
        while (st := proc_state(f.pid)) not in ("T", "t"):
            if time.monotonic() > deadline or st in ("", "Z", "X"):
                f.verified = False
                f.detail = f"die {f.index} counted its stop but is in state {st or 'gone'!r}"
                return
            time.sleep(0.002)
        f.detail = f"die {f.index} stopped itself at the start of step {f.step}"
        if f.for_s is not None:
            self.resume.append(f)

    def tick(self, now: float) -> None:
        """SIGCONT to the processes stopped for a while whose time is up."""
        for f in [f for f in self.resume if now - f.fired_at >= f.for_s]:
            self.resume.remove(f)
            f.resumed_at = now
            with contextlib.suppress(OSError):  # killed by a restart meanwhile
                os.kill(f.pid, signal.SIGCONT)

    def release(self, target: str | None = None) -> None:
        """SIGCONT to every process still stopped by a plan (teardown must not leave one);
        `target`: only those of that target ("pool": before the engine stops its pool server,
        which a stopped one could not answer)."""
        for f in [f for f in self.resume if target in (None, f.target)]:
            self.resume.remove(f)
            with contextlib.suppress(OSError):
                os.kill(f.pid, signal.SIGCONT)

    def due_die_side(self, since_launch_s: float) -> list[Fault]:
        """Die-side at=T faults whose time has come and that have not fired: (re)armed."""
        return [f for f in self.die_side
                if f.ordinal and not f.fired_at and since_launch_s >= f.at_s]  # fmt: skip

    def unfired_die_side(self, gen: int = 0) -> tuple[Fault, ...]:
        """The die-side faults not fired yet that incarnation `gen` may fire (a relaunched pod
        gets only these)."""
        return tuple(f for f in self.die_side if not f.fired_at and f.gen in (None, gen))

    @property
    def unfired(self) -> list[Fault]:
        return list(self.armed) + [f for f in self.die_side if not f.fired_at]

    def not_fired(self, end_s: float, steps: dict[tuple[str, int], int], gen: int,
                  ) -> list[tuple[Fault, str]]:  # fmt: skip
        """Every planned fault that did not fire, with why, once the engine ran `end_s`
        seconds in `gen + 1` incarnations; `steps[(target, index)]`: the most steps its part
        ran in one incarnation."""
        return [(f, self.why_not(f, end_s, steps.get((f.target, f.index), 0), gen))
                for f in self.unfired]  # fmt: skip

    @staticmethod
    def why_not(f: Fault, end_s: float, steps: int, gen: int) -> str:
        """Why `f` did not fire (see `not_fired`)."""
        who = f"{f.target} {f.index}"
        if f.gen is not None and f.gen > gen:
            return (f"incarnation {f.gen} never ran (the run ended in incarnation {gen}:"
                    f" {gen} restart(s))")  # fmt: skip
        if f.at_s and f.at_s > end_s:
            return f"the time at={f.at_s:g}s was after the end (the engine ran {end_s:.2f} s)"
        if f.target == "pool":
            return (f"{who} was off when it was due (out of restarts), or the engine closed"
                    " first")  # fmt: skip
        if f.phase == "kv" and f.step:
            return (f"transfer {f.step} was never reached: {who} made fewer KV transfers"
                    " (is it a prefill die of a PD pod?)")  # fmt: skip
        if f.step and steps < f.step:
            return (f"the step was never reached: step={f.step}, and {who}'s part ran at"
                    f" most {steps} steps in an incarnation")  # fmt: skip
        if steps == 0 and not f.step:
            return f"the target never ran: {who} ran no step after it was due"
        if f.extra.get("gate_hit"):
            return f"its step came as the engine was closing ({who}'s part reached step {f.step})"
        if f.in_die and f.phase in PHASES:
            where = f" of layer {f.layer}" if f.layer >= 0 else ""
            return (f"the target never ran a matching collective: {who} ran no {f.phase}{where}"
                    " once it was due")  # fmt: skip
        return (f"its moment passed while {who} was down or restarting (a restart counts its"
                f" steps from 0 again; it reached {steps} steps)")  # fmt: skip
