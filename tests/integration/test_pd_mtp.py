"""MTP on PD pods (prefill 2 + decode 2): the MTP layer's KV goes with the prompt's over the KV
links, the prefill die's drafts go with the first token in the KV record, and a request's first
row on its decode die is a verify row `[first] + drafts`.

- identity (batch-invariant, greedy and seeded): every request's tokens equal the same PD pod's
  without MTP, for k 1 and 2 and the fit, oracle and synthetic drafts, over a workload with
  chunked prefill, prefix hits, stop tokens, max_tokens 1 and 2 and a request that ends at
  max_seq_len; each decode-side first row feeds exactly the drafts its prefill die made;
  oracle acceptance is exactly 1;
- the transfers carry n_layers + 1 layers (their bytes), the schedule replay of both parts is
  bit-equal in default mode (tokens, every verify row's logits, the drafts of both parts);
- a decode die killed mid-verify: the pod restarts and every request's tokens are the same;
  an expired lease (kv_policy recompute) sends the request again, which serves the same tokens;
- `xpod serve` on a PD pod with MTP: backpressure, the spec counters, its replay check.
"""

from __future__ import annotations

import json
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from bench.serve.server import LaunchedServer
from runtime.engine import Engine, EngineConfig
from runtime.engine.replay import replay_engine
from runtime.engine.spec_stats import spec_summary
from runtime.model.mtp import SpecConfig
from sched import SamplingParams
from tests.waiting import stopped, wait_for

BI = {"batch_invariant": True}
MAX_SEQ = 256  # the tiny model's max_seq_len


def workload(n: int = 16, tokens: int = 32) -> tuple[list[list[int]], list[SamplingParams]]:
    """Prompts sharing prefixes (prefix hits on the prefill dies), greedy and seeded (0.8)
    requests, some stopping on tokens the model emits, max_tokens 1 (no decode row) and 2 (a
    first row with no room for a draft), and a long prompt (chunked prefill) whose request ends
    at max_seq_len (its drafts capped by the room left)."""
    rng = np.random.default_rng(23)
    shared = [256] + rng.integers(97, 123, 40).tolist()
    prompts, params = [], []
    for i in range(n):
        if i % 3 == 0:
            p = shared[: 17 + i % 24] + rng.integers(97, 123, 3).tolist()
        else:
            p = [256] + rng.integers(32, 127, 4 + (i * 7) % 37).tolist()
        prompts.append(p)
        params.append(SamplingParams(max_tokens={1: 1, 2: 2}.get(i, tokens - i % 3),
                                     temperature=0.8 if i % 2 else 0, seed=1000 + i,
                                     stop_token_ids=(136, 205) if i % 4 == 0 else (),
                                     ignore_eos=True))  # fmt: skip
    prompts.append([256] + rng.integers(32, 127, 199).tolist())
    params.append(SamplingParams(max_tokens=MAX_SEQ - 200, temperature=0.8, seed=7,
                                 ignore_eos=True))  # fmt: skip
    return prompts, params


def config(spec: SpecConfig | None, **kw) -> EngineConfig:
    # a token budget of 24 (chunked prefill) and a small decode pool (decode-side preemption)
    base = dict(model="tiny", model_overrides=BI, prefill_dies=2, decode_dies=2,
                max_num_seqs=6, max_num_batched_tokens=24, block_size=8, num_blocks=64,
                decode_blocks=40, speculative=spec, timeout_s=30.0)  # fmt: skip
    base.update(kw)
    return EngineConfig(**base)


def spec_of(k: int, draft: str) -> SpecConfig:
    name, _, rate = draft.partition(":")
    return SpecConfig(k, name, (float(rate),) if rate else ())


def first_rows(cfg: EngineConfig, log: dict) -> tuple[dict, dict]:
    """Each request's first row on its decode die (its logged row) and the drafts its prefill
    die made with its first token (the `drafted` of the step that sampled it)."""
    first, drafted = {}, {}
    for g in cfg.pd.decode:
        for rec in log.get(g, ()):
            for r in rec["rows"]:
                first.setdefault(r[0], r)
    for g in cfg.pd.prefill:
        for rec in log.get(g, ()):
            drafted.update((rid, list(d)) for rid, d in rec.get("drafted", ()))
    return first, drafted


@pytest.fixture(scope="module")
def baseline():
    """The PD run without MTP: its tokens, and the oracle's transcripts (the same requests
    without their stop tokens: a k = 2 row verifies a draft past its stop, which the run
    without MTP never sampled)."""
    prompts, params = workload()
    with Engine.launch(config(None)) as eng:
        outs = eng.generate(prompts, params, timeout_s=120)
        free = [SamplingParams(p.max_tokens, p.temperature, p.seed, (), p.ignore_eos)
                for p in params]  # fmt: skip
        longer = [o.token_ids for o in eng.generate(prompts, free, timeout_s=120)]
    want = [o.token_ids for o in outs]
    assert any(o.finish_reason == "stop" for o in outs)
    assert all(t[: len(w)] == w for w, t in zip(want, longer, strict=True))
    assert len(want[-1]) == MAX_SEQ - 200
    return prompts, params, want, longer


@pytest.mark.timeout(180)
# each k and each draft once: oracle and synthetic drafts replace the argmax of an MTP forward
# that still runs all k sub-forwards, so (2, fit) is (2, oracle)'s path with other drafts, and
# (1, oracle) is (2, oracle)'s with one sub-forward
@pytest.mark.parametrize(("k", "draft"), [(1, "fit"), (2, "oracle"), (2, "synthetic:0.5")])
def test_pd_mtp_serves_the_tokens_of_the_pd_run_without(baseline, k, draft):
    prompts, params, want, longer = baseline
    spec = spec_of(k, draft)
    cfg = config(spec, log_steps=True)
    with Engine.launch(cfg) as eng:
        outs = eng.generate(prompts, params, timeout_s=120,
                            transcripts=longer if spec.transcript else None)  # fmt: skip
        stats = spec_summary(eng.stats, spec)
    got = [o.token_ids for o in outs]
    bad = [i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b]
    assert not bad, f"requests {bad} differ from the PD run without MTP"
    assert stats["num_drafts"] > 0
    if spec.draft == "oracle":
        assert stats["acceptance_rate"] == 1.0, stats
    # the decode side's first row of a request: [first] + the drafts its prefill die made
    first, drafted = first_rows(cfg, eng.step_log)
    ids = {o.request_id: i for i, o in enumerate(outs)}
    full = 0
    for rid, i in ids.items():
        n = params[i].max_tokens
        if n == 1 or len(want[i]) == 1:
            assert rid not in first  # it ended with its first token
            continue
        row = first[rid]
        fed, start, nd = row[1], row[2], row[8]
        assert start == len(prompts[i]) and fed[0] == want[i][0], (rid, row[:3])
        assert len(drafted[rid]) == k and nd <= min(k, n - 2), (rid, nd, n, drafted[rid])
        assert fed[1:] == drafted[rid][:nd], (rid, fed, drafted[rid])
        full += nd == min(k, n - 2)  # less only if the step's token budget was short
    assert full >= len(prompts) - 4, full


@pytest.mark.timeout(180)
def test_the_pd_schedule_replay_is_bit_equal_with_mtp_and_moves_its_layer():
    prompts, params = workload(8, 24)
    spec = SpecConfig(2, "fit")
    cfg = config(spec, model_overrides={}, log_steps=True, keep_logits=True)
    with Engine.launch(cfg) as eng:
        outs = eng.generate(prompts, params, timeout_s=120)
        st = {g: dict(s) for g, s in eng.stats.items()}
    assert {o.finish_reason for o in outs} <= {"stop", "length"}
    # every transfer moved the prompt's rows of every main layer and of the MTP layer
    m = cfg.model_config()
    assert m.kv_layers == m.n_layers + 1
    links = [v for g in cfg.pd.decode for v in st[g]["pd_links"].values()]
    assert sum(v["transfers"] for v in links) == len(prompts)  # each request's once
    moved = sum(len(p) for p in prompts) * m.kv_layers * m.kv_cache_dim * 4
    assert sum(v["bytes"] for v in links) == moved
    rep = replay_engine(cfg, eng.step_log)
    assert rep.bit_equal, (rep.token_mismatches[:3], rep.logit_mismatches[:3],
                           rep.draft_mismatches[:3])  # fmt: skip
    assert rep.drafts_compared > 0 and rep.logits_compared > rep.sampled  # verify rows: 1 + k


@pytest.mark.timeout(240)
def test_a_decode_die_killed_mid_verify_recovers_with_the_same_tokens(baseline):
    prompts, params, want, _ = baseline
    with Engine.launch(config(SpecConfig(1, "fit"), inject="kill:die=3,step=12")) as eng:
        outs = eng.generate(prompts, params, timeout_s=180)
        rel = eng.reliability()
    assert rel["counts"]["injected"] and rel["counts"]["recovered"], rel["counts"]
    assert [o.token_ids for o in outs] == want


@pytest.mark.timeout(120)
def test_an_expired_lease_with_mtp_is_sent_again_and_serves_the_same_tokens():
    # the decode master stopped: nobody reads the KV, the lease frees it, the record that
    # answers the scatter list fails, and kv_policy recompute sends the request again
    opts = dict(model="tiny", model_overrides=BI, prefill_dies=1, decode_dies=1, max_num_seqs=4,
                recover=False, kv_lease_s=0.3, kv_timeout_s=30.0, stall_timeout_s=120.0,
                heartbeat_timeout_s=120.0, speculative=SpecConfig(1, "fit"),
                timeout_s=20.0)  # fmt: skip
    p = SamplingParams(max_tokens=12, temperature=0.8, seed=3, ignore_eos=True)
    with Engine.launch(**opts) as eng:
        with stopped(eng.masters[1].pid):
            r = eng.submit("lease " * 10, p)
            wait_for(lambda: (eng.stats.get(0) or {}).get("pd_leases_expired"),
                     what="the lease to expire")  # fmt: skip
        out = eng.result(r, 30)
        again = eng.generate(["lease " * 10], p, timeout_s=30)[0]
        recomputed = eng.tracker.pd.counters["pd_recomputed"]
        st = wait_for(lambda: (s := eng.stats.get(1)) and not s["kv"]["used"] and s,
                      what="the decode side to free")  # fmt: skip
    assert recomputed == 1 and st["pd_failed"] == 1 and st["spec_drafts"] > 0
    assert len(out.token_ids) == 12 and out.token_ids == again.token_ids


def complete(url: str, i: int) -> tuple[int, dict]:
    body = json.dumps({"model": "xpod-tiny", "prompt": f"{i:03d} " + "long prompt " * 9,
                       "max_tokens": 16, "ignore_eos": True}).encode()  # fmt: skip
    req = urllib.request.Request(url + "/v1/completions", body,
                                 {"content-type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=120) as r:
        return r.status, json.loads(r.read())


def scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return {ln.rpartition(" ")[0]: float(ln.rpartition(" ")[2])
            for ln in text.splitlines() if ln and not ln.startswith("#")}  # fmt: skip


def total(m: dict[str, float], name: str) -> float:
    """A counter summed over its labels (every group)."""
    return sum(v for k, v in m.items() if k.startswith(name + "{"))


@pytest.mark.timeout(240)
def test_serve_on_a_pd_pod_with_mtp_defers_counts_and_replays(tmp_path):
    replay = tmp_path / "replay.json"
    server = LaunchedServer(("--prefill-dies", "2", "--decode-dies", "2", "--model", "tiny",
                             "--num-speculative-tokens", "1", "--block-size", "16",
                             "--decode-blocks", "16", "--max-num-seqs", "4",
                             "--replay-check", str(replay)))  # fmt: skip
    try:
        url = server.start()
        with ThreadPoolExecutor(12) as ex:
            res = list(ex.map(lambda i: complete(url, i), range(24)))
        assert all(code == 200 for code, _ in res), res
        assert all(b["usage"]["completion_tokens"] == 16 for _, b in res)
        # every request: its prefill's token, then per verify row on its decode die one token
        # and the drafts it accepted (its first row one of them). The masters' counters reach
        # /metrics with their next stats message: wait until they add up (they only grow).
        seen = {}

        def counted() -> bool:
            seen["m"] = m = scrape(url)
            seen["rows"] = total(m, "xpod_spec_decode_verify_rows_total")
            seen["acc"] = total(m, "xpod_spec_decode_num_accepted_tokens_total")
            return 24 + seen["rows"] + seen["acc"] >= 24 * 16

        wait_for(counted, what="the spec-decode counters of every token")
        m, rows, acc = seen["m"], seen["rows"], seen["acc"]
        assert m["xpod_pd_deferred_total"] >= 1, "no backpressure"
        assert m['xpod_pd_transfers_total{result="success"}'] == 24
        assert m["xpod_kv_checksum_mismatches_total"] == 0
        assert 24 + rows + acc == 24 * 16, (rows, acc)
        assert total(m, "xpod_spec_decode_num_drafts_total") >= 24
        assert server.stop() == 0
    finally:
        server.close()
    rep = json.loads(replay.read_text())
    assert rep["bit_equal"] and rep["n_token_mismatches"] == 0, rep
