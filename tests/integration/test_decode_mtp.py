"""`xpod decode --num-speculative-tokens K`: the pod's speculative schedule equals the
single-process reference's bit for bit (tokens, every verify row's logits, the accounting), its
tokens are the run's without MTP (batch-invariant), and the issue's JSON keys are written."""

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
@pytest.mark.parametrize(
    ("flags", "k"),
    [
        (["--num-speculative-tokens", "1"], 1),
        (["--num-speculative-tokens", "2", "--mtp-draft", "synthetic:0.9,0.4"], 2),
        (["--speculative-config", '{"num_speculative_tokens": 2, "draft": "oracle"}',
          "--temperature", "0.8"], 2),
    ],
)  # fmt: skip
def test_decode_with_mtp_equals_its_reference_and_the_run_without(tmp_path, capsys, flags, k):
    out = tmp_path / "d.jsonl"
    argv = ["decode", "--dies", "2", "--batch", "4", "--prompt-len", "12", "--steps", "8",
            "--model", "tiny", "--batch-invariant", "--check", "--json", str(out)]  # fmt: skip
    argv += flags
    assert main(argv) == 0
    s = json.loads(out.read_text().splitlines()[-1])
    assert set(s) >= KEYS and s["spec_tokens"] == k
    assert s["replay_bit_equal"] and s["mismatched_tokens"] == 0 and s["logits_bit_equal"]
    assert s["tokens_identical"] is True
    assert s["num_drafts"] == 4 * 8 and s["num_draft_tokens"] == 4 * 8 * k
    if "oracle" in " ".join(flags):
        assert s["acceptance_rate"] == 1.0 and s["mean_acceptance_length"] == 1 + k
    assert "decode with MTP" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--num-speculative-tokens", "3"], "second MTP module"),
        (["--num-speculative-tokens", "1", "--mtp-draft", "maybe"], "not one of"),
        (["--num-speculative-tokens", "1", "--eplb", "on"], "without EPLB"),
        (["--num-speculative-tokens", "1", "--attention-dies", "2", "--dies", "4", "--eplb",
          "on"], "without EPLB"),
        (["--num-speculative-tokens", "2", "--steps", "200"], "max_seq_len"),
        (["--mtp-draft", "fit"], "needs --num-speculative-tokens"),
    ],
)  # fmt: skip
def test_bad_speculative_decodes_are_refused_before_any_pod(flags, message, capsys):
    assert main(["decode", "--model", "tiny", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("draft", "k", "batch", "want", "tol", "per_pos"),
                         [("synthetic:0.9", 1, 64, 1.90, 0.02, (0.90,)),
                          ("synthetic:0.9,0.4", 2, 128, 2.26, 0.03, (0.90, 0.36))])  # fmt: skip
def test_synthetic_drafts_are_accepted_at_their_rates(tmp_path, draft, k, batch, want, tol,
                                                      per_pos):  # fmt: skip
    # >= 2,000 (k = 1) and >= 4,000 (k = 2) drafts; batch-invariant so the transcript holds
    out = tmp_path / "d.jsonl"
    argv = ["decode", "--dies", "4", "--batch", str(batch), "--prompt-len", "8", "--steps",
            "32", "--model", "tiny", "--batch-invariant", "--num-speculative-tokens", str(k),
            "--mtp-draft", draft, "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    s = json.loads(out.read_text().splitlines()[-1])
    assert s["num_drafts"] == batch * 32 and s["tokens_identical"]
    assert abs(s["mean_acceptance_length"] - want) <= tol, s["mean_acceptance_length"]
    for got, p in zip(s["acceptance_per_pos"], per_pos, strict=True):
        assert abs(got - p) <= 0.02, s["acceptance_per_pos"]


@pytest.mark.timeout(300)
def test_after_500_steps_of_rejected_drafts_the_kv_rows_are_the_models(tmp_path):
    # synthetic:0.5 rejects about half the drafts for 500 steps; every layer's KV rows (the
    # MTP module's too) equal the reference's, and the main layers' equal the run without MTP
    out = tmp_path / "d.jsonl"
    argv = ["decode", "--dies", "2", "--batch", "4", "--prompt-len", "8", "--steps", "500",
            "--model", "tiny", "--max-seq-len", "2048", "--batch-invariant", "--check",
            "--num-speculative-tokens", "2", "--mtp-draft", "synthetic:0.5"]  # fmt: skip
    assert main([*argv, "--json", str(out)]) == 0
    s = json.loads(out.read_text().splitlines()[-1])
    assert s["num_drafts"] == 2000 and 0.3 < s["acceptance_rate"] < 0.45
    assert s["kv_rows_equal_reference"] and s["kv_rows_equal_no_mtp"] and s["tokens_identical"]
