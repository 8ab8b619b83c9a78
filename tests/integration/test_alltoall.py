"""Pull-based dispatch / combine (docs/protocols.md §6) against the numpy reference, bit for bit.

Every die's tokens are built from (seed, die id), so rows name their sender, and every result is
compared with `comm.reference` run over all dies' inputs in the launcher.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

import comm
from comm import reference as ref
from comm.routing import Placement
from runtime import Pod, PodConfig
from tests.routing_cases import random_topk

H, K, B = 48, 4, 16


def make_inputs(seed: int, die_id: int, num_experts: int, case: str):
    rng = np.random.default_rng(seed * 1009 + die_id)
    b = B if case == "full" else int(rng.integers(0, B + 1))
    if case == "sends-nothing" and die_id == 0:
        b = 0
    x = (rng.standard_normal((b, H)) + 100 * die_id).astype(np.float32)  # rows name the sender
    idx = random_topk(rng, b, K, num_experts)  # distinct experts per token, some unrouted
    if case == "one-expert":  # every token to expert 3 only
        idx[:] = -1
        idx[:, 0] = 3
    if case == "same-die":  # two experts of one die in each token's top-k (experts 0 and 1: die 0)
        rest = random_topk(rng, b, K - 2, num_experts - 2, unrouted=0.0)
        idx = np.concatenate(
            [np.zeros((b, 1)), np.ones((b, 1)), np.where(rest < 0, -1, rest + 2)], 1
        )
        idx = idx.astype(np.int64)
    if case == "unrouted":
        idx[:, ::2] = -1
    w = rng.random((b, K)).astype(np.float32)
    return x, idx, w


def expert_fn(die_id: int, rows: np.ndarray) -> np.ndarray:
    return (rows * np.float32(1.5 + die_id) + np.float32(die_id)).astype(np.float32)


def cdt(pod) -> str:
    return pod.config.a2a_combine_dtype


def placement_for(case: str, num_dies: int, num_experts: int) -> Placement:
    dies = tuple(range(num_dies))
    if case == "receives-nothing":  # the last die hosts no expert
        table = np.arange(num_experts) % (num_dies - 1)
        return Placement.from_table(table, dies)
    return Placement.default(num_experts, dies)


def moe_step(die, seed, quant, case, num_experts, placement, sleep_s=0.0, protocol="pull",
             dedup=False):  # fmt: skip
    x, idx, w = make_inputs(seed, die.die_id, num_experts, case)
    if sleep_s and die.die_id == 1:
        time.sleep(sleep_s)
    d = comm.dispatch(
        die, x, idx, w, protocol=protocol, quant=quant, event_id=seed, placement=placement,
        dedup=dedup,
    )  # fmt: skip
    rows = d.x.astype(np.float32) * d.scales[:, None] if quant == "int8" else d.x
    if sleep_s and die.die_id == 1:
        time.sleep(sleep_s)
    out = comm.combine(die, expert_fn(die.die_id, rows), d.handle, event_id=seed)
    return {
        "x": d.x,
        "scales": d.scales,
        "src_rank": d.src_rank,
        "batch_slot": d.batch_slot,
        "k_index": d.k_index,
        "local_expert": d.local_expert,
        "expert_counts": d.expert_counts,
        "out": out,
    }


def check_against_reference(res, seed, quant, case, num_dies, num_experts, placement,
                            combine_dtype="bfloat16", dedup=False):  # fmt: skip
    ins = [make_inputs(seed, r, num_experts, case) for r in range(num_dies)]
    douts = ref.dispatch_ref([i[0] for i in ins], [i[1] for i in ins], placement, quant=quant)
    for r in range(num_dies):
        o = douts[r]
        assert np.array_equal(res[r]["x"], o.x), f"seed {seed} die {r}: dispatched rows differ"
        if quant == "int8":
            assert np.array_equal(res[r]["scales"], o.scales), f"seed {seed} die {r}: scales"
        for f in ("src_rank", "batch_slot", "k_index", "local_expert", "expert_counts"):
            assert np.array_equal(res[r][f], getattr(o, f)), f"seed {seed} die {r}: {f}"
    rows = {
        r: douts[r].x.astype(np.float32) * douts[r].scales[:, None]
        if quant == "int8"
        else douts[r].x
        for r in douts
    }
    eouts = {r: expert_fn(r, rows[r]) for r in douts}
    couts = ref.combine_ref(eouts, douts, [i[1] for i in ins], [i[2] for i in ins],
                            combine_dtype=combine_dtype, dedup=dedup)  # fmt: skip
    for r in range(num_dies):
        assert res[r]["out"].dtype == np.float32
        assert np.array_equal(res[r]["out"], couts[r]), f"seed {seed} die {r}: combine differs"


@pytest.fixture(
    scope="module",
    params=[(2, "bfloat16"), (4, "bfloat16"), (8, "bfloat16"), (2, "float32"), (4, "float32")],
    ids=lambda p: f"ep{p[0]}-{p[1]}",
)
def ep_pod(request):
    n, combine_dtype = request.param
    cfg = PodConfig(
        a2a_combine_dtype=combine_dtype,
        num_dies=n,
        a2a_max_batch=B,
        a2a_hidden=H,
        a2a_topk=K,
        num_experts=2 * n,
        a2a_max_local_experts=2 * n,  # any placement, e.g. one die hosting every expert
        timeout_s=20,
    )
    with Pod.launch(cfg) as pod:
        yield pod


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dedup", [False, True], ids=["plain", "dedup"])
@pytest.mark.parametrize("protocol", ["pull", "fused"])
@pytest.mark.parametrize("quant", [None, "int8"])
@pytest.mark.parametrize(
    "case",
    ["random", "full", "sends-nothing", "receives-nothing", "one-expert", "same-die", "unrouted"],
)
def test_matches_reference(ep_pod, protocol, quant, case, dedup):
    n = ep_pod.config.num_dies
    e = ep_pod.config.num_experts
    placement = placement_for(case, n, e)
    for seed in range(3):
        print(f"seed {seed}, ep{n}, {protocol}, {quant}, {case}, dedup {dedup}")
        res = ep_pod.run(moe_step, seed, quant, case, e, placement, 0.0, protocol, dedup)
        check_against_reference(res, seed, quant, case, n, e, placement, cdt(ep_pod), dedup)


def back_to_back(die, seeds, num_experts, placement):
    outs = []
    for seed in seeds:  # no barrier in between; quantization, protocol and dedup alternate
        quant = "int8" if seed % 2 else None
        protocol = "fused" if seed % 3 else "pull"
        outs.append(moe_step(die, seed, quant, "random", num_experts, placement, 0.0, protocol,
                             dedup=seed % 5 < 2))  # fmt: skip
    return outs


@pytest.mark.timeout(120)
def test_back_to_back_alternating_quant_and_a_slow_die(ep_pod):
    n, e = ep_pod.config.num_dies, ep_pod.config.num_experts
    placement = placement_for("random", n, e)
    seeds = list(range(10, 22))
    res = ep_pod.run(back_to_back, seeds, e, placement)
    for j, seed in enumerate(seeds):
        quant = "int8" if seed % 2 else None
        check_against_reference([r[j] for r in res], seed, quant, "random", n, e, placement,
                                cdt(ep_pod), dedup=seed % 5 < 2)  # fmt: skip
    for protocol in ("pull", "fused"):  # die 1 sleeps between the steps
        for dedup in (False, True):
            res = ep_pod.run(moe_step, 20, None, "random", e, placement, 0.02, protocol, dedup)
            check_against_reference(res, 20, None, "random", n, e, placement, cdt(ep_pod), dedup)


def dedup_mismatch(die, protocol):
    """Die 0 asks for dedup, the others do not: every die raises, then a step works."""
    try:
        moe_step(die, 50, "int8", "random", 2 * die.num_dies, None, 0.0, protocol,
                 dedup=die.die_id == 0)  # fmt: skip
    except comm.ProtocolError as e:
        err = str(e)
    else:
        err = "no error"
    return err, moe_step(die, 51, "int8", "random", 2 * die.num_dies, None, 0.0, protocol, True)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("protocol", ["pull", "fused"])
def test_dedup_on_some_dies_only_is_a_protocol_error_and_the_pod_stays_usable(ep_pod, protocol):
    n, e = ep_pod.config.num_dies, ep_pod.config.num_experts
    got = ep_pod.run(dedup_mismatch, protocol)
    errors = [g[0] for g in got]
    assert any("dedup" in m for m in errors), errors
    assert all(m != "no error" for m in errors), errors
    placement = placement_for("random", n, e)
    check_against_reference([g[1] for g in got], 51, "int8", "random", n, e, placement,
                            cdt(ep_pod), dedup=True)  # fmt: skip


def dedup_not_bool(die):
    try:
        moe_step(die, 52, None, "random", 2 * die.num_dies, None, dedup="yes")
    except TypeError as e:
        return str(e)
    return "no error"


@pytest.mark.timeout(120)
def test_dedup_must_be_a_bool(ep_pod):
    got = ep_pod.run(dedup_not_bool)
    assert all("dedup must be a bool" in m for m in got), got


def readonly_step(die, seed, protocol, quant, dedup, strided):
    """A step whose inputs and expert outputs are all read-only, or (strided) views that are
    not C-contiguous: valid input, which every path must take (kernels compiled for writeable
    C arrays refused it, on some paths after the operation had started)."""
    x, idx, w = make_inputs(seed, die.die_id, 2 * die.num_dies, "random")
    if strided:
        x, idx, w = (np.repeat(a, 2, axis=1)[:, ::2] for a in (x, idx, w))
    for a in (x, idx, w):
        a.flags.writeable = False
    d = comm.dispatch(die, x, idx, w, protocol=protocol, quant=quant, event_id=seed, dedup=dedup)
    rows = d.x.astype(np.float32) * d.scales[:, None] if quant == "int8" else d.x
    expert_out = expert_fn(die.die_id, rows)
    if strided:
        expert_out = np.repeat(expert_out, 2, axis=1)[:, ::2]
    expert_out.flags.writeable = False
    out = comm.combine(die, expert_out, d.handle, event_id=seed)
    return {"x": d.x, "scales": d.scales, "src_rank": d.src_rank, "batch_slot": d.batch_slot,
            "k_index": d.k_index, "local_expert": d.local_expert,
            "expert_counts": d.expert_counts, "out": out}  # fmt: skip


@pytest.mark.timeout(120)
@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("dedup", [False, True])
@pytest.mark.parametrize("quant", [None, "int8"])
@pytest.mark.parametrize("protocol", ["pull", "fused"])
def test_read_only_and_strided_inputs_are_taken(ep_pod, protocol, quant, dedup, strided):
    n, e = ep_pod.config.num_dies, ep_pod.config.num_experts
    res = ep_pod.run(readonly_step, 53, protocol, quant, dedup, strided)
    check_against_reference(res, 53, quant, "random", n, e, placement_for("random", n, e),
                            cdt(ep_pod), dedup=dedup)  # fmt: skip


def over_max(die):
    x = np.zeros((B + 1, H), np.float32)
    idx = np.zeros((B + 1, K), np.int64)
    try:
        comm.dispatch(die, x, idx, np.ones((B + 1, K), np.float32))
    except ValueError as e:
        return str(e)
    return "no error"


def bad_shapes(die, what):
    x = np.zeros((2, H), np.float32)
    idx = np.zeros((2, K), np.int64)
    w = np.ones((2, K), np.float32)
    if what == "dtype":
        x = x.astype(np.float64)
    elif what == "hidden":
        x = np.zeros((2, H + 1), np.float32)
    elif what == "topk":
        idx = np.zeros((2, K + 1), np.int64)
    elif what == "expert":
        idx[0, 0] = 10_000
    try:
        comm.dispatch(die, x, idx, w)
    except (TypeError, ValueError) as e:
        return type(e).__name__
    return "no error"


@pytest.mark.timeout(120)
def test_bad_input_is_refused_and_the_pod_stays_usable(ep_pod):
    n, e = ep_pod.config.num_dies, ep_pod.config.num_experts
    msgs = ep_pod.run(over_max)
    assert all(f"maximum a2a_max_batch {B}" in m for m in msgs), msgs
    for what, exc in (("dtype", "TypeError"), ("hidden", "ValueError"), ("topk", "ValueError"),
                      ("expert", "ValueError")):  # fmt: skip
        assert ep_pod.run(bad_shapes, what) == [exc] * n, what
    placement = placement_for("random", n, e)
    res = ep_pod.run(moe_step, 30, "int8", "random", e, placement)
    check_against_reference(res, 30, "int8", "random", n, e, placement, cdt(ep_pod))


def traced_step(die, num_experts, placement, protocol):
    die.trace.clear()
    die.trace.enabled = True
    try:
        moe_step(die, 40, None, "random", num_experts, placement, 0.0, protocol)
    finally:
        die.trace.enabled = False
    recs = [r for r in die.trace.snapshot() if r[5] == 0]  # lane 0: the step spans
    return {kind: comm.steps_of(recs, f"{protocol}_{kind}") for kind in ("dispatch", "combine")}


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "protocol, steps",
    [
        ("pull", {"dispatch": [2, 3, 4, 5, 6], "combine": [3, 4, 5, 6]}),
        ("fused", {"dispatch": [1, 2, 3], "combine": [1, 3, 4]}),
    ],
)
def test_trace_shows_the_dispatch_and_combine_steps_in_order(ep_pod, protocol, steps):
    n, e = ep_pod.config.num_dies, ep_pod.config.num_experts
    got = ep_pod.run(traced_step, e, placement_for("random", n, e), protocol)
    for r in range(n):
        for kind, want in steps.items():
            assert [s for _, s in got[r][kind]] == want, (r, kind, got[r][kind])


def int8_layout_step(die, seed, num_experts, placement):
    try:
        moe_step(die, seed, None, "random", num_experts, placement)
    except ValueError as e:
        refused = str(e)
    else:
        refused = "no error"
    return refused, moe_step(die, seed, "int8", "random", num_experts, placement)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("protocol", ["pull", "fused"])
def test_int8_only_layout_refuses_float32_and_stays_exact(protocol):
    n, e = 4, 8
    cfg = PodConfig(num_dies=n, a2a_max_batch=B, a2a_hidden=H, a2a_topk=K, num_experts=e,
                    a2a_dispatch_dtype="int8", timeout_s=20)  # fmt: skip
    f32 = PodConfig(**{**cfg.to_dict(), "a2a_dispatch_dtype": "float32"})
    # rows of hidden bytes (+ a dedup list of min(topk, experts per die) 12-byte entries + 16
    # bytes of meta, rounded to 64) against 4 x hidden: at hidden 48, 128 against 256 bytes
    assert cfg.layout().pull_disp_stride == 128 and f32.layout().pull_disp_stride == 256
    assert (
        cfg.layout().fused_buffer_bytes()["dispatch"] * 2
        == f32.layout().fused_buffer_bytes()["dispatch"]
    )
    placement = placement_for("random", n, e)
    with Pod.launch(cfg) as pod:
        for seed in (50, 51):  # back to back, the second after every die refused a float32 call
            got = pod.run(int8_layout_step, seed, e, placement)
            assert all("a2a_dispatch_dtype" in m for m, _ in got), got
            check_against_reference([r for _, r in got], seed, "int8", "random", n, e, placement)


def no_a2a(die):
    try:
        comm.dispatch(die, np.zeros((1, 4), np.float32), np.zeros((1, 2)), np.zeros((1, 2)))
    except comm.ConfigError as e:
        return str(e)
    return "no error"


@pytest.mark.timeout(60)
def test_pod_without_a2a_areas_says_how_to_get_them(pod_factory):
    pod = pod_factory(num_dies=2)
    assert all("a2a_max_batch" in m for m in pod.run(no_a2a))


def test_num_experts_must_divide_over_the_dies():
    with pytest.raises(comm.ConfigError, match="num_experts"):
        PodConfig(num_dies=4, a2a_max_batch=8, a2a_hidden=16, a2a_topk=2, num_experts=6)


# -- A2E / E2A with trampolines (docs/protocols.md §8) --------------------------------------------


def a2e_step(die, seed, n_att, num_experts, quant, readonly=False):
    if die.die_id < n_att:
        x, idx, w = make_inputs(seed, die.die_id, num_experts, "random")
        for a in (x, idx, w):
            a.flags.writeable = not readonly
        res, h = comm.a2e(die, x, idx, w, n_att, quant=quant, event_id=seed)
        out = comm.e2a(die, None, h, event_id=seed)
        return {"out": out, "writes": h.metadata_writes}
    res, h = comm.a2e(die, None, None, None, n_att, quant=quant, event_id=seed)
    rows = res.x.astype(np.float32) * res.scales[:, None] if quant == "int8" else res.x
    expert_out = expert_fn(die.die_id, rows)
    expert_out.flags.writeable = not readonly
    comm.e2a(die, expert_out, h, event_id=seed)
    return {f: getattr(res, f) for f in ("x", "scales", "src_rank", "batch_slot", "k_index",
                                         "local_expert", "expert_counts")}  # fmt: skip


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n_att, n_exp", [(2, 4), (4, 8)])
@pytest.mark.parametrize("quant", [None, "int8"])
@pytest.mark.parametrize("combine_dtype", ["bfloat16", "float32"])
def test_a2e_e2a_through_trampolines_match_reference(n_att, n_exp, quant, combine_dtype):
    n, e = n_att + n_exp, 2 * n_exp
    cfg = PodConfig(num_dies=n, a2a_max_batch=B, a2a_hidden=H, a2a_topk=K, num_experts=e,
                    a2a_max_local_experts=e // n_exp, a2a_combine_dtype=combine_dtype,
                    timeout_s=20)  # fmt: skip
    placement = Placement.default(e, tuple(range(n_att, n)))
    att = list(range(n_att))
    with Pod.launch(cfg) as pod:
        for seed in range(4):  # back to back, no barrier between operations
            print(f"seed {seed}, {n_att}+{n_exp}, {quant}")
            res = pod.run(a2e_step, seed, n_att, e, quant, seed == 3)  # read-only inputs last
            ins = [make_inputs(seed, r, e, "random") for r in att]
            douts = ref.a2e_ref([i[0] for i in ins], [i[1] for i in ins], placement, att, quant)
            for d, o in douts.items():
                for f in ("x", "src_rank", "batch_slot", "k_index", "local_expert",
                          "expert_counts"):  # fmt: skip
                    assert np.array_equal(res[d][f], getattr(o, f)), (seed, d, f)
            rows = {d: o.x.astype(np.float32) * o.scales[:, None] if quant == "int8" else o.x
                    for d, o in douts.items()}  # fmt: skip
            eouts = {d: expert_fn(d, rows[d]) for d in douts}
            couts = ref.e2a_ref(eouts, douts, [i[1] for i in ins], [i[2] for i in ins], att,
                                combine_dtype)  # fmt: skip
            for r in att:
                assert np.array_equal(res[r]["out"], couts[r]), (seed, r, "e2a")
                assert res[r]["writes"] == 1, "one metadata write per attention die per step"
        steps = pod.run(traced_a2e_steps, n_att, e, quant)
    tramp = set(range(n_att, 2 * n_att))
    for d, got in enumerate(steps):
        if d < n_att:
            assert got == {"a2e": [1], "e2a": [5, 6]}, (d, got)
        elif d in tramp:
            assert got == {"a2e": [2, 3], "e2a": [1, 3, 4]}, (d, got)
        else:
            assert got == {"a2e": [3], "e2a": [1]}, (d, got)


def traced_a2e_steps(die, n_att, num_experts, quant):
    die.trace.clear()
    die.trace.enabled = True
    try:
        a2e_step(die, 99, n_att, num_experts, quant)
    finally:
        die.trace.enabled = False
    recs = die.trace.snapshot()
    return {op: [s for _, s in comm.steps_of(recs, op)] for op in ("a2e", "e2a")}
