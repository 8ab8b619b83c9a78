"""`xpod bench engine --num-speculative-tokens`: the engine with MTP against without in one run,
issue 31's keys per k, oracle drafts all accepted, the tokens identical (batch-invariant), the
replay of a short MTP run bit-equal."""

from __future__ import annotations

import json

import pytest

from runtime.cli.main import main

KEYS = {"spec_tokens", "draft_mode", "num_drafts", "num_draft_tokens", "num_accepted_tokens",
        "acceptance_rate", "acceptance_per_pos", "mean_acceptance_length", "tokens_per_step",
        "step_ms", "step_ms_no_mtp", "step_ratio", "mtp_ms_per_step", "tokens_per_s",
        "tokens_per_s_no_mtp", "speedup", "predicted_speedup", "tokens_identical",
        "replay_bit_equal"}  # fmt: skip


@pytest.mark.timeout(300)
def test_bench_engine_mtp_rows(tmp_path, capsys):
    out = tmp_path / "e.json"
    argv = ["bench", "engine", "--dies", "2", "--batch", "4", "--prompt-len", "12", "--steps",
            "12", "--waves", "1", "--repeat", "1", "--model", "tiny", "--batch-invariant",
            "--num-speculative-tokens", "1,2", "--mtp-draft", "oracle"]  # fmt: skip
    argv += ["--json", str(out)]
    assert main(argv) == 0
    res = json.loads(out.read_text())
    assert [r["spec_tokens"] for r in res["rows"]] == [1, 2]
    for r in res["rows"]:
        assert set(r) >= KEYS
        assert r["acceptance_rate"] == 1.0 and r["tokens_identical"] and r["replay_bit_equal"]
        assert r["step_ms"] > 0 and r["step_ms_no_mtp"] > 0 and r["speedup"] > 0
    assert "xpod bench engine with MTP" in capsys.readouterr().out


def test_bench_engine_refuses_bad_mtp_flags(capsys):
    assert main(["bench", "engine", "--num-speculative-tokens", "3"]) == 2
    assert main(["bench", "engine", "--num-speculative-tokens", "1", "--mtp-draft", "x"]) == 2
    err = capsys.readouterr().err
    assert "not one of" in err
