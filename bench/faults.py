"""`xpod bench faults`: inject every fault kind and time how long the pod takes to report it.

```
xpod bench faults [--repeat 10] [--kinds die-kill-p2p,launcher-kill-run,...] [--json F]
```

Fault kinds (issue 8, "Done when"):
- `die-{kill,stop}-{idle,p2p,dispatch,combine,decode}`: SIGKILL / SIGSTOP of die 1 of a 4-die
  pod, between runs (`idle`: the fault lands, then `pod.run` is called) or while every die is
  inside a p2p stream, a fused dispatch loop, a pull combine loop or a toy-model decode (fused
  dispatch and combine in every MoE layer). The
  launcher must raise `DieCrashed` (kill) or `DieHung` (stop) naming die 1 and leave nothing.
- `launcher-{kill,term,int}-{idle,run}`: SIGKILL / SIGTERM / SIGINT of a launcher process (a
  child Python process with a 2-die pod), idle or inside `pod.run`. Every die must exit and every
  segment must go (after SIGKILL the dies unlink them themselves).

Per injection it records, in seconds:
- `detect_s`: from the moment the launcher can know (the kill, or the next `pod.run` for a
  die killed while idle; for a stopped die the end of its deadline, `timeout_s` after the stop
  or after that `pod.run`) to the error raised in the launcher (die faults), or from the signal
  to the last segment and die gone (launcher faults);
- `inject_s`: from the signal to that error (die faults; equal to `detect_s` for kills);
- whether anything was left in /dev/shm or the process table (`leaks`).
The table shows p50 and max over the repeats; `--json` writes one row per kind.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import comm
from bench.common import print_table, progress, run_info, write_jsonl
from runtime import DieCrashed, DieHung, Pod, PodConfig
from runtime.cli.argtypes import choice_list, output_file, positive_float, positive_int

PHASES = ("idle", "p2p", "dispatch", "combine", "decode")
DIE_KINDS = [f"die-{s}-{p}" for s in ("kill", "stop") for p in PHASES]
LAUNCHER_KINDS = [f"launcher-{s}-{p}" for s in ("kill", "term", "int") for p in ("idle", "run")]
KINDS = DIE_KINDS + LAUNCHER_KINDS
SIGNALS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP, "term": signal.SIGTERM,
           "int": signal.SIGINT}  # fmt: skip
VICTIM = 1
DIES = 4
SETTLE_S = 0.3  # after pod.run starts, the dies are inside the phase by then
ROOT = Path(__file__).resolve().parent.parent

# -- what the dies run while the fault lands ------------------------------------------------------


def p2p_stream(die) -> None:
    """Die 0 streams 1 MiB messages to die 1 until aborted; the others return."""
    if die.die_id > 1:
        return
    buf = np.zeros(1 << 20, np.uint8)
    for i in range(1 << 40):
        if die.die_id == 0:
            comm.send(die, buf, 1, i % (1 << 20))
        else:
            comm.recv(die, buf, 0, i % (1 << 20))


def _routing(die, batch: int, hidden: int, topk: int, experts: int):
    rng = np.random.default_rng(die.die_id)
    x = rng.standard_normal((batch, hidden)).astype(np.float32)
    idx = np.argsort(rng.random((batch, experts)), axis=1)[:, :topk].astype(np.int64)
    return x, idx, rng.random((batch, topk)).astype(np.float32)


def dispatch_loop(die) -> None:
    lo = die.layout
    args = _routing(die, lo.a2a_max_batch, lo.a2a_hidden, lo.a2a_topk, lo.a2a_num_experts)
    for i in range(1 << 40):
        comm.dispatch(die, *args, protocol="fused", event_id=i % (1 << 20))


def combine_loop(die) -> None:
    """One dispatch, then combines of it until aborted (pull: a fused dispatch is combined
    once; the fused combine is in the decode loop)."""
    lo = die.layout
    args = _routing(die, lo.a2a_max_batch, lo.a2a_hidden, lo.a2a_topk, lo.a2a_num_experts)
    d = comm.dispatch(die, *args, protocol="pull", event_id=0)
    for i in range(1 << 40):
        comm.combine(die, d.x, d.handle, event_id=i % (1 << 20))


def decode_spec():
    """A long toy-model decode (tiny preset) and the PodConfig it needs."""
    from runtime import decode as D
    from runtime.model import ModelConfig

    model = ModelConfig.preset("tiny")
    opts = D.DecodeOptions(dies=DIES, batch=8, prompt_len=16, steps=200, model="tiny")
    per_die, ids = D.spread(D.make_prompts(opts.batch, opts.prompt_len, 0), DIES)
    spec = D.DecodeSpec(model, per_die, ids, opts.steps, keep_logits=False)
    return spec, D.pod_config(model, per_die, opts)


def decode_loop(die, spec) -> None:
    from runtime.decode import decode_main

    while True:
        decode_main(die, spec)


def idle(die) -> int:
    return die.die_id


# -- one injection --------------------------------------------------------------------------------


@dataclass
class Shot:
    kind: str
    error: str
    message: str
    detect_s: float
    inject_s: float
    leaks: list[str]
    die_id: int | None = None


def _pod_config(phase: str, timeout_s: float):
    if phase == "decode":
        spec, cfg = decode_spec()
        return cfg.replace(timeout_s=timeout_s), (spec,)
    if phase in ("dispatch", "combine"):
        cfg = PodConfig(num_dies=DIES, a2a_max_batch=8, a2a_hidden=256, a2a_topk=4,
                        num_experts=8, app_bytes=1 << 20, timeout_s=timeout_s)  # fmt: skip
        return cfg, ()
    return PodConfig(num_dies=DIES, app_bytes=4 << 20, timeout_s=timeout_s), ()


RUN_FN = {"p2p": p2p_stream, "dispatch": dispatch_loop, "combine": combine_loop,
          "decode": decode_loop, "idle": idle}  # fmt: skip


def die_fault(kind: str, timeout_s: float = 1.0) -> Shot:
    """SIGKILL / SIGSTOP die 1 in `phase`; returns what the launcher raised and when."""
    _, sig_name, phase = kind.split("-")
    sig = SIGNALS[sig_name]
    cfg, extra = _pod_config(phase, timeout_s)
    pod = Pod.launch(cfg)
    names = [n.lstrip("/") for n in pod.segment_names()]
    pids = [p.pid for p in pod.procs]
    victim = pods_pid = pids[VICTIM]
    at: list[float] = []

    def inject() -> None:
        at.append(time.monotonic())
        os.kill(victim, sig)

    err: BaseException | None = None
    try:
        if phase == "idle":
            pod.run(idle)
            inject()
            time.sleep(0.05)  # the fault lands while nothing runs
            at.append(time.monotonic())  # the launcher can know from the next pod.run on
            pod.run(idle)
        else:
            timer = threading.Timer(SETTLE_S, inject)
            timer.start()
            try:
                pod.run(RUN_FN[phase], *extra)
            finally:
                timer.cancel()
    except (DieCrashed, DieHung) as e:
        err = e
    finally:
        raised = time.monotonic()
        pod.close()
        if sig == signal.SIGSTOP:  # a stopped die that the launcher failed to kill
            _kill_quietly(pods_pid)
    if err is None:
        raise AssertionError(f"{kind}: pod.run returned without an error")
    inject_s = raised - at[0]
    known = at[-1] if sig == signal.SIGKILL else at[-1] + timeout_s  # a stop: its deadline
    detect_s = max(0.0, raised - known)
    leaks = _leftovers(names, pids)
    return Shot(kind, type(err).__name__, str(err), detect_s, inject_s, leaks, err.die_id)


def _kill_quietly(pid: int) -> None:
    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGKILL)


def _leftovers(names: list[str], pids: list[int], wait_s: float = 10.0) -> list[str]:
    """What is left after up to `wait_s` (returns as soon as nothing is: a leak is what stays)."""
    deadline = time.monotonic() + wait_s
    while True:
        left = [f"/dev/shm/{n}" for n in names if os.path.exists(f"/dev/shm/{n}")]
        left += [f"pid {p}" for p in pids if _running(p)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.02)


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


LAUNCHER = textwrap.dedent(
    """
    import json, os, sys, time
    sys.path.insert(0, {root!r})
    from runtime import Pod, PodConfig

    def sleeper(die, seconds):
        os.write(1, b"in-run\\n")
        time.sleep(seconds)

    with Pod.launch(PodConfig(num_dies=2, app_bytes=1 << 20, timeout_s=30.0)) as pod:
        print(json.dumps(dict(segments=pod.segment_names(), pids=[p.pid for p in pod.procs])),
              flush=True)
        if sys.argv[1] == "run":
            pod.run(sleeper, 60)
        else:
            print("in-run", flush=True)
            time.sleep(60)
    """
)


def launcher_fault(kind: str) -> Shot:
    """Signal a launcher process (idle or inside pod.run); time until every die and segment of
    its pod is gone."""
    _, sig_name, phase = kind.split("-")
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "launcher.py"
        script.write_text(LAUNCHER.format(root=str(ROOT)))
        proc = subprocess.Popen([sys.executable, str(script), phase], stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True)  # fmt: skip
        try:
            info = json.loads(proc.stdout.readline())
            for _ in range(2 if phase == "run" else 1):
                proc.stdout.readline()
            time.sleep(0.1)
            names = [n.lstrip("/") for n in info["segments"]]
            t0 = time.monotonic()
            proc.send_signal(SIGNALS[sig_name])
            proc.wait(15)
            leaks = _leftovers(names, info["pids"], wait_s=5.0)
            gone = time.monotonic() - t0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
            proc.stdout.close()
    return Shot(kind, f"exit {proc.returncode}", "", gone, gone, leaks)


def inject(kind: str, timeout_s: float = 1.0) -> Shot:
    return launcher_fault(kind) if kind.startswith("launcher") else die_fault(kind, timeout_s)


# -- the command ----------------------------------------------------------------------------------


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kinds", type=choice_list(KINDS), default=",".join(KINDS),
                   help="comma list of fault kinds (default: all)")  # fmt: skip
    p.add_argument("--repeat", type=positive_int, default=10, help="injections per kind")
    p.add_argument("--timeout", type=positive_float, default=1.0,
                   help="the pods' timeout_s (a stopped die is hung after it)")  # fmt: skip
    p.add_argument("--json", type=output_file, default=None, help="one JSON line per kind")


@dataclass(frozen=True)
class Options:
    kinds: list[str]
    repeat: int
    timeout_s: float
    json: str | None


def parse_options(args: argparse.Namespace) -> Options:
    return Options(list(args.kinds), args.repeat, args.timeout, args.json)


def run(opts: Options) -> int:
    rows, bad = [], 0
    for kind in opts.kinds:
        shots = []
        for i in range(opts.repeat):
            progress(f"  {kind} {i + 1}/{opts.repeat}")
            shots.append(inject(kind, opts.timeout_s))
        errors = sorted({s.error for s in shots})
        leaks = sum(bool(s.leaks) for s in shots)
        bad += leaks
        d = np.array([s.detect_s for s in shots]) * 1e3
        j = np.array([s.inject_s for s in shots]) * 1e3
        rows.append({
            "bench": "faults", "kind": kind, "n": len(shots), "error": ",".join(errors),
            "detect_p50_ms": float(np.median(d)), "detect_max_ms": float(d.max()),
            "inject_p50_ms": float(np.median(j)), "inject_max_ms": float(j.max()),
            "leaks": leaks, "timeout_s": opts.timeout_s, **run_info(),
        })  # fmt: skip
    print_table(
        rows,
        [("kind", "kind", "<24"), ("n", "n", ">3"), ("error", "raised / exit", "<12"),
         ("detect_p50_ms", "detect p50 ms", ">13.1f"), ("detect_max_ms", "max", ">8.1f"),
         ("inject_p50_ms", "signal->raise p50", ">17.1f"), ("inject_max_ms", "max", ">8.1f"),
         ("leaks", "leaks", ">5")],
    )  # fmt: skip
    if opts.json:
        write_jsonl(opts.json, rows)
    return 1 if bad else 0
