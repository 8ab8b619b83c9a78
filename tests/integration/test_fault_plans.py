"""Fault plans through the commands a researcher runs (runtime.engine.faults, fault_hook,
supervisor): a planned fault that never fires is reported, with why (stderr, the fault log,
`generate --json`, `serve`'s shutdown and `/metrics`); `step=S` counts the steps of the target's
own part (a PD pod's prefill or decode dies, a split pod's attention dies, whose steps the
expert dies serve) and fires at that step on any machine, so a step-triggered kill of a prefill
die, a decode die, an expert die and a master each fires, is detected and recovered, and every
completion equals the fault-free run's (batch-invariant, greedy).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.test_api_server import ServerProc, metric

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["The pod is", "zz", "experts run on every die", "a decode step moves tokens"]


def generate(tmp_path: Path, *args: str, name: str = "run") -> tuple[int, str, dict, list]:
    """`xpod generate` in a subprocess (its real stderr): (status, stderr, summary, fault log)."""
    js, log = tmp_path / f"{name}.json", tmp_path / f"{name}.jsonl"
    cmd = [sys.executable, "-m", "runtime.cli", "generate", "--model", "tiny", "--timeout", "60",
           "--quiet", "--json", str(js), "--fault-log", str(log), *args]  # fmt: skip
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    summary = json.loads(js.read_text())["summary"] if js.exists() else {}
    records = [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []
    out = json.loads(js.read_text())["requests"] if js.exists() else []
    summary["_tokens"] = [e["token_ids"] for e in out]
    return r.returncode, r.stderr, summary, records


def _prompts(n: int = 4) -> list[str]:
    return [a for p in PROMPTS[:n] for a in ("--prompt", p)]


# -- a fault that never fires -------------------------------------------------------------------

NEVER = [
    ("kill:die=1,step=100000", "the step was never reached: step=100000"),
    ("stop:master=0,step=100000", "the step was never reached"),  # a gate that never opens
    ("stop:master=0,at=1000s", "the time at=1000s was after the end"),
    ("kill:die=0,step=3,gen=2", "incarnation 2 never ran"),
    ("err:die=1,at=1000s", "the time at=1000s was after the end"),  # die-side, armed by time
]


@pytest.fixture(scope="module")
def never_run(tmp_path_factory) -> tuple[int, str, dict, list]:
    """One `xpod generate` whose plan holds every fault of NEVER (each reported on its own, with
    its own why: one run instead of five pods launched)."""
    plan = "; ".join(p for p, _ in NEVER)
    return generate(tmp_path_factory.mktemp("never"), "--dies", "2", "--max-tokens", "8",
                    *_prompts(1), "--inject", plan)  # fmt: skip


@pytest.mark.timeout(240)
@pytest.mark.parametrize("plan, why", NEVER)
def test_a_planned_fault_that_never_fires_is_reported(never_run, plan, why):
    code, err, s, records = never_run
    assert code == 0, err  # the run itself is fine
    assert f"planned fault {plan!r} did not fire: {why}" in err, err
    (rec,) = [r for r in records if r["event"] == "not_fired" and r["fault"] == plan]
    assert why in rec["reason"], rec
    assert len([r for r in records if r["event"] == "not_fired"]) == len(NEVER), records
    assert not [r for r in records if r["event"] == "injected"], records
    f = s["faults"]
    assert (f["planned"], f["fired"], f["verified"], f["detected"], f["recovered"]) == (
        len(NEVER), 0, 0, 0, 0)  # fmt: skip
    assert sorted(f["not_fired"]) == sorted(p for p, _ in NEVER), f
    assert why in f["not_fired_reasons"][f["not_fired"].index(plan)], f


@pytest.mark.timeout(240)
def test_fired_and_not_fired_are_counted_apart(tmp_path):
    plan = "kill:die=1,step=6; kill:die=0,step=100000"
    code, err, s, records = generate(tmp_path, "--dies", "2", "--max-tokens", "30",
                                     "--ignore-eos", *_prompts(2), "--inject", plan)  # fmt: skip
    assert code == 0, err
    f = s["faults"]
    assert (f["planned"], f["fired"], f["verified"], f["detected"], f["recovered"]) == (
        2, 1, 1, 1, 1), f  # fmt: skip
    assert f["not_fired"] == ["kill:die=0,step=100000"], f
    assert s["finish_reasons"]["length"] == 2
    events = [r["event"] for r in records]
    assert events.count("injected") == 1 and events.count("not_fired") == 1, events


# -- step= in every kind of pod ----------------------------------------------------------------

LAYOUTS = {
    "colocated": ["--dies", "2"],
    "pd": ["--prefill-dies", "2", "--decode-dies", "2"],
    "split": ["--attention-dies", "2", "--expert-dies", "2"],
}
STEP_FAULTS = [
    ("pd", "kill:die=3,step=12", "exit"),  # a decode die at the decode dies' step 12
    ("pd", "kill:die=0,step=3", "exit"),  # a prefill die, mid-prefill (16-token chunks)
    ("split", "kill:die=3,step=12", "exit"),  # an expert die, at the attention dies' step 12
    ("colocated", "kill:master=1,step=12", "exit"),  # a gate: the shell fires, die 1 waits
    ("pd", "stop:die=2,step=12", "hang|stall|heartbeat"),  # stopped for good: a hang
]
_FREE: dict[str, list] = {}


def _args(layout: str) -> list[str]:
    return [*LAYOUTS[layout], "--batch-invariant", "--max-tokens", "40", "--ignore-eos",
            "--max-num-batched-tokens", "16", *_prompts()]  # fmt: skip


def _fault_free(tmp_path: Path, layout: str) -> list:
    if layout not in _FREE:
        code, err, s, _ = generate(tmp_path, *_args(layout), name=f"free-{layout}")
        assert code == 0, err
        _FREE[layout] = s["_tokens"]
    return _FREE[layout]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout, plan, how", STEP_FAULTS)
def test_a_step_fault_fires_in_its_part_and_is_recovered(tmp_path, layout, plan, how):
    want = _fault_free(tmp_path, layout)
    code, err, s, records = generate(tmp_path, *_args(layout), "--inject", plan)
    assert code == 0, err
    f = s["faults"]
    assert (f["planned"], f["fired"], f["verified"], f["not_fired"]) == (1, 1, 1, []), (f, err)
    assert f["detected"] == 1 and f["recovered"] == 1, (f, records)
    det = next(r for r in records if r["event"] == "detected")
    assert det["kind"] in how.split("|") and det["fault"] == plan, det
    rec = next(r for r in records if r["event"] == "recovered")
    assert rec["tier"] == "restart" and rec["requests_resumed"] >= 1, rec
    assert s["finish_reasons"]["length"] == len(PROMPTS), s["finish_reasons"]
    assert s["_tokens"] == want  # every stream continues as if nothing happened


# -- serve: /metrics while it runs, the report at shutdown ------------------------------------


@pytest.mark.timeout(120)
def test_serve_counts_the_plan_and_reports_what_did_not_fire():
    plan = "kill:die=1,step=100000; stop:master=0,at=1000s"
    s = ServerProc("--inject", plan)
    try:
        status, _, _ = s.post("/v1/completions", {"prompt": "hi", "max_tokens": 4})
        assert status == 200
        m = s.metrics()
        assert metric(m, "xpod_faults_planned") == 2
        assert metric(m, "xpod_faults_fired") == 0
        assert metric(m, "xpod_faults_not_fired") == 2  # not yet
    finally:
        err = s.stop()
    for text in plan.split("; "):
        assert f"planned fault {text!r} did not fire" in err, err
    assert "faults: planned 2, fired 0" in err and "not fired 2" in err, err
