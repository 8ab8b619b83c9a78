"""`xpod decode --project PROFILE --model-card CARD --context N`: the projected keys, the same
figures from two runs (a capture is host-independent), the card and the context moving the
figures the way the op sizes say, MTP's TPOT divided by its tokens per step, and the refusals
(before any pod starts). The model is tiny with DeepSeek-V3's structure: 61 layers, 256
experts top-8, over 2 dies."""

from __future__ import annotations

import json

import pytest

from runtime.cli.main import main
from runtime.decode.options import DecodeOptions
from runtime.decode.run import run_decode
from runtime.model.mtp import spec_config
from runtime.project.decode import CATEGORIES

RUN = ["decode", "--dies", "2", "--batch", "4", "--prompt-len", "8", "--steps", "3",
       "--model", "tiny"]  # fmt: skip
BASE = [*RUN, "--project", "cm384"]
KEYS = {"profile", "profile_sha256", "projection_label", "projection_card", "projection_routing",
        "projection_context", "projection_model", "projection_steps", "projected_step_ms",
        "projected_step_ms_per_step", "projected_layer_us", "projected_mtp_ms",
        "projected_tokens_per_step", "projected_tpot_ms", "projected_iteration_gap_ms",
        "projected_tpot_with_gap_ms", "projected_breakdown", "projected_breakdown_us"}  # fmt: skip
FIGURES = sorted(k for k in KEYS if k.startswith("projected_")) + ["profile_sha256"]


def _opts(context: int = 64, **kw) -> DecodeOptions:
    return DecodeOptions(dies=2, batch=4, prompt_len=8, steps=3, model="tiny", project="cm384",
                         model_card="deepseek-v3", context=context, **kw)  # fmt: skip


_RUNS: dict[int, dict] = {}


def _plain(context: int) -> dict:
    """run_decode(_opts(context)), run once per module: the tests below only read its summary
    (each run is a pod launched and captured: ~3 s)."""
    if context not in _RUNS:
        _RUNS[context] = run_decode(_opts(context=context))
    return _RUNS[context]


@pytest.mark.timeout(300)
def test_decode_projects_its_step_layers_and_breakdown_deterministically(tmp_path, capsys):
    again = _plain(4096)
    out, trace = tmp_path / "d.jsonl", tmp_path / "proj.json"
    argv = [*BASE, "--model-card", "deepseek-v3", "--context", "4096", "--json", str(out),
            "--project-trace", str(trace), "--project-dir", str(tmp_path / "cap")]  # fmt: skip
    assert main(argv) == 0
    s = json.loads(out.read_text().splitlines()[-1])
    assert set(s) >= KEYS
    assert s["projection_label"] == (
        "projected (cm384, deepseek-v3, routing toy gate, context 4096)"
    )
    assert s["projection_steps"] == [2, 3] and s["projected_step_ms"] > 0
    lay = s["projected_layer_us"]
    assert 0 < lay["dense"] < lay["moe"]  # an MoE layer adds the collectives and 128 experts
    assert s["projected_tokens_per_step"] == 1 and s["projected_mtp_ms"] is None
    assert s["projected_tpot_ms"] == s["projected_step_ms"]
    assert s["projected_iteration_gap_ms"] == 2.0  # cm384's runtime.iteration_gap_ms
    assert s["projected_tpot_with_gap_ms"] == pytest.approx(s["projected_step_ms"] + 2, abs=1e-3)
    mean = s["projected_breakdown"]["mean"]
    assert set(mean) == set(CATEGORIES) and sum(mean.values()) == pytest.approx(1, abs=1e-3)
    assert len(s["projected_breakdown"]["per_die"]) == 2 and mean["mtp"] == 0
    assert sum(s["projected_breakdown_us"].values()) == pytest.approx(
        s["projected_step_ms"] * 1e3, rel=0.01
    )
    assert json.loads(trace.read_text())["otherData"]["profile"] == "cm384"
    meta = json.loads((tmp_path / "cap" / "projected" / "meta.json").read_text())
    assert meta["card"]["name"] == "deepseek-v3" and meta["workload"]["context"] == 4096
    assert meta["workload"]["layers"] == 61 and meta["workload"]["experts"] == 256
    printed = capsys.readouterr().out
    assert "projected (cm384, deepseek-v3, routing toy gate, context 4096):" in printed
    # deterministic: another run of the same pod, card and context (another pod launched and
    # captured, through run_decode) gives the same figures
    assert {k: s[k] for k in FIGURES} == {k: again[k] for k in FIGURES}


@pytest.mark.timeout(300)
def test_context_grows_attention():
    a, long = _plain(64), _plain(4096)
    share = lambda s: s["projected_breakdown"]["mean"]["attention"]  # noqa: E731
    assert share(long) > share(a) and long["projected_step_ms"] > a["projected_step_ms"]
    assert long["projected_breakdown_us"]["experts"] == pytest.approx(
        a["projected_breakdown_us"]["experts"], rel=1e-6
    )  # the context moves the attention only


@pytest.mark.timeout(300)
def test_mtp_tpot_divides_the_step_by_its_tokens():
    spec = spec_config(None, 1, "synthetic:1.0")
    s = run_decode(_opts(spec=spec, overrides={"batch_invariant": True}))
    assert s["projected_tokens_per_step"] == pytest.approx(2.0)  # every draft accepted
    assert s["projected_tpot_ms"] == pytest.approx(s["projected_step_ms"] / 2, abs=1e-3)
    assert s["projected_mtp_ms"] > 0 and s["projected_breakdown"]["mean"]["mtp"] > 0
    plain = _plain(64)
    assert s["projected_layer_us"]["moe"] > plain["projected_layer_us"]["moe"]  # 2 rows each


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--model-card", "llama"], "unknown card 'llama'"),
        ([], "efficiency.gemm_bf16 is unknown"),  # the toy card's BF16 weights on cm384
        (["--model-card", "deepseek-v3", "--project", "h800"], "efficiency.gemm_int8"),
        (["--model-card", "deepseek-v3", "--dies", "3"],
         "--model-card/--experts/--dies/--expert-dies: num_experts: 256 experts cannot be split"),
        (["--model-card", "deepseek-v3", "--experts", "64"], "card deepseek-v3 has num_experts"),
        (["--model-card", "deepseek-v3", "--attention-dies", "2", "--expert-dies", "6"],
         "256 experts cannot be split evenly over 6 expert dies"),  # a split pod's expert dies
        (["--model-card", "deepseek-v3", "--num-speculative-tokens", "1", "--mtp-draft",
          "synthetic:0.7", "--project-steps", "5"], "--steps is 3"),
        (["--model-card", "deepseek-v3", "--project", "nosuch"], "argument --project"),
    ],
)  # fmt: skip
def test_bad_projections_are_refused_before_any_pod(flags, message, capsys):
    assert main([*(RUN if "--project" in flags else BASE), *flags]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("flag", [["--context", "64"], ["--model-card", "deepseek-v3"],
                                  ["--project-trace", "x.json"]])  # fmt: skip
def test_projection_flags_need_project(flag, capsys):
    assert main(["decode", "--model", "tiny", *flag]) == 2
    assert "only with --project PROFILE" in capsys.readouterr().err
