"""`xpod bench serve --launch --dataset multi-turn --compare-pool local,pool`: two real servers
of 2 dies on the tiny model, one after the other, 3 conversations of 3 turns with short
lengths. The JSON has each layout's keys and the bars; the pool layout hits the pool (a turn or
a system prompt that the other die computed); both servers exit 0 and leave nothing behind
(the autouse leak check). Speed is measured by the benchmark, never asserted here."""

from __future__ import annotations

import json

import pytest

from runtime import cli

pytest.importorskip("aiohttp")

LAYOUT_KEYS = ("completed", "failed", "output_throughput", "median_ttft_ms", "p99_ttft_ms",
               "hit_rate", "pool_hit_rate", "ideal_hit_rate", "load_imbalance")  # fmt: skip
BARS = ("pool_hit_over_ideal", "pool_ttft_p50_over_local", "pool_throughput_over_local",
        "pool_imbalance_over_local")  # fmt: skip


@pytest.mark.timeout(60)
def test_compare_pool_two_layouts(tmp_path, capsys):
    out = tmp_path / "mt.json"
    argv = ["bench", "serve", "--launch", "--dies", "2", "--model", "tiny", "--dataset",
            "multi-turn", "--mt-conversations", "3", "--mt-turns", "3", "--mt-system-len", "64",
            "--mt-user-len", "16", "--random-output-len", "8", "--mt-think-time", "0.05",
            "--mt-stagger", "0.3", "--compare-pool", "local,pool", "--server-args",
            "--pool-dram-mib 4", "--disable-tqdm", "--json", str(out)]  # fmt: skip
    assert cli.main(argv) == 0
    res = json.loads(out.read_text())
    assert res["compare_pool"] == ["local", "pool"] and res["dataset"] == "multi-turn"
    assert set(res["layouts"]) == {"local", "pool"}
    # every turn's prompt: BOS + 64 + 16 per turn + 8 per earlier reply
    prompt_tokens = 3 * sum(1 + 64 + 16 * t + 8 * (t - 1) for t in (1, 2, 3))
    for name, lay in res["layouts"].items():
        for key in LAYOUT_KEYS:
            assert lay[key] is not None, (name, key)
        assert lay["completed"] == 9 and lay["failed"] == 0
        assert 0 < lay["ideal_hit_rate"] < 1 and lay["hit_rate"] <= lay["ideal_hit_rate_replies"]
        assert lay["load_imbalance"] >= 1 and lay["engine_restarts"] == 0
        run = res["runs"][0][name]  # one round
        assert run["server_exit_status"] == 0 and run["total_input_tokens"] == prompt_tokens
        assert sum(lay["prompt_tokens_by_group"]) == prompt_tokens
        assert run["total_output_tokens"] == 9 * 8
    local, pool = res["layouts"]["local"], res["layouts"]["pool"]
    assert local["pool_hit_rate"] == 0 and "--kv-pool" not in local["server_args"]
    assert pool["pool_hit_rate"] > 0 and pool["pool_loads"] > 0
    assert pool["pool_crc_mismatches"] == 0
    assert "--kv-pool --pool-dram-mib 4" in pool["server_args"]
    assert set(res["bars"]) == set(BARS)
    for b in res["bars"].values():
        assert b["value"] is not None and isinstance(b["ok"], bool)
    stdout = capsys.readouterr().out
    assert "KV pool: multi-turn, layouts side by side" in stdout
    assert "pool hit rate / its ideal" in stdout
