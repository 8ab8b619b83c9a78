"""`xpod bench pool`: a small sweep (2 dies, the small model, short prompts, r in {0, 0.5}) writes
every key the issue names, its r = 0.5 hits come from the pool (blocks loaded, load time > 0) and
its r = 0 has no pool hit at all; bad flags are refused in one line before anything starts.
Speed is the benchmark's to measure, never asserted here."""

from __future__ import annotations

import json

import pytest

from runtime import cli

ROW_KEYS = (
    "reuse", "hit_tokens", "ttft_ms_nocache", "ttft_ms_pool", "ttft_ms_local", "ttft_reduction",
    "load_ms", "load_gbps", "prefill_tok_s_nocache", "prefill_tok_s_pool", "throughput_gain",
    "ttft_ms_nocache_p99", "ttft_ms_pool_p99", "ttft_ms_local_p99", "pool_minus_local_ms",
    "bar_ms", "ok", "p2p_gbps", "pool_hit_tokens", "load_bytes", "ttft_ms_local_die_a",
)  # fmt: skip
TOP_KEYS = ("model", "block_size", "prompt_len", "plane", "reuse_sweep", "p2p_zero_copy_gbps",
            "bars", "noise", "nocache_control", "local_control", "load_fit")  # fmt: skip
SMALL = ["bench", "pool", "--dies", "2", "--model", "small", "--max-seq-len", "256", "--prompt-len",
         "128", "--reuse", "0,0.5", "--prompts", "2", "--concurrency", "2",
         "--overhead", "1"]  # fmt: skip


@pytest.mark.timeout(120)
def test_small_sweep_has_every_key_pool_hits_at_half_and_none_at_zero(tmp_path, capsys):
    out = tmp_path / "pool.json"
    assert cli.main([*SMALL, "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    for key in TOP_KEYS:
        assert key in res, key
    rows = {r["reuse"]: r for r in res["reuse_sweep"]}
    assert sorted(rows) == [0.0, 0.5]
    for r in rows.values():
        for key in ROW_KEYS:
            assert key in r, key
        assert r["ttft_ms_nocache"] > 0 and r["ttft_ms_pool"] > 0 and r["ttft_ms_local"] > 0
        assert r["ttft_ms_pool_p99"] >= r["ttft_ms_pool"]
        assert r["local_pool_blocks"] == 0  # die A's own cache covers its prefix: no load
    half, zero = rows[0.5], rows[0.0]
    # r = 0.5 of 128 tokens = 4 blocks of 16, loaded from the pool into die B
    assert half["hit_tokens"] == 64 and half["pool_hit_tokens"] == 64
    assert half["load_ms"] > 0 and half["load_bytes"] > 0 and half["load_gbps"] > 0
    assert half["local_cached_tokens"] == 64  # die B's own hit once the pool landed P there
    assert half["local_die_a_cached_tokens"] == 64  # die A's: from the warm request
    assert half["batch_hit_tokens"] == 64
    assert half["p2p_gbps"] > 0 and half["bar_ms"] > 1.0 and isinstance(half["ok"], bool)
    assert res["p2p_zero_copy_gbps"][str(half["load_bytes"])] == half["p2p_gbps"]
    # r = 0: nothing shared, not one pool hit token (the master's counter and the landings)
    assert zero["pool_hit_tokens"] == 0 and zero["hit_tokens"] == 0
    assert zero["batch_hit_tokens"] == 0 and zero["load_ms"] == 0 and zero["bar_ms"] is None
    bars = res["bars"]
    for name in ("ttft_reduction_monotone_worst_drop", "ttft_reduction_r0.5", "pool_overhead_r0",
                 "throughput_gain_r0.5", "pool_hit_cost_ms_r0.5", "pool_overhead_r0_paired",
                 "pool_minus_local_ttft_ms_r0.5"):  # fmt: skip
        assert set(bars[name]) == {"value", "bar", "ok"}, name
    # the hit's cost judged is its load, the TTFT difference reported beside it
    assert bars["pool_hit_cost_ms_r0.5"]["value"] == half["load_ms"]
    assert bars["pool_hit_cost_ms_r0.5"]["ok"] == (half["load_ms"] <= half["bar_ms"])
    assert bars["pool_minus_local_ttft_ms_r0.5"]["value"] == half["pool_minus_local_ms"]
    assert res["noise"]["nocache_samples"] == 4
    ov = res["overhead_r0"]  # 1 ABBA quad: 2 pairs, each of one fresh prompt on both engines
    assert ov["pairs"] == 2 and len(ov["samples_ms"]["pool"]) == len(ov["samples_ms"]["nocache"])
    lo, hi = ov["overhead_ci95"]
    assert lo <= ov["overhead_paired_median"] <= hi
    assert bars["pool_overhead_r0_abba"]["value"] == ov["overhead_paired_median"]
    assert "pool-local ms" in capsys.readouterr().out


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--reuse", "0,1.0"], "argument --reuse: 1.0 is outside [0, 1)"),
        (["--reuse", "-0.1"], "argument --reuse: -0.1 is outside [0, 1)"),
        (["--reuse", "0,half"], "argument --reuse: half is not a number"),
        (["--reuse", ","], "argument --reuse: ',' is empty"),
        (["--prompt-len", "2048"], "argument --prompt-len: 2048 tokens + 4 generated exceed"),
        (["--prompt-len", "253"], "argument --prompt-len: 253 tokens + 4 generated exceed"),
        (["--prompt-len", "16"], "argument --prompt-len: 16 tokens is less than two blocks"),
        (["--dies", "1"], "argument --dies: 1 is not an integer >= 2"),
        (["--dies", "3"], "argument --dies/--model/--max-seq-len/--block-size:"),
        (["--prompts", "0"], "argument --prompts: 0 is not an integer >= 1"),
        (["--concurrency", "-1"], "argument --concurrency: -1 is not an integer >= 0"),
    ],
)
def test_bad_flags_are_one_line_errors(flags, says, capsys):
    argv = ["bench", "pool", "--model", "small", "--max-seq-len", "256", "--prompt-len", "128",
            *flags]  # fmt: skip
    try:
        status = cli.main(argv)
    except SystemExit as e:  # argparse's own refusals
        status = e.code
    assert status == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("xpod bench pool: error: "), err
    assert says in err, err


TIERS = ["bench", "tiers", "--model", "tiny", "--docs", "4", "--doc-blocks", "2",
         "--requests", "12", "--hot-requests", "3", "--hot-blocks", "2", "--scan-blocks", "6",
         "--scan-dram-blocks", "8", "--die-blocks", "8"]  # fmt: skip


@pytest.mark.timeout(180)
def test_pool_tiers_eviction_and_scan(tmp_path, capsys):
    """`xpod bench tiers` on tiny settings: with an SSD tier, DRAM at 1/4 of the working
    set hits as much as unbounded DRAM (every store awaited: the hits do not depend on speed),
    without it less; capacity never exceeded, no orphan; `always` admission loses the hot
    prompt to the scan, `second_hit` keeps every hit."""
    out = tmp_path / "tiers.json"
    assert cli.main([*TIERS, "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    e, s = res["eviction"], res["scan"]
    assert e["working_set_blocks"] == 8 and e["dram_slots_bounded"] == 2
    assert e["hit_rate_bounded"] == e["hit_rate_unbounded"] == 1.0 and e["ok"] is True
    assert e["hit_rate_dram_only"] < e["hit_rate_bounded"]
    b = e["bounded"]
    assert b["scrapes"] == 12 and b["max_dram_used"] == 2 and b["orphans"] == 0
    assert 0 < b["max_ssd_used"] <= e["ssd_blocks_bounded"] and b["promotions"] > 0
    assert s["second_hit"]["kept"] == 1.0 and s["ok"] is True
    assert s["always"]["kept"] == 0.0 and s["always"]["hot_hits_noscan"] > 0
    assert "second_hit bar 0.95: met" in capsys.readouterr().out


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--dram-fraction", "1"], "argument --dram-fraction: 1 must be < 1"),
        (["--die-blocks", "4"], "argument --die-blocks: 4 blocks cannot hold a context"),
        (["--scan-dram-blocks", "2"], "argument --scan-dram-blocks: 2 slots cannot hold"),
        (["--scan-blocks", "40"], "is longer than the model's context"),
    ],
)
def test_pool_tiers_bad_flags_are_one_line_errors(flags, says, capsys):
    try:
        status = cli.main(["bench", "tiers", "--model", "tiny", "--scan-blocks", "6", *flags])
    except SystemExit as e:
        status = e.code
    assert status == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("xpod bench tiers: error: "), err
    assert says in err, err


TINY = ["bench", "pool", "--model", "small", "--max-seq-len", "256", "--prompt-len", "128",
        "--reuse", "0.5", "--prompts", "2"]  # fmt: skip


@pytest.mark.timeout(180)
def test_hosts_mode_compares_a_same_host_hit_with_a_fetched_one(tmp_path):
    """--hosts 2,2: a same-host hit (die 1) and a cross-host one (die 2, fetched over TCP) of
    the same 4 blocks, every prompt's whole shared prefix landed, the fetches counted."""
    out = tmp_path / "hosts.json"
    assert cli.main([*TINY, "--hosts", "2,2", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    (row,) = res["reuse_sweep"]
    assert (
        row["cached_tokens_same"] == row["cached_tokens_cross"] == 64 == row["cached_tokens_local"]
    )
    assert row["load_bytes_same_host"] == row["load_bytes_cross_host"] > 0
    assert row["load_ms_cross_host"] > 0 and row["cross_over_same_load"] > 0
    fetch = res["master_fetch_counters"]
    assert fetch["2"]["pool_fetches"] == 2 and fetch["2"]["pool_fetch_failed"] == 0
    assert fetch["1"]["pool_fetches"] == 0  # die 1 is on the warm die's host: no fetch


@pytest.mark.timeout(180)
def test_pd_mode_halves_the_link_at_half_reuse(tmp_path):
    out = tmp_path / "pd.json"
    assert cli.main([*TINY, "--pd", "1,1", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["reuse_sweep"]
    assert row["link_bytes_on"] * 2 == row["link_bytes_off"] > 0  # 4 of 8 blocks skipped
    assert row["decode_load_ms_on"] > 0 and row["decode_load_ms_off"] == 0


@pytest.mark.parametrize("argv, match", [
    (["--hosts", "1,1"], "two dies on the first host"),
    (["--hosts", "2,2", "--pd", "1,1"], "not with --hosts"),
    (["--fabric", "mpi"], "only with --hosts"),
    (["--pd", "1"], "is not P,D"),
])  # fmt: skip
def test_bad_hosts_and_pd_flags_are_refused(argv, match, capsys):
    try:
        status = cli.main([*TINY, *argv])
    except SystemExit as e:  # argparse's own refusals
        status = e.code
    assert status == 2
    err = capsys.readouterr().err
    assert match in err and len(err.strip().splitlines()) == 1, err
