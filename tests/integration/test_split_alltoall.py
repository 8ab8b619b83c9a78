"""A2E / E2A over a split pod with DP domains and micro-batches (comm.alltoall.split,
docs/protocols.md §8.2): attention dies of D domains take turns on the expert dies, each domain in
m micro-batches; the expert dies run a loop that learns every call's event id, domain and
micro-batch from the packets (no argument but the split). Every result is compared with
`comm.reference.a2e_ref` / `e2a_ref` over the domain's attention dies, position by position.

Rows name their sender (die, layer, micro-batch); some micro-batches are empty, and at layer 1
the last domain has no work at all.
"""

from __future__ import annotations

import numpy as np
import pytest

import comm
from comm import reference as ref
from comm.alltoall import Split
from comm.routing import Placement
from memory.errors import ConfigError, PeerRefused
from runtime import Pod, PodConfig
from tests.routing_cases import random_topk

H, K, B = 32, 4, 16
LAYERS = 3


def inputs(seed: int, die: int, layer: int, mb: int, m: int, split: Split, e: int):
    rng = np.random.default_rng([seed, die, layer, mb])
    b = int(rng.integers(0, B // m + 1))
    if layer == 1 and die in split.domains[-1]:
        b = 0  # a domain with no work at this layer
    x = (rng.standard_normal((b, H)) + 100 * die + 10 * layer + mb).astype(np.float32)
    idx = random_topk(rng, b, K, e)
    w = rng.random((b, K)).astype(np.float32)
    return x, idx, w


def event(layer: int, d: int, mb: int) -> int:
    return 1000 * layer + 10 * d + mb + 1


def expert_fn(die: int, rows: np.ndarray) -> np.ndarray:
    return (rows * np.float32(1.5 + die) + np.float32(die)).astype(np.float32)


def split_step(die, seed: int, split: Split, e: int, quant, layers: int = LAYERS):
    me, m = die.die_id, split.microbatches
    comm.a2e_align(die, split)
    if me in split.att_dies:
        d = split.domain_of(me)
        outs, writes = [], []
        for layer in range(layers):
            hs = []
            for mb in range(m):
                x, idx, w = inputs(seed, me, layer, mb, m, split, e)
                _, h = comm.a2e(die, x, idx, w, split, quant=quant, event_id=event(layer, d, mb),
                                microbatch=mb, slot_base=mb * (B // m))  # fmt: skip
                hs.append(h)
                writes.append(h.metadata_writes)
            for mb in range(m):
                outs.append(comm.e2a(die, None, hs[mb], event_id=event(layer, d, mb)))
        return {"outs": outs, "writes": writes}
    got = []
    for _ in range(layers * split.cycle):
        res, h = comm.a2e(die, None, None, None, split, quant=quant, event_id=None)
        rows = res.x.astype(np.float32) * res.scales[:, None] if quant == "int8" else res.x
        comm.e2a(die, expert_fn(me, rows), h, event_id=None)
        got.append({"pos": (h.domain, h.microbatch), "event": h.event_id, "x": res.x,
                    "src": res.src_rank, "slot": res.batch_slot, "k": res.k_index,
                    "counts": res.expert_counts})  # fmt: skip
    return got


def check(res, seed: int, split: Split, e: int, quant, combine_dtype: str) -> None:
    m = split.microbatches
    placement = Placement.default(e, split.exp_dies)
    i = 0
    for layer in range(LAYERS):
        for d, dom in enumerate(split.domains):
            for mb in range(m):
                ins = [inputs(seed, a, layer, mb, m, split, e) for a in dom]
                douts = ref.a2e_ref([x for x, _, _ in ins], [idx for _, idx, _ in ins],
                                    placement, list(dom), quant)  # fmt: skip
                for x in split.exp_dies:
                    got, want = res[x][i], douts[x]
                    assert got["pos"] == (d, mb) and got["event"] == event(layer, d, mb), got
                    assert np.array_equal(got["x"], want.x), (layer, d, mb, x)
                    assert np.array_equal(got["src"], want.src_rank)
                    # slots are the die's combine slots: the micro-batch's base plus its row
                    assert np.array_equal(got["slot"], want.batch_slot + mb * (B // m))
                    assert np.array_equal(got["k"], want.k_index)
                    assert np.array_equal(got["counts"], want.expert_counts)
                rows = {x: o.x.astype(np.float32) * o.scales[:, None] if quant == "int8" else o.x
                        for x, o in douts.items()}  # fmt: skip
                eouts = {x: expert_fn(x, rows[x]) for x in douts}
                couts = ref.e2a_ref(eouts, douts, [idx for _, idx, _ in ins],
                                    [w for _, _, w in ins], list(dom), combine_dtype)  # fmt: skip
                for j, a in enumerate(dom):
                    assert np.array_equal(res[a]["outs"][layer * m + mb], couts[j]), (layer, a)
                i += 1
    for a in split.att_dies:
        assert res[a]["writes"] == [1] * (LAYERS * m), "one metadata write per a2e call"


def pod_config(n: int, n_exp: int, e: int, combine_dtype: str = "bfloat16") -> PodConfig:
    return PodConfig(num_dies=n, a2a_max_batch=B, a2a_hidden=H, a2a_topk=K, num_experts=e,
                     a2a_max_local_experts=e // n_exp, a2a_combine_dtype=combine_dtype,
                     timeout_s=20)  # fmt: skip


SHAPES = [(2, 2, 1), (2, 2, 2), (2, 6, 1), (2, 6, 2), (3, 5, 1), (3, 5, 2), (3, 5, 3)]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("n_att, n_exp, domains", SHAPES)
@pytest.mark.parametrize("m", [1, 2])
def test_domains_and_microbatches_match_the_reference(n_att, n_exp, domains, m):
    n, e = n_att + n_exp, 2 * n_exp
    split = Split.make(n, n_att, domains, m)
    with Pod.launch(pod_config(n, n_exp, e)) as pod:
        for seed, quant in ((1, None), (2, "int8"), (3, None)):  # back to back runs
            check(pod.run(split_step, seed, split, e, quant), seed, split, e, quant, "bfloat16")
        # the colocated collectives still work in the same pod after split runs
        a = pod.run(colocated_step, 7, split)
        assert all(r == "ok" for r in a), a


@pytest.mark.timeout(120)
def test_any_set_of_attention_dies():
    """The roles need not be contiguous: attention dies 1 and 4 (two domains, two micro-batches)
    among expert dies 0, 2, 3, 5 (trampolines 0 and 2)."""
    split = Split((1, 4), (0, 2, 3, 5), ((1,), (4,)), 2)
    split.check(6)
    assert [split.trampoline(a) for a in split.att_dies] == [0, 2]
    with Pod.launch(pod_config(6, 4, 8)) as pod:
        for seed, quant in ((11, None), (12, "int8")):
            check(pod.run(split_step, seed, split, 8, quant), seed, split, 8, quant, "bfloat16")


def colocated_step(die, seed, split):
    rng = np.random.default_rng([seed, die.die_id])
    x = rng.standard_normal((4, H)).astype(np.float32)
    idx = random_topk(rng, 4, K, die.layout.a2a_num_experts)
    w = rng.random((4, K)).astype(np.float32)
    comm.a2e_align(die, split)  # the end of the split's cycle: every die's counters alike
    e, n = die.layout.a2a_num_experts, die.num_dies
    placement = Placement.from_table(np.arange(e) % n, tuple(range(n)))
    d = comm.dispatch(die, x, idx, w, protocol="fused", event_id=seed, placement=placement)
    comm.combine(die, d.x, d.handle, event_id=seed)
    return "ok"


def test_split_refuses_impossible_shapes():
    with pytest.raises(ConfigError, match="domains"):
        Split.make(8, 2, 3)  # 3 domains of 2 attention dies
    with pytest.raises(ConfigError, match="trampolines"):
        Split.make(6, 4, 1)  # 4 attention dies, 2 expert dies
    with pytest.raises(ConfigError, match="microbatches"):
        Split.make(4, 2, 1, 3)
    with pytest.raises(ConfigError, match="attention dies"):
        Split.make(4, 4)
    s = Split.make(8, 3, 2, 2)
    assert s.domains == ((0, 1), (2,)) and s.cycle == 4
    assert [s.trampoline(a) for a in s.att_dies] == [3, 4, 5]
    # pod-wide operation numbers: expert dies count every position, an attention die its own
    ops = {a: 0 for a in s.att_dies}
    ex = 0
    for _ in range(3):
        for d, dom in enumerate(s.domains):
            for mb in range(2):
                ex = s.next_op(ex, d, mb, True)
                for a in dom:
                    ops[a] = s.next_op(ops[a], d, mb, False)
                    assert ops[a] == ex


def bad_microbatch(die, split: Split, case: str):
    me = die.die_id
    comm.a2e_align(die, split)
    if me == 0:
        x, idx, w = inputs(5, 0, 0, 0, 2, split, 8)
        if case == "out-of-order":
            comm.a2e(die, x, idx, w, split, event_id=1, microbatch=1)
        elif case == "overlap":
            comm.a2e(die, x, idx, w, split, event_id=1, microbatch=0, slot_base=0)
            comm.a2e(die, x, idx, w, split, event_id=2, microbatch=1, slot_base=0)
        else:
            comm.a2e(die, x, idx, w, split, event_id=1, microbatch=0, slot_base=B)
    return split_step(die, 9, split, 8, None)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", ["out-of-order", "overlap", "slot-range"])
def test_bad_microbatch_is_refused_and_the_pod_stays_usable(case):
    n_att, n_exp = 2, 4
    split = Split.make(6, n_att, 2, 2)
    with Pod.launch(pod_config(6, n_exp, 8)) as pod:
        with pytest.raises((ValueError, PeerRefused)) as ei:
            pod.run(bad_microbatch, split, case)
        err = ei.value
        assert "microbatch" in str(err) or "slot_base" in str(err) or err.die_id != 0, err
        check(pod.run(split_step, 4, split, 8, None), 4, split, 8, None, "bfloat16")
