"""Projected decode on a split pod (MoE-attention disaggregation; docs/projection.md §6):
`xpod decode --attention-dies A --expert-dies E --project PROFILE` tiles the attention dies'
steps (A2E as dispatch, E2A as combine), gives the same figures twice, and its capture is
complete (every acquire matched) with the expert dies' `experts` rows equal to the rows the
attention dies routed. With two micro-batches an attention die's ops go on the streams s0 / s1
(runtime.model.pipeline) and `main` only opens, joins and closes each step. A card's experts
are checked against the expert dies, not all the dies."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import msgpack
import pytest

from runtime import Pod
from runtime.cli.main import main
from runtime.decode import DecodeOptions
from runtime.decode.project import check_projection
from runtime.decode.run import DecodeSpec, decode_main, make_prompts, make_split, pod_config, spread
from runtime.model import ModelConfig
from runtime.model.forward import prepared_for_fork
from runtime.pod.capture import write_capture
from runtime.project import load_capture, load_profile, replay
from runtime.project.decode import STEP_CALL
from tests.integration.test_decode_project import FIGURES, KEYS

SPLIT = ["decode", "--attention-dies", "2", "--expert-dies", "2", "--batch", "4", "--prompt-len",
         "8", "--steps", "3", "--model", "tiny", "--project", "cm384", "--model-card",
         "deepseek-v3", "--context", "2048"]  # fmt: skip
TOPK = 8  # deepseek-v3's card: the run's model has its structure
S0_OPS = {"embed", "mla_prolog", "mla", "o_proj", "norms", "lm_head", "sample"}
S1_OPS = {"gate", "dense_ffn", "shared_expert"}


def die_events(path: Path, die: int) -> tuple[list[str], list[list]]:
    with open(path / f"die-{die:04d}.msgpack", "rb") as fh:
        m = msgpack.unpackb(fh.read(), raw=False)
    return m["streams"], m["events"]


def ops(events: list[list], name: str) -> list[dict]:
    return [e[8] for e in events if e[0] == "op" and e[4] == name]


def routed_and_served(path: Path, att: list[int], exp: list[int], topk: int) -> tuple[int, int]:
    """(rows the attention dies routed: their gates' rows x top-k, rows the expert dies'
    `experts` ops ran), over the whole capture; each `experts` op's rows are its counts'."""
    routed = sum(g["rows"] * topk for d in att for g in ops(die_events(path, d)[1], "gate"))
    served = 0
    for d in exp:
        for x in ops(die_events(path, d)[1], "experts"):
            assert x["rows"] == sum(x["counts"])
            served += x["rows"]
    return routed, served


@pytest.mark.timeout(300)
def test_split_decode_projects_a2e_e2a_and_attention(tmp_path):
    runs = []
    for i in range(2):
        out = tmp_path / f"d{i}.jsonl"
        extra = ["--project-dir", str(tmp_path / "cap")] if i == 0 else []
        assert main([*SPLIT, "--json", str(out), *extra]) == 0
        runs.append(json.loads(out.read_text().splitlines()[-1]))
    s = runs[0]
    assert s["layout"] == "split" and set(s) >= KEYS
    assert {k: s[k] for k in FIGURES} == {k: runs[1][k] for k in FIGURES}  # deterministic
    assert s["projection_steps"] == [2, 3] and s["projected_step_ms"] > 0
    assert s["projection_critical_dies"][0] in (0, 1)  # an attention die's step
    lay = s["projected_layer_us"]
    assert 0 < lay["dense"] < lay["moe"]
    mean = s["projected_breakdown"]["mean"]
    assert mean["dispatch"] > 0 and mean["combine"] > 0 and mean["attention"] > 0
    assert mean["experts"] == 0  # the routed experts run on the expert dies: inside E2A's wait
    assert mean["shared"] > 0  # the shared expert stays beside attention
    att = [d for d in s["projected_breakdown"]["per_die"] if d and sum(d.values()) > 0]
    assert len(att) == 2 and all(sum(d.values()) == pytest.approx(1, abs=1e-3) for d in att)
    cap = tmp_path / "cap"
    for d in (0, 1, 2, 3):
        streams, events = die_events(cap / "raw", d)
        steps = [e for e in events if e[0] == "begin" and e[4] == STEP_CALL]
        assert len(steps) == (3 if d < 2 else 0)
        assert streams == ["main", "a2a"]  # one micro-batch: every op on main
    routed, served = routed_and_served(cap / "raw", [0, 1], [2, 3], TOPK)
    assert routed == served > 0
    # complete: every acquire matched its write (else the replay raises "trace incomplete")
    res = replay(load_capture(cap / "projected"), load_profile("cm384"))
    assert res.calls("a2e").counted > 0 and res.calls("e2a").counted > 0
    replay(load_capture(cap / "raw"), load_profile("host"))


@pytest.mark.timeout(120)
def test_two_microbatches_record_on_s0_s1_and_capture_completely(tmp_path):
    opts = DecodeOptions(dies=4, attention_dies=2, expert_dies=2, domains=2, microbatches=2,
                         batch=6, prompt_len=8, steps=3, model="tiny", timeout_s=30)  # fmt: skip
    model = ModelConfig.preset("tiny")
    sp = make_split(opts, model)
    per_att, ids = spread(make_prompts(opts.batch, opts.prompt_len, opts.seed), 2)
    spec = DecodeSpec(model, per_att, ids, opts.steps, "fused", None, 0.0, 0, 16,
                      keep_logits=False, split=sp)  # fmt: skip
    cfg = pod_config(model, per_att + [[], []], opts).replace(capture=True, trace=False)
    with prepared_for_fork(model):
        pod_cm = Pod.launch(cfg)
    with pod_cm as pod:
        res = pod.run(decode_main, spec, timeout_s=100)
        path = write_capture(pod, tmp_path / "cap", {"bench": "decode"}, [STEP_CALL], warmup=1)
    assert [r["role"] for r in res] == ["attention", "attention", "expert", "expert"]
    for d in (0, 1):
        streams, events = die_events(path, d)
        sid = {n: streams.index(n) for n in ("main", "s0", "s1", "a2a")}
        on = {n: {e[4] for e in events if e[0] == "op" and e[1] == sid[n]} for n in sid}
        assert on["s0"] == S0_OPS and on["s1"] == S1_OPS, on
        assert not on["main"]  # main opens, joins and closes each step
        begins = [i for i, e in enumerate(events) if e[0] == "begin" and e[4] == STEP_CALL]
        assert len(begins) == 3
        step = events[begins[1] :]
        step = step[: next(i for i, e in enumerate(step) if e[0] == "end" and e[4] == STEP_CALL)]
        assert len(ops(step, "embed")) == 2  # one per micro-batch
        # each collective is launched from s1: its a2a begin waits for s1's latest event
        a2a = [e for e in events if e[1] == sid["a2a"]]
        for i, e in enumerate(a2a):
            if e[0] == "begin" and e[5] != 0:  # (0: the end marker, from main)
                assert a2a[i - 1][0] == "after" and a2a[i - 1][4] == sid["s1"]
    routed, served = routed_and_served(path, [0, 1], [2, 3], model.topk)
    assert routed == served > 0
    out = replay(load_capture(path), load_profile("host"))  # every acquire matched
    assert out.calls(STEP_CALL).counted == 2  # steps 2 and 3 (the first a warm-up)


def test_split_projection_options_pass_the_check():
    opts = DecodeOptions(dies=10, attention_dies=2, expert_dies=8, model="tiny", project="cm384",
                         model_card="deepseek-v3", context=4096)  # fmt: skip
    model = dataclasses.replace(ModelConfig.preset("tiny"), num_experts=256, topk=8)
    assert check_projection(opts, model) is not None  # 256 experts over the 8 expert dies
