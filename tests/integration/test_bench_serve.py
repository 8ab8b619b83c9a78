"""`xpod bench serve`: the arrival times and statistics on known inputs, the client's failure
accounting against a scripted fake server, flag errors (status 2, one line, before anything
starts), and two real runs on the tiny model: `--launch --quick` and `--url` against a server
the test starts. Speed is measured by the benchmark, never asserted here."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import re
import signal
import subprocess
import sys
import threading

import numpy as np
import pytest

from bench import serve as bs
from bench.serve.client import RequestResult
from bench.serve.dataset import make_requests
from bench.serve.flags import QUICK_MAX_PROMPTS
from bench.serve.report import SHOW_ERRORS
from bench.serve.scrape import parse_prometheus, server_figures, total
from bench.serve.stats import find_knee
from runtime import cli

pytest.importorskip("aiohttp")

VLLM_KEYS = (
    "completed", "failed", "duration", "total_input_tokens", "total_output_tokens",
    "request_throughput", "request_goodput", "output_throughput", "total_token_throughput",
    "max_concurrent_requests",
) + tuple(f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el")
          for s in ("mean", "median", "std", "p90", "p99"))  # fmt: skip
SERVER_KEYS = (
    "kv_balance", "dummy_step_share", "bubble_ms_per_step", "moe_wait_share",
    "attention_imbalance_mean", "prefix_hit_rate", "step_ms_mean", "cpu_s_client",
    "cpu_ms_per_token_client", "cpu_s_shell", "cpu_s_masters", "cpu_s_outputs", "cpu_s_dies",
    "cpu_s_server", "cpu_ms_per_token_server",
)  # fmt: skip
TTFT_KEYS = ("ttft_idle_p50_ms", "prefill_ms", "ttft_load_p50_ms", "ttft_load_p99_ms",
             "step_load_ms", "ttft_idle_bound_ms", "ttft_load_bound_ms")  # fmt: skip
TINY = ["--num-prompts", "12", "--random-input-len", "16", "--random-output-len", "8",
        "--ignore-eos", "--disable-tqdm"]  # fmt: skip


# -- arrivals and statistics (no process) ----------------------------------------------------------


@pytest.mark.parametrize("burstiness", [1.0, 0.25, 4.0])
def test_arrival_times_rate_and_burstiness(burstiness):
    n, rate = 20000, 50.0
    t = bs.arrival_times(n, rate, burstiness, seed=3)
    gaps = np.diff(np.concatenate([[0.0], t]))
    assert (gaps >= 0).all()
    assert t[-1] == pytest.approx(n / rate)  # vLLM's rescaling: the run lasts N / rate
    assert gaps.mean() == pytest.approx(1 / rate)
    # gamma of shape k: coefficient of variation 1 / sqrt(k) (Poisson: 1)
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)
    assert not np.array_equal(t, bs.arrival_times(n, rate, burstiness, seed=4))
    assert np.array_equal(t, bs.arrival_times(n, rate, burstiness, seed=3))


def test_arrival_times_inf_and_ramp():
    assert (bs.arrival_times(7, math.inf) == 0).all()
    t = bs.arrival_times(4000, math.inf, 1.0, 0, ("linear", 10.0, 100.0))
    gaps = np.diff(t)
    assert gaps[:200].mean() == pytest.approx(np.mean(1 / np.linspace(10, 14.5, 200)), rel=0.15)
    assert gaps[-200:].mean() == pytest.approx(1 / 97.75, rel=0.15)
    e = np.diff(bs.arrival_times(4000, math.inf, 1.0, 0, ("exponential", 1.0, 100.0)))
    assert e[:100].mean() > 20 * e[-100:].mean()


def _ok(ttft_ms, e2e_ms, n_out, itl_ms=()):
    return RequestResult(ok=True, prompt_len=10, output_tokens=n_out, ttft=ttft_ms / 1e3,
                            latency=e2e_ms / 1e3, itl=[g / 1e3 for g in itl_ms])  # fmt: skip


def test_summarize_known_inputs():
    results = [
        _ok(10, 100, 10, [5, 15]),  # tpot (100 - 10) / 9 = 10 ms
        _ok(20, 200, 10, [10]),  # 20 ms
        _ok(30, 300, 10),  # 30 ms
        _ok(40, 400, 1),  # one token: no tpot
        RequestResult(ok=False, prompt_len=10, error="HTTP 500: boom"),
    ]
    s = bs.summarize(results, 2.0, {"ttft": 25, "e2el": 250}, (50, 90, 99, 99.9))
    assert (s["completed"], s["failed"]) == (4, 1)
    assert (s["total_input_tokens"], s["total_output_tokens"]) == (40, 31)
    assert s["duration"] == 2.0
    assert s["request_throughput"] == pytest.approx(2.0)
    assert s["output_throughput"] == pytest.approx(15.5)
    assert s["total_token_throughput"] == pytest.approx(35.5)
    assert s["request_goodput"] == pytest.approx(1.0)  # the first two meet both SLOs
    assert s["mean_ttft_ms"] == pytest.approx(25)
    assert s["median_ttft_ms"] == pytest.approx(25)
    assert s["std_ttft_ms"] == pytest.approx(math.sqrt(125))
    assert s["p90_ttft_ms"] == pytest.approx(37)  # linear interpolation, as numpy / vLLM
    assert s["p99_ttft_ms"] == pytest.approx(39.7)
    assert s["p99.9_ttft_ms"] == pytest.approx(39.97)
    assert s["mean_tpot_ms"] == pytest.approx(20) and s["median_tpot_ms"] == pytest.approx(20)
    assert s["mean_itl_ms"] == pytest.approx(10)
    assert s["median_e2el_ms"] == pytest.approx(250)
    assert bs.summarize(results, 2.0, {"tpot": 15})["request_goodput"] == pytest.approx(1.0)
    # requests 1 and 4 (tpot 0 with one token)
    assert bs.summarize(results, 2.0, {})["request_goodput"] is None
    empty = bs.summarize([], 1.0, {})
    assert empty["completed"] == 0 and empty["mean_ttft_ms"] == 0.0


def test_find_knee():
    def rows(ttft, good):
        return [{"ttft_p50_ms": a, "goodput": b} for a, b in zip(ttft, good, strict=True)]

    assert find_knee(rows([10, 11, 12, 25, 90], [1, 2, 3, 4, 5])) == 3  # TTFT > 2x
    assert find_knee(rows([10, 11, 12, 13, 14], [1, 2, 3, 3.01, 3])) == 3  # goodput flat
    assert find_knee(rows([10, 11, 12], [1, 2, 3])) is None


PROM = """# HELP x
xpod_kv_cache_usage_perc{{group="0"}} {kv0}
xpod_kv_cache_usage_perc{{group="1"}} {kv1}
xpod_steps_total{{group="0"}} {steps}
xpod_steps_total{{group="1"}} {steps}
xpod_dummy_steps_total{{group="0"}} {dummy}
xpod_scheduling_bubble_seconds_total{{group="0"}} {bubble}
xpod_forward_seconds_total{{group="0"}} {fwd}
xpod_moe_wait_seconds_total{{group="0"}} {moe}
xpod_prefix_cache_queries_total{{group="0"}} {queries}
xpod_prefix_cache_hits_total{{group="0"}} {hits}
xpod_step_seconds_sum{{group="0"}} {ssum}
xpod_step_seconds_count{{group="0"}} {scount}
xpod_attention_imbalance_sum 0
xpod_attention_imbalance_count 0
xpod_process_cpu_seconds_total{{group="",role="shell"}} {shell}
xpod_process_cpu_seconds_total{{group="0",role="die"}} {die}
xpod_process_cpu_seconds_total{{group="1",role="die"}} {die}
"""


def _snap(**kw):
    base = dict(kv0=0, kv1=0, fwd=0, queries=0, steps=0, dummy=0, bubble=0, moe=0, hits=0,
                ssum=0, scount=0, shell=1, die=2)  # fmt: skip
    return parse_prometheus(PROM.format(**{**base, **kw}))


def test_server_figures_from_metrics_deltas():
    s0 = _snap()
    s1 = _snap(fwd=10, queries=100, steps=50, dummy=10, bubble=0.2, moe=4, hits=50, ssum=0.3,
               scount=30, shell=2, die=3.5)  # fmt: skip
    snaps = [_snap(kv0=0.5, kv1=0.25), _snap(), _snap(kv0=0.2, kv1=0.2)]  # idle one skipped
    f = server_figures(s0, s1, snaps, n_out=1000)
    assert f["kv_balance"] == pytest.approx((0.5 / 0.375 + 1.0) / 2)
    d = lambda name: total(s1, name) - total(s0, name)  # noqa: E731
    steps, dummy = d("xpod_steps_total"), d("xpod_dummy_steps_total")  # with rows / without
    assert steps > 0 and dummy > 0
    assert f["dummy_step_share"] == pytest.approx(dummy / (dummy + steps))
    assert f["bubble_ms_per_step"] == pytest.approx(d("xpod_scheduling_bubble_seconds_total")
                                                    * 1e3 / steps)  # fmt: skip
    assert f["moe_wait_share"] == pytest.approx(0.4)
    assert f["prefix_hit_rate"] == pytest.approx(0.5)
    assert f["step_ms_mean"] == pytest.approx(10.0)
    assert f["cpu_s_shell"] == pytest.approx(1) and f["cpu_s_dies"] == pytest.approx(3)
    assert f["cpu_s_server"] == pytest.approx(4)
    assert f["cpu_ms_per_token_server"] == pytest.approx(4.0)
    assert server_figures(None, s1, [], 1) == {}


# -- the client's failure accounting (a scripted fake server in a thread) --------------------------

MODES = ("ok", "http500", "nousage", "cut", "errevent", "badsse")


class FakeServer:
    """An aiohttp server answering request k by MODES[k % len(MODES)]."""

    def __init__(self):
        self.k = 0
        self.url = ""
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    async def completions(self, request):
        from aiohttp import web

        body = await request.json()
        mode = MODES[self.k % len(MODES)]
        self.k += 1
        if mode == "http500":
            return web.json_response({"error": {"message": "boom"}}, status=500)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)

        def frame(obj):
            return b"data: " + json.dumps(obj).encode() + b"\n\n"

        # two chunks carrying three token ids, usage says max_tokens: the count is usage's
        await resp.write(frame({"choices": [{"text": "ab", "token_ids": [97, 98]}]}))
        if mode == "cut":
            request.transport.close()
            return resp
        if mode == "errevent":
            await resp.write(frame({"error": {"message": "engine failed"}}))
        elif mode == "badsse":
            await resp.write(b"data: {not json\n\n")
        await resp.write(frame({"choices": [{"text": "c", "token_ids": [99]}]}))
        if mode != "nousage":
            n = body["max_tokens"]
            usage = {"prompt_tokens": 5, "completion_tokens": n}
            await resp.write(frame({"choices": [], "usage": usage}))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    def _run(self):
        from aiohttp import web

        async def models(request):
            return web.json_response({"data": [{"id": "fake", "max_model_len": 256}]})

        app = web.Application()
        app.router.add_get("/v1/models", models)
        app.router.add_post("/v1/completions", self.completions)
        asyncio.set_event_loop(self.loop)
        runner = web.AppRunner(app)
        self.loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        self.ready.set()
        self.loop.run_forever()
        self.loop.run_until_complete(runner.cleanup())

    def __enter__(self):
        self.thread.start()
        assert self.ready.wait(10)
        return self

    def __exit__(self, *exc):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.mark.timeout(60)
def test_failed_requests_are_counted_with_their_errors(tmp_path, capsys):
    out = tmp_path / "fake.json"
    with FakeServer() as fake:
        # request 0 is the test request (ok); 12 more cycle through every mode twice
        argv = ["bench", "serve", "--url", fake.url, "--num-prompts", "12", "--max-concurrency",
                "1", "--random-input-len", "8", "--random-output-len", "5", "--json", str(out),
                "--disable-tqdm"]  # fmt: skip
        assert cli.main(argv) == 1  # failures make the status 1
    res = json.loads(out.read_text())
    assert res["completed"] == 2 and res["failed"] == 10
    assert res["total_output_tokens"] == 10  # usage.completion_tokens: not 2 chunks, 3 ids
    assert res["total_input_tokens"] == 10  # usage.prompt_tokens
    errs = res["errors"]
    assert len(errs) == SHOW_ERRORS
    assert errs[0] == "HTTP 500: boom"
    assert errs[1] == "no usage in the stream"
    assert "Payload" in errs[2] or "Disconnect" in errs[2] or "Connection" in errs[2]
    assert errs[3] == "error event: engine failed"
    assert errs[4].startswith("bad SSE data")
    stdout = capsys.readouterr().out
    assert "first errors of 10 failed request(s)" in stdout
    assert "HTTP 500: boom" in stdout
    assert "kv_balance" not in res  # no /metrics there: no server figures, no crash


# -- flags -----------------------------------------------------------------------------------------

BAD = [
    (["--url", "http://127.0.0.1:1", "--launch"], "--launch"),
    ([], "--url --launch"),
    (["--url", "localhost:8000"], "--url"),
    (["--launch", "--goodput", "ttfx:500"], "--goodput"),
    (["--launch", "--goodput", "ttft:-1"], "--goodput"),
    (["--launch", "--goodput", "ttft:5", "ttft:6"], "--goodput"),
    (["--launch", "--request-rate", "0"], "--request-rate"),
    (["--launch", "--request-rate", "fast"], "--request-rate"),
    (["--launch", "--burstiness", "0"], "--burstiness"),
    (["--launch", "--num-prompts", "0"], "--num-prompts"),
    (["--launch", "--random-input-len", "1"], "--random-input-len"),
    (["--launch", "--random-range-ratio", "1"], "--random-range-ratio"),
    (["--launch", "--model", "tiny", "--random-input-len", "250"], "--random-input-len"),
    (["--launch", "--model", "tiny", "--dataset", "prefix-repetition"], "--prefix-repetition"),
    (["--launch", "--temperature", "3"], "--temperature"),
    (["--launch", "--dataset", "file"], "--dataset-path"),
    (["--launch", "--dataset-path", "/nonexistent-xpod.jsonl"], "--dataset-path"),
    (["--launch", "--server-args", "--bogus"], "--server-args"),
    (["--launch", "--server-args", "--dies 0"], "--server-args"),
    (["--launch", "--server-args", "'unclosed"], "--server-args"),
    (["--launch", "--rate-sweep", "1,0.5"], "--rate-sweep"),
    (["--launch", "--rate-sweep", "0.5,1", "--request-rate", "5"], "--rate-sweep"),
    (["--launch", "--ramp-up-strategy", "linear"], "--ramp-up-strategy"),
    (["--launch", "--json", "/nonexistent-xpod-dir/x.json"], "--json"),
    (["--launch", "--metric-percentiles", "100"], "--metric-percentiles"),
    (["--url", "http://127.0.0.1:1", "--dies", "4"], "--dies"),
    (["--url", "http://127.0.0.1:1", "--server-args", "--dies 2"], "--server-args"),
    (["--url", "http://127.0.0.1:1", "--ttft"], "--ttft"),
]


@pytest.fixture
def nothing_starts(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("a bad flag must be refused before anything starts")

    monkeypatch.setattr(subprocess, "Popen", refuse)
    monkeypatch.setattr(bs, "run", refuse)


@pytest.mark.parametrize(("argv", "flag"), BAD)
def test_bad_flag_is_one_line_with_status_2(argv, flag, capsys, nothing_starts):
    with pytest.raises(SystemExit) as exc:  # argparse's own errors exit
        raise SystemExit(cli.main(["bench", "serve", *argv]))
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("xpod bench serve: error:"), err
    assert flag in err, err


def test_bad_jsonl_names_the_line(tmp_path, capsys, nothing_starts):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "hello"}\n\n{"prompt": "x", "max_tokens": 0}\n')
    rc = cli.main(["bench", "serve", "--launch", "--dataset", "file", "--dataset-path", str(path)])
    assert rc == 2
    err = capsys.readouterr().err
    assert "--dataset-path" in err and ":3:" in err and "max_tokens" in err


def test_good_flags_parse(tmp_path):
    args = cli.build_parser().parse_args(["bench", "serve", "--launch", "--dies", "2",
                                          "--max-concurrency", "5", "--goodput", "ttft:500",
                                          "tpot:50", "--server-args", "--async-depth 1",
                                          "--dataset", "prefix_repetition", "--quick"])  # fmt: skip
    o = bs.parse_options(args)
    assert (o.dies, o.max_num_seqs, o.model) == (2, 3, "small")  # ceil(5 / 2)
    assert o.goodput == {"ttft": 500.0, "tpot": 50.0}
    assert o.server_argv[-2:] == ("--async-depth", "1")
    assert o.dataset == "prefix-repetition" and o.num_prompts == QUICK_MAX_PROMPTS
    assert o.ttft is False  # --quick: off unless asked
    assert o.request_rate == math.inf
    reqs = make_requests(o, 8, 0)
    prefixes = {r.prompt[: o.pr_prefix_len] for r in reqs}
    assert len(prefixes) == 4 and all(r.prompt_len == len(r.prompt) + 1 for r in reqs)
    args = cli.build_parser().parse_args(["bench", "serve", "--launch", "--random-range-ratio",
                                          "0.5", "--random-prefix-len", "7"])  # fmt: skip
    o = bs.parse_options(args)
    assert o.ttft is True and o.max_num_seqs == 8
    reqs = make_requests(o, 200, 0)
    lens = [r.prompt_len - 7 for r in reqs]
    assert min(lens) >= 32 and max(lens) <= 96 and len(set(lens)) > 20
    assert len({r.prompt[:7] for r in reqs}) == 1
    assert all(r.prompt.isascii() and r.prompt.isprintable() for r in reqs)
    assert {r.prompt for r in make_requests(o, 5, 1)}.isdisjoint(r.prompt for r in reqs)


# -- real runs on the tiny model -------------------------------------------------------------------


@pytest.mark.timeout(180)
def test_launch_quick(tmp_path, capsys):
    out = tmp_path / "serve.json"
    argv = ["bench", "serve", "--launch", "--quick", "--model", "tiny", "--dies", "2",
            "--max-concurrency", "4", "--ttft", "--ttft-probes", "4", "--json", str(out),
            *TINY]  # fmt: skip
    assert cli.main(argv) == 0
    res = json.loads(out.read_text())
    for key in VLLM_KEYS + SERVER_KEYS + TTFT_KEYS + ("decode_tokens_per_s", "ratio_to_decode"):
        assert key in res, key
    assert res["completed"] == 12 and res["failed"] == 0
    assert res["total_output_tokens"] == 12 * 8  # --ignore-eos: max_tokens each
    assert res["total_input_tokens"] == 12 * 16
    assert res["server_exit_status"] == 0
    assert 1 <= res["max_concurrent_requests"] <= 4
    assert res["max_num_seqs"] == 2 and res["groups"] == 2  # ceil(4 / 2) per group
    assert res["ratio_to_decode"] > 0 and res["decode_tokens_per_s"] > 0
    assert res["cpu_s_dies"] > 0 and res["steps"] > 0
    assert res["ttft_idle_p50_ms"] > 0 and res["prefill_ms"] > 0 and res["step_load_ms"] > 0
    assert res["ttft_load_requests"] == 3
    assert res["ttft_load_bound_ms"] == pytest.approx(
        res["prefill_ms"] + 2 * res["step_load_ms"] + 5
    )
    assert "Serving Benchmark Result" in capsys.readouterr().out
    assert res["client_policy"] == "batch"
    assert os.sched_getscheduler(0) == os.SCHED_OTHER  # given back: later pods must not inherit


@pytest.fixture
def tiny_server(tmp_path):
    """`xpod serve` on the tiny model, started by the test (not by the benchmark)."""
    log = open(tmp_path / "serve.log", "wb")  # noqa: SIM115
    cmd = [sys.executable, "-m", "runtime.cli", "serve", "--dies", "2", "--model", "tiny",
           "--port", "0", "--max-num-seqs", "4"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log)
    try:
        line = proc.stdout.readline().decode()
        m = re.search(r"on (http://\S+)", line)
        assert m, f"no URL line: {line!r}"
        yield m.group(1)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        proc.stdout.close()
        log.close()


@pytest.mark.timeout(180)
def test_url_against_a_running_server(tiny_server, tmp_path, capsys):
    out, png = tmp_path / "chat.json", tmp_path / "sweep.png"
    argv = ["bench", "serve", "--url", tiny_server, "--endpoint", "chat", "--max-concurrency",
            "4", "--goodput", "ttft:10000", "e2el:60000", "--rate-sweep", "0.5,1",
            "--plot", str(png), "--json", str(out), *TINY]  # fmt: skip
    assert cli.main(argv) == 0
    res = json.loads(out.read_text())
    assert res["completed"] == 12 and res["total_output_tokens"] == 12 * 8
    assert res["model_id"] == "xpod-tiny" and res["groups"] == 2
    assert "decode_tokens_per_s" not in res and "ttft_idle_p50_ms" not in res
    assert res["request_goodput"] == pytest.approx(res["request_throughput"])
    assert res["total_input_tokens"] > 12 * 16  # the chat template's tokens, from usage
    sweep = res["rate_sweep"]
    assert [r["fraction"] for r in sweep] == [0.5, 1.0]
    assert sweep[0]["request_rate"] == pytest.approx(0.5 * res["capacity_req_per_s"])
    assert all(r["completed"] == 12 for r in sweep)
    assert png.stat().st_size > 10_000
    assert "rate sweep" in capsys.readouterr().out

    # prefix repetition at a finite, bursty rate: the prefix cache hits show in /metrics
    out = tmp_path / "prefix.json"
    argv = ["bench", "serve", "--url", tiny_server, "--dataset", "prefix-repetition",
            "--prefix-repetition-prefix-len", "48", "--prefix-repetition-suffix-len", "8",
            "--prefix-repetition-num-prefixes", "2", "--prefix-repetition-output-len", "4",
            "--request-rate", "100", "--burstiness", "0.5", "--num-prompts", "16",
            "--ignore-eos", "--disable-tqdm", "--json", str(out)]  # fmt: skip
    assert cli.main(argv) == 0
    res = json.loads(out.read_text())
    assert res["completed"] == 16 and res["total_output_tokens"] == 64
    assert res["total_input_tokens"] == 16 * 57
    assert res["prefix_hit_rate"] > 0.3
    with contextlib.suppress(Exception):
        capsys.readouterr()


def test_server_figures_of_mtp_from_metrics_deltas():
    spec = """
xpod_spec_decode_num_drafts_total{{group="0"}} {d}
xpod_spec_decode_num_draft_tokens_total{{group="0"}} {dt}
xpod_spec_decode_num_accepted_tokens_total{{group="0"}} {a}
xpod_spec_decode_num_accepted_tokens_per_pos_total{{group="0",position="0"}} {p0}
xpod_spec_decode_num_accepted_tokens_per_pos_total{{group="0",position="1"}} {p1}
xpod_mtp_seconds_total{{group="0"}} {m}
xpod_steps_total{{group="0"}} {s}
"""
    s0 = parse_prometheus(spec.format(d=10, dt=20, a=5, p0=4, p1=1, m=0.1, s=10))
    s1 = parse_prometheus(spec.format(d=110, dt=220, a=125, p0=94, p1=36, m=0.3, s=110))
    f = server_figures(s0, s1, [], n_out=1)
    assert f["num_drafts"] == 100 and f["num_draft_tokens"] == 200
    assert f["acceptance_rate"] == pytest.approx(0.6)
    assert f["mean_acceptance_length"] == pytest.approx(2.2)
    assert f["acceptance_per_pos"] == pytest.approx([0.9, 0.35])
    assert f["mtp_ms_per_step"] == pytest.approx(2.0)
    assert "num_drafts" not in server_figures(s0, s0, [], n_out=1)  # no MTP: no MTP keys
