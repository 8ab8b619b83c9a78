"""`xpod bench serve --dataset multi-turn` and `--compare-pool`, without a server: the ideal hit
rate on a hand-built trace, the dataset's determinism and shape, the closed loop against a
scripted client (every turn resends the server's own reply ids, a failed turn ends its
conversation), the per-group load figures, the bars, each layout's `xpod serve` flags and the
flag checks (one line naming the flag, status 2, before anything starts)."""

from __future__ import annotations

import asyncio
import subprocess
from dataclasses import replace

import numpy as np
import pytest

pytest.importorskip("aiohttp")
pytest.importorskip("uvloop")

from bench import serve as bs  # noqa: E402
from bench.common import Bar  # noqa: E402
from bench.serve.client import RequestResult  # noqa: E402
from bench.serve.mt_compare import (  # noqa: E402
    compare_pool_result,
    evaluate_bars,
    median_layouts,
    round_bars,
)
from bench.serve.multiturn import (  # noqa: E402
    MultiTurnRun,
    ideal_hit_rate,
    ideal_hits,
    load_figures,
    make_conversations,
)
from bench.serve.options import MTSpec  # noqa: E402
from bench.serve.scrape import parse_prometheus  # noqa: E402
from runtime import cli  # noqa: E402
from runtime.model import BOS, EOS  # noqa: E402

# -- the ideal hit rate ----------------------------------------------------------------------------


def test_ideal_hit_rate_by_hand():
    r = list(range(10))
    prompts = [
        r,  # 10 tokens: nothing before; leaves blocks [0-3] [4-7]
        [*r, 10, 11, 12, 13, 14],  # 15: may hit (15-1)//4 = 3 blocks, 2 were sent: 8
        [0, 1, 2, 3, 99, 98, 97, 96],  # 8: may hit 1 block: [0-3] was sent: 4
        r,  # 10: may hit 2 blocks, both sent: 8
        list(range(8)),  # 8: two full blocks sent, but the last token is computed: 1 block, 4
        [5, 1, 2, 3, 4, 5, 6, 7, 8],  # 9: another first block, nothing (a chain, not a set)
    ]
    assert ideal_hits(prompts, 4) == [0, 8, 4, 8, 4, 0]
    assert ideal_hit_rate(prompts, 4) == pytest.approx(24 / 60)
    assert ideal_hit_rate([], 4) == 0.0
    assert ideal_hit_rate(prompts, 16) == 0.0  # no prompt has a full block of 16 to reuse
    # with replies: prompt 1's reply fills block [8-11] (its last token has no KV): prompt 2
    # hits all its 3 blocks
    replies = [[10, 11, 50, 51], [], [], [], [], []]
    assert ideal_hits(prompts, 4, replies)[:2] == [0, 12]
    assert ideal_hits(prompts[:2], 4, [[10, 11], []]) == [0, 8]  # 10 + 1 tokens: [8-11] not full


# -- the dataset -----------------------------------------------------------------------------------


def test_conversations_are_seeded_and_shaped():
    spec = MTSpec(conversations=12, turns=4, system_len=40, families=3, user_len=9, think_s=0.5,
                  stagger_s=0.2)  # fmt: skip
    a, b = make_conversations(spec, 7), make_conversations(spec, 7)
    assert a == b
    other = make_conversations(spec, 8)
    assert [c.users for c in a] != [c.users for c in other]
    assert len(a) == 12 and all(len(c.users) == 4 and len(c.thinks) == 3 for c in a)
    assert [c.start_s for c in a] == pytest.approx([0.2 * i for i in range(12)])
    for c in a:
        assert c.system[0] == BOS and len(c.system) == 41
        assert all(len(u) == 9 and all(32 <= t < 127 for t in u) for u in c.users)
    # one system prompt per family, shared; 3 families round robin: 4 conversations each
    systems = {c.family: c.system for c in a}
    assert len(set(systems.values())) == 3
    assert all(c.system == systems[c.family] for c in a)
    assert np.bincount([c.family for c in a]).tolist() == [4, 4, 4]
    # users differ between conversations and turns
    assert len({u for c in a for u in c.users}) == 12 * 4
    # skewed: family 0 takes half
    skew = make_conversations(replace(spec, skew=True), 7)
    assert np.bincount([c.family for c in skew]).tolist() == [6, 3, 3]
    # think times: exponential of the given mean
    many = make_conversations(MTSpec(conversations=400, turns=6, think_s=0.5), 1)
    thinks = np.array([t for c in many for t in c.thinks])
    assert thinks.min() >= 0 and thinks.mean() == pytest.approx(0.5, rel=0.1)
    assert MTSpec(system_len=256, turns=6, user_len=48, output_len=32).max_context == 737


class ScriptedClient:
    """Replies to a token-id prompt with ids derived from it (non-byte ids among them, which a
    text round trip would lose); turn `fail_at` (0-based, in send order) fails."""

    def __init__(self, output_len: int, fail_at: int | None = None):
        self.output_len, self.fail_at = output_len, fail_at
        self.prompts: list[list[int]] = []

    @staticmethod
    def reply(prompt: list[int], n: int) -> list[int]:
        return [EOS if i == 0 else (sum(prompt) + i) % 300 for i in range(n)]

    async def send(self, req, bar=None, ignore_eos=None, ids=None) -> RequestResult:
        assert ignore_eos is True and req.max_tokens == self.output_len
        k = len(self.prompts)
        self.prompts.append(list(req.token_ids))
        await asyncio.sleep(0.001)
        bar.finished()
        if k == self.fail_at:
            return RequestResult(error="HTTP 500: boom")
        ids.extend(self.reply(list(req.token_ids), self.output_len))
        return RequestResult(ok=True, prompt_len=len(req.token_ids),
                             output_tokens=self.output_len, ttft=0.01, latency=0.02)  # fmt: skip


def _play(run: MultiTurnRun, client: ScriptedClient):
    bar = Bar("t", run.num_requests, False)
    return asyncio.run(run(client, bar))


def test_history_carries_the_servers_own_reply_ids():
    spec = MTSpec(conversations=3, turns=3, system_len=20, user_len=5, output_len=4,
                  think_s=0.0, stagger_s=0.0)  # fmt: skip
    run = MultiTurnRun(spec, seed=3)
    client = ScriptedClient(4)
    results, duration, _ = _play(run, client)
    assert all(r.ok for r in results) and len(results) == 9 and duration > 0
    assert len(run.trace) == 9 == len(client.prompts)
    for conv in run.convs:
        mine = [p for p in client.prompts if p[: len(conv.system) + 5] ==
                [*conv.system, *conv.users[0]]]  # fmt: skip
        assert len(mine) == 3  # its three turns, in order
        expect = [*conv.system, *conv.users[0]]
        for t in range(3):
            assert mine[t] == expect
            if t < 2:
                expect = expect + client.reply(expect, 4) + list(conv.users[t + 1])
    # the trace keeps each prompt with the reply ids the client saw
    for prompt, reply in run.trace:
        assert reply == client.reply(prompt, 4)
    f = run.figures(4, results)
    assert f["ideal_hit_rate"] == pytest.approx(ideal_hit_rate([p for p, _ in run.trace], 4))
    assert 0 < f["ideal_hit_rate"] < f["ideal_hit_rate_replies"] < 1
    assert f["mt_conversations"] == 3 and len(f["median_ttft_ms_by_turn"]) == 3


def test_a_failed_turn_ends_its_conversation():
    spec = MTSpec(conversations=1, turns=4, system_len=8, user_len=3, output_len=2,
                  think_s=0.0, stagger_s=0.0)  # fmt: skip
    run = MultiTurnRun(spec, seed=0)
    results, _, _ = _play(run, ScriptedClient(2, fail_at=1))
    assert [r.ok for r in results] == [True, False, False, False]
    assert results[1].error == "HTTP 500: boom"
    assert results[2].error == "turn 2 failed: HTTP 500: boom"
    assert len(run.trace) == 2


# -- /metrics figures and the bars -----------------------------------------------------------------


def _snap(rows: dict[tuple[str, str], float]) -> dict:
    text = "# TYPE xpod_prompt_tokens_by_source counter\n" + "".join(
        f'xpod_prompt_tokens_by_source_total{{group="{g}",source="{s}"}} {v}\n'
        for (g, s), v in rows.items()
    )
    return parse_prometheus(text)


def test_load_figures_per_group():
    s0 = _snap({("0", "local"): 10, ("0", "computed"): 100, ("1", "computed"): 50,
                ("1", "pool"): 0})  # fmt: skip
    s1 = _snap({("0", "local"): 110, ("0", "computed"): 300, ("1", "computed"): 150,
                ("1", "pool"): 100, ("2", "computed"): 0})  # fmt: skip
    f = load_figures(s0, s1)
    assert f["prompt_tokens_by_group"] == [300, 200, 0]
    assert f["computed_tokens_by_group"] == [200, 100, 0]
    assert f["load_imbalance"] == pytest.approx(300 / (500 / 3))
    assert f["computed_imbalance"] == pytest.approx(200 / 100)
    # a counter that went down (a restarted master) counts from 0
    reset = load_figures(s1, _snap({("0", "computed"): 40, ("1", "computed"): 160}))
    assert reset["prompt_tokens_by_group"] == [40, 10]
    assert load_figures(s0, {}) == {} and load_figures(None, None) == {}
    assert f["engine_restarts"] == 0
    gen = parse_prometheus("# TYPE xpod_engine_incarnation gauge\nxpod_engine_incarnation 1\n")
    assert load_figures(s0, {**s1, **gen})["engine_restarts"] == 1  # a restart in between


def _layout(ttft: float, tput: float, hit: float, ideal: float, imb: float) -> dict:
    return {"median_ttft_ms": ttft, "output_throughput": tput, "hit_rate": hit,
            "ideal_hit_rate": ideal, "load_imbalance": imb}  # fmt: skip


def test_bars_are_evaluated():
    layouts = {"local": _layout(100, 500, 0.3, 0.8, 1.1), "pool": _layout(70, 495, 0.75, 0.8, 1.25)}
    b = evaluate_bars(layouts)
    assert b["pool_hit_over_ideal"]["value"] == pytest.approx(0.9375)
    assert b["pool_hit_over_ideal"]["ok"] is True
    assert b["pool_ttft_p50_over_local"]["ok"] is True  # 0.7
    assert b["pool_throughput_over_local"]["ok"] is True  # 0.99
    assert b["pool_imbalance_over_local"]["ok"] is False  # 1.25 / 1.1 = 1.14 > 1.1
    assert b["pool_imbalance_over_local"]["value"] == pytest.approx(1.25 / 1.1)
    layouts["pool"] = _layout(90, 400, 0.5, 0.8, 1.0)
    b = evaluate_bars(layouts)
    assert [b[k]["ok"] for k in b] == [False, False, False, True]
    only_pool = evaluate_bars({"pool": layouts["pool"]})
    assert only_pool["pool_hit_over_ideal"]["ok"] is False
    assert only_pool["pool_ttft_p50_over_local"] == {
        "what": "pool TTFT p50 / local's", "value": None, "bar": "<= 0.8", "ok": None}  # fmt: skip


def test_rounds_give_medians_without_restarted_runs():
    def rnd(local_ttft: float, pool_ttft: float, restarts: int = 0) -> dict:
        local = _layout(local_ttft, 500, 0.6, 0.8, 1.0)
        pool = _layout(pool_ttft, 500, 0.8, 0.8, 1.0)
        local.update(engine_restarts=0, prompt_tokens_by_group=[1, 2], failed=0, completed=10)
        pool.update(engine_restarts=restarts, prompt_tokens_by_group=[3, 4], failed=1, completed=9)
        return {"local": local, "pool": pool}

    # the machine slowed down in round 2 (both layouts): the ratio holds; round 3 restarted
    rounds = [rnd(100, 50), rnd(300, 180), rnd(100, 400, restarts=1)]
    b = round_bars(rounds)["pool_ttft_p50_over_local"]
    assert b["values"] == pytest.approx([0.5, 0.6, 4.0])
    assert b["value"] == pytest.approx(0.55) and b["ok"] is True and b["clean"] is True
    lay = median_layouts(rounds)
    assert lay["local"]["median_ttft_ms"] == 100  # median of 100, 300, 100
    assert lay["pool"]["median_ttft_ms"] == pytest.approx(115)  # the restarted round left out
    assert lay["pool"]["prompt_tokens_by_group"] == [3, 4]
    assert (lay["pool"]["failed"], lay["pool"]["completed"]) == (3, 27)  # sums over rounds
    assert lay["pool"]["engine_restarts"] == 1 and lay["local"]["engine_restarts"] == 0
    # every round restarted: the median of them all, said
    b = round_bars([rnd(100, 50, 1), rnd(100, 70, 2)])["pool_ttft_p50_over_local"]
    assert b["value"] == pytest.approx(0.6) and b["clean"] is False


# -- flags -----------------------------------------------------------------------------------------


def _opts(*argv: str):
    return bs.parse_options(cli.build_parser().parse_args(["bench", "serve", *argv]))


def test_layouts_get_their_own_flags():
    pool_args = "--pool-dram-mib 48 --async-depth 1"
    o = _opts("--launch", "--dies", "4", "--dataset", "multi-turn", "--compare-pool",
              "local,affinity,pool", "--server-args", pool_args)  # fmt: skip
    layouts = dict(o.compare_pool)
    assert list(layouts) == ["local", "affinity", "pool"]
    for name, lb in (("local", "least_kv"), ("affinity", "prefix"), ("pool", "least_kv")):
        argv = layouts[name]
        assert argv.count("--lb") == 1 and argv[argv.index("--lb") + 1] == lb
        assert ("--kv-pool" in argv) == (name == "pool")
        assert ("--pool-dram-mib" in argv) == (name == "pool")
        assert "--async-depth" in argv
    # the defaults' conversation (737 tokens) does not fit the small model's 512: said, given
    assert "--max-seq-len" in layouts["local"] and o.max_model_len == 768
    assert any("--max-seq-len 768" in n for n in o.notes)
    assert o.mt == MTSpec() and o.num_prompts == 192 and o.block_size == 16
    assert o.ttft is False  # multi-turn: off unless asked
    assert o.server_argv == layouts["local"]
    res = compare_pool_result(
        o,
        {"dataset": "multi-turn"},
        [{"local": {"failed": 0, "hit_rate": 0.5}, "pool": {"failed": 1, "hit_rate": 0.75}}],
    )
    assert set(res["layouts"]["pool"]) >= {
        "completed",
        "failed",
        "output_throughput",
        "median_ttft_ms",
        "p99_ttft_ms",
        "hit_rate",
        "pool_hit_rate",
        "ideal_hit_rate",
        "load_imbalance",
    }
    assert res["failed"] == 1 and res["reported"]["pool_hit_rate_over_local"] == 1.5
    q = _opts("--launch", "--model", "tiny", "--dataset", "multi_turn", "--quick",
              "--mt-system-prompts", "2", "--mt-skew", "--random-output-len", "6")  # fmt: skip
    assert (q.mt.conversations, q.mt.turns, q.mt.output_len, q.mt.skew) == (4, 3, 6, True)
    assert "--max-seq-len" not in q.server_argv and q.compare_pool == ()


@pytest.fixture
def nothing_starts(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("a bad flag must be refused before anything starts")

    monkeypatch.setattr(subprocess, "Popen", refuse)
    monkeypatch.setattr(bs, "run", refuse)


MT = ["--dataset", "multi-turn"]
BAD = [
    (["--launch", "--mt-turns", "3"], "--mt-turns"),
    (["--launch", "--compare-pool", "local,pool"], "--compare-pool"),
    (["--url", "http://127.0.0.1:1", *MT, "--compare-pool", "local"], "--compare-pool"),
    (["--launch", *MT, "--compare-pool", "local,bogus"], "--compare-pool"),
    (["--launch", *MT, "--compare-pool", "pool,pool"], "--compare-pool"),
    (["--launch", *MT, "--endpoint", "chat"], "--endpoint"),
    (["--launch", *MT, "--request-rate", "5"], "--request-rate"),
    (["--launch", *MT, "--rate-sweep", "0.5,1"], "--rate-sweep"),
    (["--launch", *MT, "--repeat", "3"], "--repeat"),  # (with --compare-pool: rounds)
    (["--launch", *MT, "--mt-skew"], "--mt-skew"),
    (["--launch", *MT, "--compare-pool", "local,pool", "--lb", "round_robin"], "--lb"),
    (["--launch", *MT, "--compare-pool", "pool", "--server-args=--kv-pool"], "--kv-pool"),
    (["--launch", *MT, "--compare-pool", "pool", "--server-args", "--lb prefix"], "--lb"),
    (["--launch", *MT, "--server-args", "--max-seq-len 512"], "--max-seq-len"),
    (["--launch", *MT, "--mt-think-time", "-1"], "--mt-think-time"),
]


@pytest.mark.parametrize(("argv", "flag"), BAD)
def test_bad_flag_is_one_line_with_status_2(argv, flag, capsys, nothing_starts):
    with pytest.raises(SystemExit) as exc:
        raise SystemExit(cli.main(["bench", "serve", *argv]))
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("xpod bench serve: error:"), err
    assert flag in err, err
