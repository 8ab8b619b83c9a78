"""MTP in the serving engine: every request's tokens equal the run without MTP (batch-invariant,
greedy and seeded, any draft) over a workload with chunked prefill, prefix hits, preemption,
stop tokens and requests ending inside a verify row; the schedule replay is bit-equal in
default mode (tokens, every verify row's logits, the drafts); oracle drafts are all accepted;
the counters add up; a die killed mid-verify recovers with the same output; bad configs are
refused."""

from __future__ import annotations

import numpy as np
import pytest

from memory.errors import ConfigError
from runtime.cli.main import main
from runtime.engine import Engine, EngineConfig
from runtime.engine.replay import replay_engine
from runtime.engine.spec_stats import spec_summary
from runtime.model.mtp import SpecConfig
from sched import SamplingParams

BI = {"batch_invariant": True}


def workload(n: int = 32, tokens: int = 48) -> tuple[list[list[int]], list[SamplingParams]]:
    """Prompts sharing prefixes (prefix hits), long ones (chunked prefill), greedy and seeded
    (temperature 0.8) requests, some stopping on a common token, max_tokens that end inside a
    verify row."""
    rng = np.random.default_rng(11)
    shared = [256] + rng.integers(97, 123, 40).tolist()
    prompts, params = [], []
    for i in range(n):
        if i % 3 == 0:
            p = shared[: 17 + i % 24] + rng.integers(97, 123, 3).tolist()  # prefix hits
        else:
            p = [256] + rng.integers(32, 127, 4 + (i * 7) % 37).tolist()
        prompts.append(p)
        stop = (101,) if i % 5 == 0 else ()
        params.append(SamplingParams(max_tokens=tokens - (i % 3), temperature=0.8 if i % 2 else 0,
                                     seed=1000 + i, stop_token_ids=stop,
                                     ignore_eos=True))  # fmt: skip
    return prompts, params


def config(spec: SpecConfig | None, **kw) -> EngineConfig:
    # a small KV pool (preemptions) and token budget (chunked prefill)
    base = dict(dies=2, model="tiny", model_overrides=BI, max_num_seqs=6,
                max_num_batched_tokens=24, num_blocks=40, block_size=8, async_depth=1,
                speculative=spec)  # fmt: skip
    base.update(kw)
    return EngineConfig(**base)


@pytest.fixture(scope="module")
def baseline():
    prompts, params = workload()
    with Engine.launch(config(None)) as eng:
        outs = eng.generate(prompts, params, timeout_s=240)
        pre = sum(s.get("num_preemptions", 0) for s in eng.stats.values() if s)
        hits = sum(s.get("prefix_hit_tokens", 0) for s in eng.stats.values() if s)
    assert pre > 0 and hits > 0  # the workload preempts and hits the prefix cache
    assert any(o.finish_reason == "stop" for o in outs)
    return prompts, params, [o.token_ids for o in outs]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("k", "draft"), [(1, "real"), (2, "fit"), (1, "oracle"),
                                          (2, "synthetic:0.5")])  # fmt: skip
def test_mtp_serves_the_tokens_of_the_run_without(baseline, k, draft):
    prompts, params, want = baseline
    name, _, rate = draft.partition(":")
    spec = SpecConfig(k, name, (float(rate),) if rate else ())
    # the transcript of the run without MTP: the tokens each request emits (a longer one is
    # not needed: a stopped request's drafts past its stop are never verified)
    with Engine.launch(config(spec)) as eng:
        outs = eng.generate(prompts, params, timeout_s=240,
                            transcripts=want if spec.transcript else None)  # fmt: skip
        stats = spec_summary(eng.stats, spec)
    got = [o.token_ids for o in outs]
    bad = [i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b]
    assert not bad, f"requests {bad} differ from the run without MTP"
    assert stats["num_drafts"] > 0 and stats["num_draft_tokens"] >= stats["num_drafts"]
    if name == "oracle":
        assert stats["acceptance_rate"] == 1.0
    assert all(len(o.token_ids) <= p.max_tokens for o, p in zip(outs, params, strict=True))


@pytest.mark.timeout(300)
def test_the_schedule_replay_is_bit_equal_in_default_mode():
    prompts, params = workload(12, 32)
    spec = SpecConfig(2, "fit")
    cfg = config(spec, model_overrides={}, log_steps=True, keep_logits=True)
    with Engine.launch(cfg) as eng:
        eng.generate(prompts, params, timeout_s=240)
    rep = replay_engine(cfg, eng.step_log)
    assert rep.bit_equal, (rep.token_mismatches[:3], rep.logit_mismatches[:3],
                           rep.draft_mismatches[:3])  # fmt: skip
    assert rep.drafts_compared > 0 and rep.logits_compared > rep.sampled  # verify rows: 1 + k


@pytest.mark.timeout(300)
def test_a_die_killed_mid_verify_recovers_with_the_same_tokens(baseline):
    prompts, params, want = baseline
    spec = SpecConfig(1, "fit")
    with Engine.launch(config(spec, inject="kill:die=1,step=30")) as eng:
        outs = eng.generate(prompts, params, timeout_s=240)
        rel = eng.reliability()
    assert rel["counts"]["injected"] and rel["counts"]["recovered"]
    assert [o.token_ids for o in outs] == want


def test_bad_speculative_engines_are_refused():
    with pytest.raises(ConfigError, match="EPLB"):
        from runtime.model import EPLBConfig

        EngineConfig(dies=2, model="tiny", eplb=EPLBConfig(), speculative=SpecConfig(1))
    assert EngineConfig(dies=2, model="tiny", speculative=SpecConfig(1)).async_depth == 1


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--num-speculative-tokens", "3"], "second MTP module"),
        (["--num-speculative-tokens", "1", "--mtp-draft", "oracle"], "benchmarks only"),
        (["--speculative-config", '{"num_speculative_tokens": 1, "draft": "x"}'], "not one of"),
    ],
)  # fmt: skip
def test_generate_and_serve_refuse_bad_speculative_flags(flags, message, capsys):
    for cmd in ("generate", "serve"):
        extra = ["--prompt", "x"] if cmd == "generate" else []
        assert main([cmd, "--model", "tiny", *extra, *flags]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err
