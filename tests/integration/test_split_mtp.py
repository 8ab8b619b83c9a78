"""MTP on a split pod (MoE-attention disaggregation): the attention dies run the MTP module's
attention and gate, the expert dies its experts through A2E / E2A at event slots after the main
layers. Every request's tokens equal the same split pod's without MTP (batch-invariant, greedy
and seeded, 2 domains, chunked prefill, prefix hits, a preemption); the schedule replay through
`SplitReference` is bit-equal in default mode (tokens, every verify row's logits, the drafts);
oracle drafts are all accepted; the expert dies served the main layers' and the k sub-forwards'
calls of every step; a killed expert die (restart) and a link error in the MTP layer's E2A
(iteration rollback) keep the tokens; `xpod decode` on a split pod equals its reference's
speculative schedule."""

from __future__ import annotations

import json

import numpy as np
import pytest

from memory import layout as L
from runtime.cli.main import main
from runtime.engine import Engine, EngineConfig
from runtime.engine.replay import replay_engine
from runtime.engine.spec_stats import spec_summary
from runtime.model.mtp import SpecConfig
from sched import SamplingParams
from tests.waiting import wait_for

BI = {"batch_invariant": True}
MOE_LAYERS = 2  # tiny: 3 layers, the first dense


def workload(n: int = 32, tokens: int = 48) -> tuple[list[list[int]], list[SamplingParams]]:
    """Prompts sharing a prefix (prefix hits), long ones (chunked prefill: the budget is 24),
    greedy and seeded (temperature 0.8) requests, max_tokens ending inside a verify row."""
    rng = np.random.default_rng(5)
    shared = [256] + rng.integers(97, 123, 36).tolist()
    prompts, params = [], []
    for i in range(n):
        if i % 3 == 0:
            p = shared[: 17 + i % 20] + rng.integers(97, 123, 3).tolist()
        else:
            p = [256] + rng.integers(32, 127, 4 + (i * 7) % 33).tolist()
        prompts.append(p)
        params.append(SamplingParams(max_tokens=tokens - (i % 3), temperature=0.8 if i % 2 else 0,
                                     seed=300 + i, ignore_eos=True))  # fmt: skip
    return prompts, params


def config(spec: SpecConfig | None, **kw) -> EngineConfig:
    # 2 attention dies in 2 domains, 2 expert dies; a small KV pool (preemptions) and token
    # budget (chunked prefill)
    base = dict(dies=2, expert_dies=2, domains=2, model="tiny", model_overrides=BI,
                max_num_seqs=6, max_num_batched_tokens=24, num_blocks=34, block_size=8,
                async_depth=1, timeout_s=30.0, speculative=spec)  # fmt: skip
    base.update(kw)
    return EngineConfig(**base)


def spec_of(k: int, draft: str) -> SpecConfig:
    name, _, rate = draft.partition(":")
    return SpecConfig(k, name, (float(rate),) if rate else ())


@pytest.fixture(scope="module")
def baseline():
    prompts, params = workload()
    with Engine.launch(config(None)) as eng:
        outs = eng.generate(prompts, params, timeout_s=240)
        pre = sum(s.get("num_preemptions", 0) for s in eng.stats.values() if s)
        hits = sum(s.get("prefix_hit_tokens", 0) for s in eng.stats.values() if s)
    assert pre > 0 and hits > 0  # the workload preempts and hits the prefix cache
    return prompts, params, [o.token_ids for o in outs]


def run(k: int, draft: str, baseline) -> tuple[list[list[int]], dict, dict]:
    """(tokens, the spec_decode figures, the split pod's counters) of the workload with MTP."""
    prompts, params, want = baseline
    spec = spec_of(k, draft)
    with Engine.launch(config(spec)) as eng:
        outs = eng.generate(prompts, params, timeout_s=240,
                            transcripts=want if spec.transcript else None)  # fmt: skip
        stats = spec_summary(eng.stats, spec)
        # the last result may come before the expert dies end another domain's last call:
        # their counters are read once every die parked (a state that stays: no more work)
        park = L.PROGRESS_STATES.index("park")
        wait_for(lambda: all(L.unpack_progress(w)[3] == park for w in eng.progress_words()
                             or [0]), what="every die to park")  # fmt: skip
        split = eng.split_stats()
    return [o.token_ids for o in outs], stats, split


def check_calls(split: dict, k: int) -> None:
    """Every expert die served the same calls, a whole number of steps of (MoE layers + k
    sub-forwards) x domains x micro-batches: the expert loop stayed in lockstep."""
    calls = set(split["expert_a2e_calls"].values())
    per_step = (MOE_LAYERS + k) * split["domains"] * split["microbatches"]
    assert len(calls) == 1 and calls.pop() % per_step == 0, (split["expert_a2e_calls"], per_step)


@pytest.mark.timeout(300)
# k 1 and 2, fit and synthetic drafts (oracle: below): the split pod runs the same calls
# whatever the drafts (oracle and synthetic replace the argmax of an MTP forward that still runs
# all k sub-forwards), so (2, fit) is (2, synthetic)'s path with other drafts (its tokens: the
# two recovery tests run it) and (1, synthetic) is (1, fit)'s
@pytest.mark.parametrize(("k", "draft"), [(1, "fit"), (2, "synthetic:0.5")])
def test_split_mtp_serves_the_tokens_of_the_run_without(baseline, k, draft):
    got, stats, split = run(k, draft, baseline)
    want = baseline[2]
    bad = [i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b]
    assert not bad, f"requests {bad} differ from the split pod without MTP"
    assert stats["num_drafts"] > 0 and stats["num_draft_tokens"] >= stats["num_drafts"]
    assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"], stats
    check_calls(split, k)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("k", [1, 2])
def test_split_mtp_oracle_drafts_are_all_accepted(baseline, k):
    got, stats, split = run(k, "oracle", baseline)
    assert got == baseline[2]
    assert stats["num_draft_tokens"] > stats["num_drafts"] * (k - 1) > -1, stats
    assert stats["acceptance_rate"] == 1.0, stats
    assert stats["num_accepted_tokens"] == stats["num_draft_tokens"]
    check_calls(split, k)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("plan", "how"), [("kill:die=3,step=30", "restart"),
                                           ("err:die=0,step=30,layer=3,phase=combine",
                                            "rollback")])  # fmt: skip
def test_split_mtp_recovers_with_the_same_tokens(baseline, plan, how):
    """An expert die killed (the loop restarts from scratch, its cycle too), a link error in
    the E2A of the MTP layer (layer 3 of tiny) rolls the step back: the same tokens."""
    prompts, params, want = baseline
    with Engine.launch(config(SpecConfig(2, "fit"), inject=plan)) as eng:
        outs = eng.generate(prompts, params, timeout_s=240)
        rel = eng.reliability()
    assert rel["counts"]["injected"] and rel["counts"]["recovered"].get(how), rel["counts"]
    assert [o.token_ids for o in outs] == want


@pytest.mark.timeout(300)
def test_split_mtp_schedule_replay_is_bit_equal_in_default_mode():
    prompts, params = workload(10, 24)
    spec = SpecConfig(2, "fit")
    cfg = config(spec, model_overrides={}, microbatches=2, log_steps=True, keep_logits=True)
    with Engine.launch(cfg) as eng:
        outs = eng.generate(prompts, params, timeout_s=240)
    assert all(o.finish_reason == "length" for o in outs)
    rep = replay_engine(cfg, eng.step_log)
    assert rep.bit_equal, (rep.token_mismatches[:3], rep.logit_mismatches[:3],
                           rep.draft_mismatches[:3])  # fmt: skip
    assert rep.drafts_compared > 0 and rep.logits_compared > rep.sampled  # verify rows: 1 + k


@pytest.mark.timeout(300)
@pytest.mark.parametrize("flags", [["--num-speculative-tokens", "1", "--domains", "2"],
                                   ["--num-speculative-tokens", "2", "--mtp-draft", "oracle",
                                    "--microbatches", "2", "--temperature", "0.8"]])  # fmt: skip
def test_split_decode_with_mtp_equals_its_reference(tmp_path, flags):
    out = tmp_path / "d.jsonl"
    argv = ["decode", "--dies", "4", "--attention-dies", "2", "--expert-dies", "2", "--batch",
            "4", "--prompt-len", "12", "--steps", "6", "--model", "tiny", "--batch-invariant",
            "--check", "--json", str(out), *flags]  # fmt: skip
    assert main(argv) == 0
    s = json.loads(out.read_text().splitlines()[-1])
    assert s["layout"] == "split" and (s["attention_dies"], s["expert_dies"]) == (2, 2)
    assert s["replay_bit_equal"] and s["mismatched_tokens"] == 0 and s["logits_bit_equal"], s
    assert s["tokens_identical"] is True
    k = s["spec_tokens"]
    assert s["num_drafts"] == 4 * 6 and s["num_draft_tokens"] == 4 * 6 * k
    if "oracle" in flags:
        assert s["acceptance_rate"] == 1.0 and s["mean_acceptance_length"] == 1 + k
