"""Backpressure of a PD pod through the HTTP server: decode dies with a pool of 8 blocks, 50 long
prompts at once. The decode masters defer the KV of what they cannot hold (Bootstrapping: no
out-of-memory), the shell holds at most --max-queue requests and answers 503 past it, every
accepted request finishes whole, and once the load drops the refused ones all go through; the
served tokens equal the replay of both parts (`xpod serve --replay-check`)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from bench.serve.server import LaunchedServer

N, MAX_TOKENS, MAX_QUEUE = 50, 24, 8


def complete(url: str, i: int) -> tuple[int, dict]:
    body = json.dumps({"model": "xpod-tiny", "prompt": f"{i:03d} " + "long prompt " * 13,
                       "max_tokens": MAX_TOKENS, "ignore_eos": True}).encode()  # fmt: skip
    req = urllib.request.Request(url + "/v1/completions", body,
                                 {"content-type": "application/json"})  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, v = line.rpartition(" ")
            out[name] = float(v)
    return out


@pytest.mark.timeout(300)
def test_a_full_decode_pool_defers_the_kv_and_the_shell_sheds_past_its_queue(tmp_path):
    replay = tmp_path / "replay.json"
    server = LaunchedServer(("--prefill-dies", "1", "--decode-dies", "2", "--model", "tiny",
                             "--block-size", "64", "--decode-blocks", "8", "--max-num-seqs", "4",
                             "--queue-ahead", "0", "--max-queue", str(MAX_QUEUE),
                             "--max-num-batched-tokens", "64",
                             "--replay-check", str(replay)))  # fmt: skip
    try:
        url = server.start()
        with ThreadPoolExecutor(N) as ex:
            first = list(ex.map(lambda i: complete(url, i), range(N)))
        refused = [i for i, (code, _) in enumerate(first) if code == 503]
        done = [b for code, b in first if code == 200]
        assert {code for code, _ in first} <= {200, 503}, [
            b for c, b in first if c not in (200, 503)
        ]
        assert refused and len(done) >= 2 * 4 + MAX_QUEUE  # in the groups + held, at least
        assert all(b["choices"][0]["finish_reason"] == "length" for b in done)
        assert all(b["usage"]["completion_tokens"] == MAX_TOKENS for b in done)
        # a counter, not a gauge caught in its window: the decode side deferred some KV
        assert scrape(url)["xpod_pd_deferred_total"] >= 1, "no backpressure"
        # the load is gone: the refused ones all go through
        with ThreadPoolExecutor(MAX_QUEUE) as ex:
            again = list(ex.map(lambda i: complete(url, i), refused))
        assert all(code == 200 for code, _ in again), again
        m = scrape(url)
        assert m["xpod_kv_checksum_mismatches_total"] == 0
        assert m['xpod_pd_transfers_total{result="failed"}'] == 0
        assert m['xpod_pd_transfers_total{result="success"}'] == N
        for phase in ("queue", "prefill", "kv_wait", "transfer", "first_step"):  # TTFT by part
            assert m[f'xpod_pd_ttft_phase_seconds_count{{phase="{phase}"}}'] == N
        assert m['xpod_pd_ttft_phase_seconds_sum{phase="prefill"}'] > 0
        assert server.stop() == 0
    finally:
        server.close()
    rep = json.loads(replay.read_text())
    assert rep["bit_equal"] and rep["n_token_mismatches"] == 0, rep
