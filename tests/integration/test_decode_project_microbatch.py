"""`xpod decode --microbatches 2 --project cm384 --model-card deepseek-v3 --context 4096` on a
colocated pod: the capture runs the micro-batched step (ops on s0 / s1), the figures tile both
streams (`projected_stream_us`), the same capture projects to the same figures, and the two
streams overlap (the step is shorter than their summed busy time). The model is tiny with
DeepSeek-V3's structure (61 layers, 256 experts top-8) over 2 dies."""

from __future__ import annotations

import json

import pytest

from runtime.cli.main import main
from runtime.project import load_capture, load_profile, replay
from runtime.project.decode import CATEGORIES, decode_figures, tile_steps

ARGV = ["decode", "--dies", "2", "--batch", "4", "--prompt-len", "8", "--steps", "3", "--model",
        "tiny", "--microbatches", "2", "--project", "cm384", "--model-card", "deepseek-v3",
        "--context", "4096"]  # fmt: skip


@pytest.mark.timeout(300)
def test_a_micro_batched_decode_projects_both_streams(tmp_path, capsys):
    out, where = tmp_path / "d.jsonl", tmp_path / "cap"
    assert main([*ARGV, "--json", str(out), "--project-dir", str(where)]) == 0
    s = json.loads(out.read_text().splitlines()[-1])
    assert s["microbatches"] == 2 and s["projection_steps"] == [2, 3]
    for key in ("projected_step_ms", "projected_layer_us", "projected_stream_us",
                "projected_breakdown", "projected_breakdown_us", "projected_tpot_ms"):  # fmt: skip
        assert s[key] is not None, key
    streams, lay = s["projected_stream_us"], s["projected_layer_us"]
    assert set(streams) == {"s0", "s1"} and min(streams.values()) > 0
    assert lay["dense"] > 0 and lay["moe"] > 0
    mean = s["projected_breakdown"]["mean"]
    assert set(mean) == set(CATEGORIES) and sum(mean.values()) == pytest.approx(1, abs=1e-3)
    assert mean["attention"] > 0 and mean["experts"] > 0 and mean["combine"] > 0
    # overlap: the step is shorter than its two streams' busy time (per micro-batch per layer)
    busy_ms = sum(streams.values()) * 61 * 2 / 1e3
    assert s["projected_step_ms"] < busy_ms
    # the layers are the critical path through s1: they tile the step up to its heads
    layers_ms = (3 * lay["dense"] + 58 * lay["moe"]) / 1e3
    assert 0.9 * s["projected_step_ms"] < layers_ms < s["projected_step_ms"]
    assert "per stream, busy per micro-batch per layer: s0" in capsys.readouterr().out

    cap = load_capture(where / "projected")
    assert cap.meta["workload"]["microbatches"] == 2
    assert {"s0", "s1"} <= set(cap.streams[0])
    figs = [decode_figures(replay(cap, load_profile("cm384"))) for _ in range(2)]
    assert figs[0] == figs[1]  # the same capture: the same figures
    assert round(figs[0].step_p50_us / 1e3, 4) == s["projected_step_ms"]
    assert {k: round(v, 4) for k, v in figs[0].stream_us.items()} == streams
    res = replay(cap, load_profile("cm384"))
    for d in range(cap.num_dies):
        for t in tile_steps(res, d):
            assert t.microbatches == 2 and len(t.layers) == 61
            assert t.span_us < sum(t.stream_us.values())
