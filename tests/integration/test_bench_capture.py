"""`xpod bench capture`: a real capture's cost (seconds, resident memory, bytes), the
synthesizer equal to it, the replay timed, projected figures labelled."""

from __future__ import annotations

import json

import pytest

from runtime.cli.main import main


@pytest.mark.timeout(180)
def test_bench_capture_rows(tmp_path, capsys):
    out = tmp_path / "c.jsonl"
    argv = ["bench", "capture", "--dies", "4", "--synth-dies", "8", "--batch", "8", "--hidden",
            "256", "--topk", "4", "--experts", "16", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    real, syn = (json.loads(line) for line in out.read_text().splitlines())
    assert real["dies"] == 4 and real["capture"] == "real" and real["synth_equal"] is True
    assert real["mem_samples"] >= 1 and real["peak_pss_mib_per_die"] > 0
    assert real["capture_s"] > 0 and real["capture_mib"] > 0 and real["events"] > 0
    assert syn["dies"] == 8 and syn["capture"] == "synthesized" and "synth_equal" not in syn
    for r in (real, syn):
        assert r["profile"] == "cm384" and r["projected_dispatch_us"] > 0
        assert r["projected_combine_us"] > 0 and r["replay_s"] >= 0
    rows = [x for x in printed.splitlines() if x.lstrip().startswith(("4 ", "8 "))]
    assert len(rows) == 2 and all(x.endswith("projected (cm384)") for x in rows)


def test_bench_capture_refuses_a_bad_profile_before_capturing(capsys):
    assert main(["bench", "capture", "--dies", "4", "--profile", "nosuch"]) == 2
    assert "no such profile" in capsys.readouterr().err
