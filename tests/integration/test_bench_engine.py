"""`xpod bench engine --quick` as a smoke test: it runs every part and writes every key the issue
names (speed is measured by the benchmark, never asserted here)."""

from __future__ import annotations

import json

import pytest

from runtime import cli

KEYS = (
    "engine_tokens_per_s", "decode_tokens_per_s", "ratio", "bubble_p50_ms", "step_p50_ms",
    "bubble_async_off_p50_ms", "idle_cpu_pct", "kv_balance_least_kv", "kv_balance_round_robin",
    "prefix_hit_rate", "ttft_p50_ms_prefix_on", "ttft_p50_ms_prefix_off", "replay_bit_equal",
)  # fmt: skip


@pytest.mark.timeout(300)
def test_bench_engine_quick_writes_every_figure(tmp_path, capsys):
    out = tmp_path / "engine.json"
    argv = ["bench", "engine", "--dies", "2", "--batch", "4", "--prompt-len", "16", "--model",
            "tiny", "--quick", "--idle-s", "0.5", "--json", str(out)]  # fmt: skip
    assert cli.main(argv) == 0
    res = json.loads(out.read_text())
    for key in KEYS:
        assert key in res, key
    assert res["replay_bit_equal"] is True
    assert res["engine_tokens_per_s"] > 0 and res["decode_tokens_per_s"] > 0
    assert res["prefix_hit_rate"] > 0 and res["prefix_hit_rate_off"] == 0
    assert "engine / decode" in capsys.readouterr().out
