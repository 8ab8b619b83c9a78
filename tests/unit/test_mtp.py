"""Multi-token prediction (runtime.model.mtp, mtp_fit): the acceptance rule, the speculative
config, the draft modes, and the speculative schedule on the single-process reference: the
emitted tokens are the model's (identical to the run without MTP under batch invariance,
greedy and seeded), oracle drafts are all accepted, synthetic ones at their rate, and rejected
rows leave no trace in the KV rows."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from memory.errors import ConfigError
from runtime.decode.run import spread
from runtime.model import ModelConfig, ReferencePod
from runtime.model.mtp import (
    SpecConfig,
    SpecRow,
    accept,
    reference_decode,
    spec_config,
    spec_step,
    stats,
    transcript_draft,
)
from runtime.model.sampler import sample_rows

TINY = ModelConfig.preset("tiny", mtp_layers=1, batch_invariant=True)


def prompts_of(n: int, dies: int, length: int = 6) -> tuple[list, list]:
    rng = np.random.default_rng(5)
    return spread([[256] + rng.integers(97, 123, length - 1).tolist() for _ in range(n)], dies)


def decode(cfg: ModelConfig, spec: SpecConfig, steps: int, temperature: float = 0.0,
           transcripts=None, n: int = 6, dies: int = 2, keep_logits: bool = False):  # fmt: skip
    per, ids = prompts_of(n, dies)
    pod = ReferencePod(cfg, dies)
    streams = reference_decode(pod, per, ids, steps, spec, temperature, 3, transcripts,
                               keep_logits)  # fmt: skip
    return pod, [s for d in streams for s in d]


def transcript(cfg: ModelConfig, steps: int, temperature: float = 0.0, n: int = 6) -> dict:
    _, off = decode(dataclasses.replace(cfg, mtp_fit=False), SpecConfig(0, "real"), steps,
                    temperature, n=n)  # fmt: skip
    return {s.rid: s.tokens for s in off}


# -- the rule and the config -----------------------------------------------------------------


def test_accept_counts_the_leading_matches():
    assert accept([5, 6], [5, 6, 9]) == 2
    assert accept([5, 6], [5, 7, 9]) == 1
    assert accept([4, 6], [5, 6, 9]) == 0
    assert accept([], [3]) == 0


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_verify_row_emits_the_sample_whatever_the_draft(temperature):
    # the emitted tokens are sample_rows' at their output indices, for any drafts
    vocab, rng = 40, np.random.default_rng(1)
    logits = rng.standard_normal((3, vocab)).astype(np.float32)
    rows = [{"temperature": temperature, "seed": 9, "index": 10 + j} for j in range(3)]
    want = sample_rows(logits, rows)
    for drafts in ([want[0], want[1]], [want[0], 0], [0, want[1]], [1, 2]):
        row = SpecRow(7, [3, *drafts], 20, drafts=2, index=10, temperature=temperature, seed=9)

        def main(segs, lrows):
            return [logits[lrows[0] - lrows[0][0]]], [np.zeros((3, 0), np.float32)]

        ((out,),) = spec_step(SpecConfig(0, "real"), [[row]], main, None, vocab)
        a = accept(drafts, want)
        assert out.accepted == a and out.emitted == want[: a + 1]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("{}", None, None), "num_speculative_tokens is required"),
        (('{"num_speculative_tokens": 3}', None, None), "second MTP module"),
        ((None, -1, None), "an int >= 0"),
        ((None, 1, "nosuch"), "not one of"),
        ((None, 1, "synthetic:1.5"), "acceptance rates in"),
        ((None, 1, "synthetic:0.9,0.4,0.2"), "acceptance rates in"),
        ((None, None, "fit"), "needs --num-speculative-tokens"),
        (('{"num_speculative_tokens": 1, "x": 2}', None, None), "unknown keys"),
        (('{"num_speculative_tokens": 1, "method": "eagle"}', None, None), "xpod speculates"),
        (("[1]", None, None), "a JSON object"),
        (("{", None, None), "not JSON"),
    ],
)  # fmt: skip
def test_bad_speculative_configs_are_refused(args, message):
    with pytest.raises(ConfigError, match=message):
        spec_config(*args)


def test_speculative_config_forms():
    assert spec_config(None, None, None) is None and spec_config(None, 0, None) is None
    assert spec_config(None, 2, None) == SpecConfig(2, "fit")
    s = spec_config('{"num_speculative_tokens": 2, "draft": "synthetic:0.9,0.4"}')
    assert s.acceptance == (0.9, 0.4) and s.label == "synthetic:0.9,0.4" and s.transcript
    assert spec_config('{"num_speculative_tokens": 1}', 2, "oracle") == SpecConfig(2, "oracle")
    with pytest.raises(ConfigError, match="MTP module"):
        ModelConfig(mtp_layers=2)
    with pytest.raises(ConfigError, match="mtp_fit"):
        ModelConfig(mtp_fit=True)


def test_synthetic_drafts_hit_their_rate_and_never_the_transcript_when_they_miss():
    spec, vocab = SpecConfig(2, "synthetic", (0.9, 0.4)), 300
    row = SpecRow(0, [1], 0, seed=4, transcript=list(range(20000)))
    hits = [[transcript_draft(spec, row, i, j, vocab) == i for i in range(20000)] for j in (0, 1)]
    assert abs(np.mean(hits[0]) - 0.9) < 0.01 and abs(np.mean(hits[1]) - 0.4) < 0.015
    again = [transcript_draft(spec, row, i, 0, vocab) for i in range(50)]
    assert again == [transcript_draft(spec, row, i, 0, vocab) for i in range(50)]  # seeded
    assert transcript_draft(SpecConfig(1, "oracle"), row, 123, 0, vocab) == 123
    # the accounting the rule gives: leading matches of (draft 1, draft 2) per row
    lens = [1 + accept([transcript_draft(spec, row, i + j, j, vocab) for j in (0, 1)],
                       [i, i + 1]) for i in range(0, 8000, 2)]  # fmt: skip
    assert abs(np.mean(lens) - (1 + 0.9 + 0.9 * 0.4)) < 0.03


# -- the speculative schedule on the reference --------------------------------------------------


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("draft", ["real", "fit", "oracle", "synthetic:0.5"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_the_emitted_tokens_are_the_models(k, draft, temperature):
    name, _, rate = draft.partition(":")
    spec = SpecConfig(k, name, (float(rate),) if rate else ())
    cfg = dataclasses.replace(TINY, mtp_fit=name == "fit")
    steps = 10
    tr = transcript(cfg, steps * (1 + k), temperature)
    _, on = decode(cfg, spec, steps, temperature, tr if spec.transcript else None)
    for s in on:
        assert len(s.tokens) >= steps + 1
        assert s.tokens == tr[s.rid][: len(s.tokens)], (s.rid, draft)
    if name == "oracle":
        st = stats(on, spec)
        assert st["acceptance_rate"] == 1.0 and st["mean_acceptance_length"] == 1 + k


def test_rejected_rows_leave_no_trace_in_the_kv_rows():
    # synthetic:0.5 rejects about half the drafts; afterwards every main layer's rows equal a
    # run without MTP, and the MTP layer's rows equal the module run once over the final text
    cfg, steps = TINY, 16
    tr = transcript(cfg, steps * 3)
    pod, on = decode(cfg, SpecConfig(2, "synthetic", (0.5,)), steps, 0.0, tr)
    assert 0 < stats(on, SpecConfig(2, "synthetic", (0.5,)))["acceptance_rate"] < 1
    per, ids = prompts_of(6, 2)
    for d, die in enumerate(pod.dies):
        for s in (x for x in on if x.rid in ids[d]):
            text = s.prompt + s.tokens[:-1]  # positions 0 .. pos - 1 hold these tokens
            ref = ReferencePod(cfg, 1)
            _, normed = ref.step([[(0, text, 0)]], 0, hidden=True)
            for layer in range(cfg.n_layers):
                got = die.kv.get(s.rid, layer)[: len(text)]
                assert np.array_equal(got, ref.dies[0].kv.get(0, layer)), (s.rid, layer)
            ref.mtp(0, [[(0, text[1:] + [s.tokens[-1]], 0)]], [normed[0]])
            mtp = cfg.mtp_layer(0)
            n = len(text)
            assert np.array_equal(die.kv.get(s.rid, mtp)[:n], ref.dies[0].kv.get(0, mtp)[:n])


def test_a_verify_schedule_is_deterministic_and_keeps_its_logits():
    spec = SpecConfig(1, "fit")
    cfg = dataclasses.replace(TINY, batch_invariant=False, mtp_fit=True)
    _, a = decode(cfg, spec, 8, keep_logits=True)
    _, b = decode(cfg, spec, 8, keep_logits=True)
    for x, y in zip(a, b, strict=True):
        assert x.tokens == y.tokens and len(x.logits) == 9
        assert all(np.array_equal(p, q) for p, q in zip(x.logits, y.logits, strict=True))
