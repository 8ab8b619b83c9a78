"""The toy model on a split pod (MoE-attention disaggregation): `xpod decode` and the serving
engine with attention dies and expert dies (runtime.model.split, runtime.engine.split_loop).

Decode: tokens and logits bit-equal to the replay of the same topology and schedule
(`SplitReference`) for 2+2, 2+6, 3+5 dies, D 1-3, m 1-2, INT8 on and off; greedy tokens equal to
the colocated model's; no message reaches an expert die while it loops; one metadata write per
attention die per A2E call; the expert dies run MoE layers x D x m calls per step. Some shapes
leave a micro-batch, or a whole domain, without requests.

Serving: the schedule replay of a split engine is bit-equal; a killed or stopped expert die is
detected and the engine recovers (every stream continues as in the fault-free run); a plan that
names an impossible fault for an expert die is refused; the split server parks its expert dies.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from memory import layout as L
from memory.errors import ConfigError
from runtime.decode import DecodeOptions, run_decode
from runtime.engine import Engine, EngineConfig
from runtime.engine.replay import replay
from sched import SamplingParams
from tests.waiting import wait_for

SHM = Path("/dev/shm")
EXPERTS = 30  # splits over 2, 3, 5 and 6 expert dies


def decode(a: int, e: int, d: int, m: int, quant, batch: int = 6, steps: int = 4, **kw) -> dict:
    opts = DecodeOptions(dies=a + e, attention_dies=a, expert_dies=e, domains=d, microbatches=m,
                         batch=batch, prompt_len=10, steps=steps, model="tiny", quant=quant,
                         check=True, timeout_s=30, overrides={"num_experts": EXPERTS},
                         **kw)  # fmt: skip
    return run_decode(opts)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "a, e, d, m, quant, batch",
    [
        # every shape x D x m x INT8 runs at the collective level (test_split_alltoall.py)
        (2, 2, 2, 2, "int8", 6),
        (2, 6, 1, 2, None, 6),
        (3, 5, 3, 2, None, 4),  # die 0 holds 2 requests, dies 1 and 2 one: an empty micro-batch
        (3, 5, 2, 1, "int8", 2),  # die 2 (domain 1) has no request: a domain without work
    ],
)
def test_split_decode_equals_the_replay_and_the_colocated_model(a, e, d, m, quant, batch):
    s = decode(a, e, d, m, quant, batch)
    assert s["layout"] == "split" and (s["attention_dies"], s["expert_dies"]) == (a, e)
    assert (s["domains"], s["microbatches"]) == (d, m)
    assert s["mismatched_tokens"] == 0 and s["logits_bit_equal"], s
    assert s["replay_total_tokens"] == batch * 5
    assert s["greedy_equal_colocated"], s
    # other matmul groupings than colocated: a bound, stated in the docs (architecture §5.4)
    assert s["colocated_logits_max_abs_diff"] < 1e-2, s
    assert s["expert_control_messages"] == 0
    assert s["a2e_metadata_writes_per_step"] == 1.0
    moe = 2  # tiny: 3 layers, the first dense
    assert s["expert_a2e_calls_per_step"] == moe * d * m == s["expected_expert_calls_per_step"]
    assert s["attention_a2e_calls_per_step"] == moe * m
    assert 0.0 <= s["expert_idle_share"] < 1.0
    assert not [p for p in SHM.iterdir() if p.name.startswith("xpod.")]


def test_split_decode_refuses_impossible_shapes():
    with pytest.raises(ConfigError, match="domains"):
        decode(2, 6, 3, 1, None)  # 3 domains of 2 attention dies
    with pytest.raises(ConfigError, match="num_experts"):
        run_decode(DecodeOptions(dies=8, attention_dies=3, expert_dies=5, model="tiny"))
    with pytest.raises(ConfigError, match="trampolines"):
        decode(4, 2, 1, 1, None)
    with pytest.raises(ConfigError, match="eplb"):
        decode(2, 2, 1, 1, None, eplb="on")


def test_the_decode_cli_writes_the_split_figures(tmp_path):
    out, trace = tmp_path / "d.jsonl", tmp_path / "t.json"
    r = subprocess.run(
        [sys.executable, "-m", "runtime.cli", "decode", "--attention-dies", "2", "--expert-dies",
         "6", "--domains", "2", "--microbatches", "2", "--check", "--trace", str(trace),
         "--model", "tiny", "--experts", "24", "--batch", "4", "--prompt-len", "8", "--steps",
         "3", "--json", str(out)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    s = json.loads(out.read_text().splitlines()[-1])
    for key in ("attention_dies", "expert_dies", "domains", "microbatches",
                "mismatched_tokens", "greedy_equal_colocated", "expert_control_messages",
                "a2e_metadata_writes_per_step", "expert_idle_share",
                "model_error_max"):  # fmt: skip
        assert key in s, key
    assert s["mismatched_tokens"] == 0 and s["expert_control_messages"] == 0
    assert "expert dies" in r.stdout and "idle" in r.stdout
    # the pipeline per die on the timeline: attention, A2E, experts, E2A tracks (001 Fig. 19)
    events = json.loads(trace.read_text())
    events = events["traceEvents"] if isinstance(events, dict) else events
    names = {(e.get("pid"), e.get("name")) for e in events if e.get("ph") == "X"}
    att = {n for p, n in names if p == 0}
    exp = {n for p, n in names if p == 5}
    assert {"split attention", "split A2E", "split E2A", "a2e A2E write to trampoline",
            "e2a poll slot words"} <= att, sorted(att)  # fmt: skip
    assert {"split A2E", "split experts", "split E2A", "a2e poll flags + assemble",
            "e2a E2A write to trampolines"} <= exp, sorted(exp)  # fmt: skip
    tracks = {(e.get("pid"), e["args"]["name"]) for e in events
              if e.get("ph") == "M" and e.get("name") == "thread_name"}  # fmt: skip
    assert {(0, "attention"), (0, "A2E"), (0, "E2A"), (5, "A2E"), (5, "experts"),
            (5, "E2A")} <= tracks, sorted(tracks)  # fmt: skip
    assert (5, "attention") not in tracks  # an expert die attends nothing


# -- serving ----------------------------------------------------------------------------------


SPLIT = dict(dies=2, expert_dies=2, domains=2, microbatches=2, model="tiny", timeout_s=20.0,
             max_num_batched_tokens=32, model_overrides={"num_experts": EXPERTS})  # fmt: skip
PROMPTS = [f"split request {i} " * (1 + i % 3) for i in range(6)]


def _params(i: int) -> SamplingParams:
    if i % 2:
        return SamplingParams(max_tokens=60, temperature=0.8, seed=50 + i, ignore_eos=True)
    return SamplingParams(max_tokens=60, ignore_eos=True)


def _run(eng: Engine) -> list:
    ids = [eng.submit(p, _params(i)) for i, p in enumerate(PROMPTS)]
    return [eng.result(i, timeout_s=60) for i in ids]


@pytest.fixture(scope="module")
def fault_free() -> list[list[int]]:
    with Engine.launch(**SPLIT) as eng:
        return [o.token_ids for o in _run(eng)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("shape", [dict(SPLIT), dict(SPLIT, dies=3, expert_dies=5, domains=3,
                                                     microbatches=1, quant="int8")])  # fmt: skip
def test_split_serving_replays_bit_equal(shape):
    eng = Engine.launch(**shape, log_steps=True, keep_logits=True)
    try:
        outs = _run(eng)
        sp = eng.split_stats()
    finally:
        eng.close()
    assert [o.finish_reason for o in outs] == ["length"] * len(PROMPTS)
    c = eng.config
    rep = replay(eng.model, c.dies, c.quant, c.blocks, c.block_size, eng.step_log,
                 c.combine_dtype, split=c.split)  # fmt: skip
    assert rep.bit_equal and rep.logits_compared == rep.sampled > 0, rep
    assert sp["steps"] >= 60 and 0 < sp["expert_idle_share"] < 1
    assert abs(sum(sp["expert_share"].values()) - 1) < 1e-9
    calls = sorted(sp["expert_a2e_calls"].values())  # read while serving: maybe mid-step
    cycle = 2 * c.domains * c.microbatches  # the calls of a step: MoE layers x D x m
    assert calls[0] >= 60 * cycle and calls[-1] - calls[0] <= cycle, calls
    assert not [p for p in SHM.iterdir() if p.name.startswith(f"xpod.{eng.pod_id}.")]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("plan, how", [("kill:die=3,step=30", "exit"),
                                       ("stop:die=2,step=30", "hang|stall")])  # fmt: skip
def test_a_faulty_expert_die_is_named_and_recovered(fault_free, tmp_path, plan, how):
    log = tmp_path / "faults.jsonl"
    eng = Engine.launch(**SPLIT, inject=plan, fault_log=str(log))
    try:
        outs = _run(eng)
        rel = eng.reliability()
    finally:
        eng.close()
    assert [o.token_ids for o in outs] == fault_free  # same seeds, same streams
    assert rel["gen"] == 1 and rel["ledger"]["token_gaps"] == 0, rel
    assert any(k in how.split("|") for k in rel["counts"]["detected"]), rel["counts"]
    records = [json.loads(line) for line in log.read_text().splitlines()]
    detected = next(r for r in records if r["event"] == "detected")
    assert "die 2" in detected["detail"] or "die 3" in detected["detail"], detected
    assert not [p for p in SHM.iterdir() if p.name.startswith(f"xpod.{eng.pod_id}.")]


def test_fault_plans_for_expert_dies_are_checked():
    EngineConfig(**SPLIT, inject="kill:die=3,step=5")  # an expert die may be killed
    for bad in ("err:die=3,step=5", "kvfault:die=2,step=5", "kill:die=3,step=5,layer=1",
                "kill:die=4,step=5", "stop:master=2,step=5"):  # fmt: skip
        with pytest.raises(ConfigError, match="inject"):
            EngineConfig(**SPLIT, inject=bad)
    with pytest.raises(ConfigError, match="domains"):
        EngineConfig(dies=2, domains=2, model="tiny")


@pytest.mark.timeout(60)
def test_an_idle_split_engine_parks_its_expert_dies():
    with Engine.launch(**SPLIT) as eng:
        _ = eng.result(eng.submit("wake up", SamplingParams(max_tokens=4)), timeout_s=30)
        park = L.PROGRESS_STATES.index("park")  # every die parked: the state to measure
        wait_for(lambda: all(L.unpack_progress(w)[3] == park for w in eng.progress_words()
                             or [0]), what="every die to park")  # fmt: skip
        procs = [psutil.Process(pid) for what, i, pid in eng.processes()
                 if what == "die" and i >= eng.config.dies]  # fmt: skip
        c0 = [sum(p.cpu_times()[:2]) for p in procs]
        time.sleep(1.5)
        used = [sum(p.cpu_times()[:2]) - c for p, c in zip(procs, c0, strict=True)]
    assert len(procs) == 2 and max(used) < 0.03, used  # < 2 % of a core each


@pytest.mark.timeout(180)
def test_split_serving_with_eplb_moves_experts_between_expert_dies_and_replays_bit_equal():
    """EPLB over the expert dies while serving (every 4 busy steps, skewed router): the expert
    dies plan, move whole experts between themselves over p2p and switch; the attention dies
    route with each map from the same busy step; every sampled token and its logits equal the
    replay of the schedule with the dies' maps; every die agrees on the maps."""
    from runtime.model import EPLBConfig

    prompts = [f"eplb request {i}: " + "abc" * (i % 5) for i in range(10)]
    params = [SamplingParams(max_tokens=24 + i % 4, temperature=0.7 * (i % 2), seed=i,
                             ignore_eos=True) for i in range(10)]  # fmt: skip
    shape = dict(SPLIT, model_overrides={"num_experts": 16, "score_bias": "skew"},
                 max_num_seqs=5)  # fmt: skip
    from prometheus_client import generate_latest

    from runtime.api.metrics import Metrics

    eng = Engine.launch(**shape, eplb=EPLBConfig(every=4), log_steps=True, keep_logits=True)
    try:
        outs = eng.generate(prompts, params, timeout_s=120)
        text = generate_latest(Metrics(eng).registry).decode()  # the expert dies' EPLB words
    finally:
        eng.close()
    bal = float(text.split("\nxpod:eplb_balancedness ")[1].split()[0])
    moved = sum(float(line.split()[-1]) for line in text.splitlines()
                if line.startswith("xpod_eplb_moved_bytes_total{"))  # fmt: skip
    assert 0.0 < bal <= 1.0 and moved > 0, text[-2000:]
    assert all(len(o.token_ids) == p.max_tokens for o, p in zip(outs, params, strict=True))
    reports = [r["eplb"] for r in eng.pod_result]  # attention dies (routers), expert dies
    maps = [(x["switch_step"], x["phy2log"]) for x in reports[0]["maps"]]
    assert len(maps) >= 3, "the expert dies must have switched maps while serving"
    assert all([(x["switch_step"], x["phy2log"]) for x in r["maps"]] == maps for r in reports)
    moved = [sum(m["bytes"] for m in r["moves"]) for r in reports[eng.config.dies :]]
    assert sum(moved) > 0, "whole experts moved between the expert dies"
    c = eng.config
    rep = replay(eng.model, c.dies, c.quant, c.blocks, c.block_size, eng.step_log,
                 c.combine_dtype, expert_maps=maps, split=c.split)  # fmt: skip
    assert rep.token_mismatches == [] and rep.logit_mismatches == [], rep
    assert rep.bit_equal and rep.logits_compared == rep.sampled
