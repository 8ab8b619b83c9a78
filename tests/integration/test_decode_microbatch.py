"""Colocated decode in two micro-batches (runtime.model.pipeline, `xpod decode --microbatches 2`):
bit-equal to one micro-batch in batch-invariant mode, `--check` against the micro-batched
reference in the default mode, and a capture pod's ops on streams s0 / s1 whose projection
overlaps one micro-batch's attention with the other's MoE."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from memory.errors import ConfigError
from runtime.decode import DecodeOptions, run_decode
from runtime.decode.run import DecodeSpec, decode_main, make_prompts, pod_config, spread
from runtime.model import ModelConfig
from runtime.model.card import CARDS, apply_card
from runtime.model.forward import prepared_for_fork
from runtime.pod import Pod
from runtime.pod.capture import write_capture
from runtime.project import load_capture, load_profile, replay

S0_OPS = {"embed", "mla_prolog", "mla", "o_proj", "norms", "lm_head", "sample"}
S1_OPS = {"gate", "experts", "shared_expert", "dense_ffn"}


def pod_run(cfg: ModelConfig, dies: int, batch: int, m: int, steps: int = 4,
            capture: str | None = None, temperature: float = 0.0) -> list[dict]:  # fmt: skip
    """Every die's decode_main result for `m` micro-batches (a capture pod: written to
    `capture`)."""
    opts = DecodeOptions(dies=dies, batch=batch, prompt_len=5, steps=steps, model="tiny",
                         microbatches=m, timeout_s=60)  # fmt: skip
    per_die, ids = spread(make_prompts(batch, 5, 3), dies)
    spec = DecodeSpec(cfg, per_die, ids, steps, temperature=temperature, seed=3,
                      microbatches=m)  # fmt: skip
    pc = pod_config(cfg, per_die, opts).replace(trace=False, capture=capture is not None)
    with prepared_for_fork(cfg):
        cm = Pod.launch(pc)
    with cm as pod:
        res = pod.run(decode_main, spec)
        if capture is not None:
            write_capture(pod, capture, {"bench": "decode", "microbatches": m},
                          ["dispatch", "combine"])  # fmt: skip
    return res


@pytest.mark.timeout(180)
@pytest.mark.parametrize("dies, batch, temperature", [(4, 7, 0.0), (4, 3, 0.8)])
def test_two_micro_batches_equal_one_bit_for_bit_in_batch_invariant_mode(dies, batch, temperature):
    # 7 requests: 2, 2, 2, 1 per die (die 3's micro-batch 1 is empty); 3: die 3 has none
    cfg = ModelConfig.preset("tiny", batch_invariant=True, seed=3)
    one = pod_run(cfg, dies, batch, 1, temperature=temperature)
    two = pod_run(cfg, dies, batch, 2, temperature=temperature)
    for a, b in zip(one, two, strict=True):
        assert a["tokens"] == b["tokens"]
        assert len(a["logits"]) == len(b["logits"]) == 5
        for x, y in zip(a["logits"], b["logits"], strict=True):
            assert np.array_equal(x, y)


@pytest.mark.timeout(180)
def test_check_compares_with_the_micro_batched_reference():
    s = run_decode(DecodeOptions(dies=4, batch=9, prompt_len=6, steps=5, model="tiny",
                                 microbatches=2, check=True, timeout_s=60,
                                 overrides={"seed": 1}))  # fmt: skip
    assert s["microbatches"] == 2
    assert s["mismatched_tokens"] == 0 and s["total_tokens"] == 9 * 6
    assert s["logits_bit_equal"], s["logits_max_abs_diff"]
    for bad in ({"eplb": "on"}, {"microbatches": 3}):
        opts = DecodeOptions(dies=4, batch=4, steps=2, model="tiny", microbatches=2)
        with pytest.raises(ConfigError, match="microbatches"):
            run_decode(dataclasses.replace(opts, **bad))


@pytest.mark.timeout(180)
def test_a_capture_puts_attention_on_s0_and_moe_on_s1_and_the_projection_overlaps_them(tmp_path):
    cfg = ModelConfig.preset("tiny", batch_invariant=True, seed=3)
    path = tmp_path / "cap"
    pod_run(cfg, 4, 8, 2, steps=2, capture=str(path))
    cap = load_capture(path)
    for d in range(cap.num_dies):  # DeepSeek-V3's sizes (cm384 has no BF16 GEMM efficiency)
        cap.events[d] = apply_card(cap.events[d], CARDS["deepseek-v3"], context=4096)
    res = replay(cap, load_profile("cm384"))
    g = res.graph
    for d in range(cap.num_dies):
        names = cap.streams[d]
        assert set(names) == {"main", "s0", "s1", "a2a"}
        ops = {n: {e[4] for e in cap.events[d] if e[0] == "op" and names[e[1]] == n}
               for n in names}  # fmt: skip
        assert ops["s0"] == S0_OPS and ops["s1"] == S1_OPS and not ops["main"]
        calls = [e[5] for e in cap.events[d] if e[0] == "begin" and e[4] == "dispatch"]
        # both micro-batches' dispatch at every MoE layer of every step, each id once
        assert len(calls) == len(set(calls)) == 3 * 2 * (cfg.n_layers - cfg.n_dense_layers)
    # in projected time, some attention op of s0 runs while an op of s1 runs (the overlap)
    lo, hi = g.die_start[0], g.die_start[1]
    s0, s1 = cap.streams[0].index("s0"), cap.streams[0].index("s1")
    spans = {s0: [], s1: []}
    for x in range(lo, hi):
        _, s, _ = g.locate(x)
        if s in spans and g.kind[x] == 4 and g.cost[x] > 0:
            spans[s].append((res.finish[x] - g.cost[x], res.finish[x]))
    assert any(a0 < b1 and b0 < a1 for a0, a1 in spans[s0] for b0, b1 in spans[s1])
