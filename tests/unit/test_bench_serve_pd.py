"""`xpod bench serve --prefill-dies/--decode-dies/--compare-colocated`, without a server: the
flag checks (a ConfigError naming the flag, before anything starts), the two layouts' `xpod
serve` flags, the interference phase's gap arithmetic, the PD figures of a `/metrics`
exposition (counter resets included), the replay verdict, the --json key set and the report."""

from __future__ import annotations

import json
import subprocess
from dataclasses import replace

import pytest

pytest.importorskip("aiohttp")
pytest.importorskip("uvloop")

from bench import serve as bs  # noqa: E402
from bench.serve import driver  # noqa: E402
from bench.serve.client import RequestResult  # noqa: E402
from bench.serve.interference import (  # noqa: E402
    burst_figures,
    idle_figures,
    steady_gaps,
    stream_window_gaps,
    window_gaps,
)
from bench.serve.pd import (  # noqa: E402
    LAYOUT_KEYS,
    PD_KEYS,
    best_goodput,
    comparison,
    idle_split,
    p2p_size,
    pd_figures,
    read_replay,
    ttft_check,
)
from bench.serve.pd_flags import seq_len_for, without  # noqa: E402
from bench.serve.pd_report import print_comparison, print_pd  # noqa: E402
from bench.serve.scrape import increase, parse_prometheus  # noqa: E402
from memory.errors import ConfigError  # noqa: E402
from runtime import cli  # noqa: E402

URL = "http://127.0.0.1:1"
PD_TINY = ["--launch", "--model", "tiny", "--prefill-dies", "1", "--decode-dies", "2"]


def parse(*argv: str):
    args = cli.build_parser(["bench", "serve", *argv]).parse_args(["bench", "serve", *argv])
    return bs.parse_options(args)


# -- flags -----------------------------------------------------------------------------------

BAD = [
    (["--url", URL, "--prefill-dies", "1", "--decode-dies", "2"], "--prefill-dies"),
    (["--url", URL, "--compare-colocated"], "--compare-colocated"),
    (["--launch", "--prefill-dies", "1"], "--decode-dies"),
    (["--launch", "--decode-dies", "2"], "--prefill-dies"),
    (["--launch", "--dies", "3", "--prefill-dies", "1", "--decode-dies", "2"], "--dies"),
    (["--launch", "--compare-colocated"], "--compare-colocated"),
    (["--launch", "--burst-len", "64"], "--burst-len"),
    (["--launch", "--burst-prompts", "2"], "--burst-prompts"),
    ([*PD_TINY, "--compare-colocated", "--lb-compare"], "--lb-compare"),
    ([*PD_TINY, "--server-args", "--dies 4"], "--server-args"),
    ([*PD_TINY, "--server-args=--decode-dies=4"], "--server-args"),
    ([*PD_TINY, "--server-args", "--max-seq-len 256"], "--burst-len"),
    ([*PD_TINY, "--compare-colocated", "--server-args", "--experts 16"], "--compare-colocated"),
    (["--launch", "--model", "tiny", "--prefill-dies", "3", "--decode-dies", "2"],
     "--prefill-dies/--decode-dies"),
]  # fmt: skip


@pytest.mark.parametrize(("argv", "flag"), BAD)
def test_bad_pd_flags_name_the_flag(argv, flag):
    with pytest.raises(ConfigError) as e:
        parse(*argv)
    assert f"argument {flag}" in str(e.value)


@pytest.mark.parametrize("argv", [["--prefill-dies", "0"], ["--burst-len", "1"]])
def test_bad_values_are_argparse_errors(argv, capsys, monkeypatch):
    monkeypatch.setattr(subprocess, "Popen", None)  # nothing may start
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "serve", "--launch", *argv])
    assert exc.value.code == 2
    assert argv[0] in capsys.readouterr().err


def test_cli_error_is_one_line_status_2(capsys, monkeypatch):
    monkeypatch.setattr(subprocess, "Popen", None)
    assert cli.main(["bench", "serve", "--launch", "--compare-colocated"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("xpod bench serve: error:")
    assert "--compare-colocated" in err


def test_pd_compare_server_flags():
    o = parse("--launch", "--prefill-dies", "2", "--decode-dies", "4", "--compare-colocated",
              "--rate-sweep", "0.5,1", "--goodput", "ttft:200", "tpot:30", "--server-args",
              "--kv-policy fail --kv-lease=5 --async-depth 1")  # fmt: skip
    a = o.server_argv
    assert a[:4] == ("--prefill-dies", "2", "--decode-dies", "4")
    # 1024-token bursts need 2048 of context; 32 experts do not split over 6 dies: 36 do
    assert a[a.index("--max-seq-len") + 1] == "2048" and a[a.index("--experts") + 1] == "36"
    assert a[a.index("--kv-policy") : a.index("--kv-policy") + 2] == ("--kv-policy", "fail")
    c = o.colocated_argv
    assert c[:2] == ("--dies", "6") and "--prefill-dies" not in c
    assert "--kv-policy" not in c and not any(x.startswith("--kv-lease") for x in c)
    assert c[c.index("--experts") + 1] == "36" and c[-2:] == ("--async-depth", "1")
    assert len(o.notes) == 2 and "--max-seq-len 2048" in o.notes[0]
    assert (o.dies, o.max_model_len, o.layout) == (6, 2048, "pd")
    assert o.model_overrides == {"num_experts": 36, "max_seq_len": 2048}
    assert (o.interference_streams, o.load_concurrency, o.baseline_dies) == (8, 32, 4)
    colo = replace(o, server_argv=o.colocated_argv, layout="colocated")
    assert (colo.interference_streams, colo.load_concurrency, colo.baseline_dies) == (8, 32, 6)
    assert (o.burst_prompts, o.burst_len) == (8, 1024)


def test_pd_defaults_and_quick():
    o = parse(*PD_TINY, "--max-concurrency", "10", "--quick")
    assert o.max_num_seqs == 5  # ceil(10 / 2 decode dies)
    assert (o.burst_prompts, o.burst_len) == (4, 128)  # --quick's caps: fits tiny's 256
    assert "--max-seq-len" not in o.server_argv and not o.notes and not o.colocated_argv
    o = parse(*PD_TINY, "--burst-len", "300", "--burst-prompts", "3")
    assert o.server_argv[4:6] == ("--max-seq-len", "768") and o.burst_prompts == 3


def test_plain_run_is_unchanged():
    o = parse("--launch", "--dies", "2")
    assert o.server_argv == ("--dies", "2", "--model", "small", "--max-num-seqs", "8",
                             "--lb", "least_kv")  # fmt: skip
    assert (o.layout, o.interference, o.baseline_dies, o.load_concurrency) == ("", False, 2, 16)


def test_helpers():
    assert (seq_len_for(1024), seq_len_for(100), seq_len_for(300)) == (2048, 512, 768)
    assert without(("--a", "1", "--kv-policy", "fail", "--kv-lease=3", "--b"),
                   ("--kv-policy", "--kv-lease")) == ("--a", "1", "--b")  # fmt: skip
    assert (p2p_size(20130.0), p2p_size(10.0), p2p_size(100.0)) == (20160, 64, 128)


# -- interference arithmetic -----------------------------------------------------------------


def test_steady_and_window_gaps():
    a = [0.0, 0.01, 0.02, 0.03, 0.05]  # chunk times of two streams
    b = [0.015, 0.025, 0.035, 0.045]
    # only gaps that start once both have their first chunk (0.015)
    assert steady_gaps([a, b]) == [pytest.approx([0.01, 0.02]), pytest.approx([0.01] * 3)]
    assert steady_gaps([[], []]) == [[], []]
    # the window [0.028, 0.04]: a's 0.02->0.03, 0.03->0.05; b's 0.025->0.035, 0.035->0.045
    assert stream_window_gaps([a, b], 0.028, 0.04) == [
        pytest.approx([0.01, 0.02]),
        pytest.approx([0.01, 0.01]),
    ]
    assert sorted(window_gaps([a, b], 0.028, 0.04)) == pytest.approx([0.01, 0.01, 0.01, 0.02])
    assert window_gaps([a], 1.0, 2.0) == []


def test_idle_and_burst_figures():
    s1 = [i * 0.010 for i in range(21)]  # 10 ms gaps
    s2 = [0.001 + i * 0.012 for i in range(21)]  # 12 ms gaps
    idle = idle_figures([s1, s2])
    assert idle["idle_tpot_ms"] == pytest.approx(11.0)  # median of the medians 10, 12
    assert idle["idle_gaps"] == 39 and idle["idle_gap_p99_ms"] == pytest.approx(12.0)
    s3 = [0.0, 0.01, 0.02, 0.07, 0.08]  # a 50 ms stall inside the window
    b = burst_figures([s3], 0.03, 0.06, 10.0)
    assert b["burst_gaps"] == 1 and b["burst_itl_p99_ms"] == pytest.approx(50.0)
    assert b["burst_itl_over_idle"] == pytest.approx(5.0)
    assert b["burst_tpot_p99_ms"] == pytest.approx(50.0) and b["burst_over_idle"] == 5.0
    assert b["burst_window_ms"] == pytest.approx(30.0)
    b = burst_figures([s3], 0.015, 0.075, 10.0)  # 3 gaps overlap it: 10, 50, 10 ms
    assert b["burst_gaps"] == 3 and b["burst_tpot_p99_ms"] == pytest.approx(70 / 3)
    assert b["burst_over_idle"] == pytest.approx(7 / 3)
    assert burst_figures([], 0.0, 1.0, 0.0)["burst_over_idle"] is None


# -- /metrics of a PD server -------------------------------------------------------------------


def exposition(nbytes: float, secs: float, n: float, mismatches: int = 0, gen: int = 0) -> str:
    lines = []
    for p, v in (("queue", 0.002), ("prefill", 0.010), ("kv_wait", 0.0), ("transfer", 0.001),
                 ("first_step", 0.005)):  # fmt: skip
        lines += [f'xpod_pd_ttft_phase_seconds_count{{phase="{p}"}} {n}',
                  f'xpod_pd_ttft_phase_seconds_sum{{phase="{p}"}} {v * n}']  # fmt: skip
    for link, share in (("0->1", 0.75), ("0->2", 0.25)):
        lines += [f'xpod_kv_transfer_bytes_total{{link="{link}"}} {nbytes * share}',
                  f'xpod_kv_transfer_seconds_total{{link="{link}"}} {secs * share}',
                  f'xpod_kv_transfers_total{{link="{link}"}} {n * share}',
                  f'xpod_kv_link_state{{link="{link}",state="ok"}} 1.0',
                  f'xpod_kv_link_state{{link="{link}",state="dead"}} 0.0']  # fmt: skip
    lines += [
        f"xpod_kv_checksum_mismatches_total {mismatches}",
        "xpod_kv_quarantined_blocks_total 0",
        "xpod_kv_leases_expired_total 0",
        'xpod_pd_transfers_total{result="success"} 8',
        'xpod_pd_transfers_total{result="failed"} 0',
        "xpod_pd_recomputed_total 0",
        "xpod_pd_failed_total 0",
        f"xpod_engine_incarnation {gen}",
    ]
    return "# TYPE xpod_pd_ttft_phase_seconds histogram\n" + "\n".join(lines) + "\n"


def test_pd_figures_from_exposition():
    s0 = parse_prometheus(exposition(1e6, 1e-3, 4))
    s1 = parse_prometheus(exposition(5e6, 2e-3, 12, mismatches=1))
    f = pd_figures(s0, s1)
    assert f["kv_transfers"] == 8 and f["kv_transfer_bytes"] == 4_000_000
    assert f["kv_transfer_gbps"] == pytest.approx(4.0)  # 4e6 B in 1 ms
    assert f["kv_transfer_mean_bytes"] == pytest.approx(5e5)
    assert f["ttft_split_ms"] == pytest.approx(
        {"queue": 2.0, "prefill": 10.0, "kv_wait": 0.0, "transfer": 1.0, "first_step": 5.0}
    )
    assert f["ttft_split_sum_ms"] == pytest.approx(18.0) and f["ttft_split_requests"] == 8
    assert f["checksum_mismatches"] == 1 and f["links_not_ok"] == 0
    assert pd_figures(s0, parse_prometheus("xpod_steps_total 3\n")) == {}  # not a PD server
    c = ttft_check({**f, "median_ttft_ms": 21.0, "mean_ttft_ms": 22.0})
    assert c["ttft_split_slack_ms"] == pytest.approx(3.0)
    assert c["ttft_split_slack_mean_ms"] == pytest.approx(4.0)
    assert c["ttft_split_ratio"] == pytest.approx(18 / 21) and c["ttft_split_within_slack"]


def test_idle_split_against_the_probes_mean_ttft():
    s0 = parse_prometheus(exposition(1e6, 1e-3, 4))
    s1 = parse_prometheus(exposition(5e6, 2e-3, 12))  # 8 requests: 18 ms of parts each
    f = idle_split(s0, s1, [20.0, 22.0, 24.0])  # ms
    assert f["idle_ttft_split_sum_ms"] == pytest.approx(18.0)
    assert f["idle_ttft_mean_ms"] == pytest.approx(22.0)
    assert f["idle_ttft_split_slack_ms"] == pytest.approx(4.0) and f["idle_ttft_split_within_slack"]
    assert not idle_split(s0, s1, [40.0])["idle_ttft_split_within_slack"]
    assert idle_split(s0, s1, []) == {} and idle_split(None, None, [1.0]) == {}


def test_counter_reset_counts_from_zero():
    s0 = parse_prometheus(exposition(5e6, 2e-3, 12))
    s1 = parse_prometheus(exposition(1e6, 1e-3, 4, gen=1))  # a restart reset the counters
    assert increase(s0, s1, "xpod_kv_transfers_total") == pytest.approx(4)
    assert increase(None, s1, "xpod_kv_transfers_total", link="0->1") == pytest.approx(3)
    f = pd_figures(s0, s1)
    assert f["kv_transfers"] == 4 and f["kv_transfer_gbps"] == pytest.approx(1.0)
    assert f["server_restarts"] == 1


def test_no_phases_observed():
    text = exposition(1e6, 1e-3, 4).replace(" 4\n", " 0\n").replace(" 4.0\n", " 0.0\n")
    s = parse_prometheus(text)
    f = pd_figures(s, s)
    assert f["ttft_split_sum_ms"] is None and f["kv_transfer_gbps"] is None
    assert ttft_check(f)["ttft_split_within_slack"] is None


def test_read_replay(tmp_path):
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"bit_equal": True, "steps": 26, "sampled": 27,
                                "n_token_mismatches": 0, "n_logit_mismatches": 0}))  # fmt: skip
    r = read_replay(str(path))
    assert r["replay_bit_equal"] is True and r["replay_sampled"] == 27
    assert "replay_error" not in r
    r = read_replay(str(tmp_path / "missing.json"))
    assert r["replay_bit_equal"] is None and "FileNotFoundError" in r["replay_error"]


# -- the --json key set and the report ------------------------------------------------------------


def layout_result(opts, tpot_ms: float, gap: float, kv: bool) -> dict:
    """A layout's result keys as `driver.run_layout` assembles them, from the same helpers."""
    reqs = [RequestResult(ok=True, prompt_len=32, output_tokens=16, ttft=0.02,
                          latency=0.02 + 15 * tpot_ms / 1e3, itl=[tpot_ms / 1e3] * 15)
            for _ in range(6)]  # fmt: skip
    res = driver._base(opts)
    res.update(bs.summarize(reqs, 1.0, opts.goodput, opts.metric_percentiles))
    streams = [[i * gap for i in range(30)], [0.001 + i * gap for i in range(30)]]
    res.update({"interference_streams": 2, "burst_prompts": 2, "burst_len": 128,
                **idle_figures(streams)})  # fmt: skip
    res.update(burst_figures(streams, 0.05, 0.1, res["idle_tpot_ms"]))
    res.update(burst_ttft_p50_ms=40.0, burst_ttft_p99_ms=50.0)
    res["rate_sweep"] = [{"fraction": f, "request_rate": 4.0 * f, "goodput": 3.0 * f,
                          "ttft_p50_ms": 20.0, "ttft_p99_ms": 30.0, "tpot_p50_ms": tpot_ms,
                          "tpot_p99_ms": tpot_ms, "failed": 0} for f in (0.5, 1.0)]  # fmt: skip
    res["capacity_req_per_s"] = 4.0
    res["goodput"], res["goodput_request_rate"] = best_goodput(res)
    res["ratio_to_decode"] = 0.9
    res.update(read_replay("/nonexistent-xpod-replay.json"))
    if kv:
        s0 = parse_prometheus(exposition(1e6, 1e-3, 4))
        res.update(pd_figures(s0, parse_prometheus(exposition(5e6, 2e-3, 12))))
        res.update(driver.pd_extras(replace(opts, launch=False), res))  # no p2p pod here
    return res


def test_compare_json_keys_and_report(capsys):
    opts = parse(*PD_TINY, "--compare-colocated", "--rate-sweep", "0.5,1", "--goodput",
                 "ttft:2000", "tpot:300")  # fmt: skip
    colo_opts = replace(opts, server_argv=opts.colocated_argv, layout="colocated")
    pd = layout_result(opts, 5.0, 0.005, kv=True)
    colo = layout_result(colo_opts, 8.0, 0.008, kv=False)
    res = json.loads(json.dumps(driver.compare_result(opts, pd, colo)))
    for side in ("pd", "colocated"):
        missing = [k for k in LAYOUT_KEYS if k not in res[side]]
        assert not missing, (side, missing)
    assert not [k for k in PD_KEYS if k not in res["pd"]]
    assert res["pd"]["goodput"] == pytest.approx(3.0) and res["pd"]["p2p_zero_copy_gbps"] is None
    assert res["colocated"]["server_args"].startswith("--dies 3")
    cmp = res["comparison"]
    assert cmp["p99_tpot_ms"]["pd_over_colocated"] == pytest.approx(5 / 8)
    assert [r["fraction"] for r in cmp["rate_sweep"]] == [0.5, 1.0]
    assert cmp["rate_sweep"][1]["goodput_pd"] == pytest.approx(3.0)
    assert res["failed"] == 0
    print_comparison(driver.compare_result(opts, pd, colo), opts)
    print_pd(pd, opts)
    out = capsys.readouterr().out
    assert "PD vs colocated" in out and "burst TPOT p99 / idle TPOT" in out
    assert "KV transfer 4.000 GB/s" in out and "TTFT split (means, ms)" in out
    assert comparison(pd, colo)["capacity_req_per_s"] == 4.0
