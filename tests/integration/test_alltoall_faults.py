"""Bad input on one die, repeated experts and area bounds in the all-to-all (issue 8.1, 8.2, 8.7).

One die (BAD) passes an invalid argument while every other die passes a valid one. The bad die
must raise its own clear error, every peer that depends on it `PeerRefused` naming it, and the
very next operation, in the same `pod.run` and after it, must equal `comm.reference` bit for
bit on every die. Top-k 4 with 2 experts per die, so a repeated expert could overflow the
receive areas if it were not refused.
"""

from __future__ import annotations

import numpy as np
import pytest

import comm
from comm import reference as ref
from comm import routing
from comm.alltoall import pull
from comm.alltoall.areas import area_check
from comm.routing import Placement
from memory.errors import ProtocolError
from runtime import Pod, PodConfig
from tests.integration.test_alltoall import (
    B,
    H,
    K,
    a2e_step,
    check_against_reference,
    expert_fn,
    make_inputs,
    moe_step,
)

DIES, EXPERTS, BAD = 4, 8, 2  # 2 experts per die, top-k 4


@pytest.fixture(scope="module")
def pod():
    cfg = PodConfig(num_dies=DIES, a2a_max_batch=B, a2a_hidden=H, a2a_topk=K,
                    num_experts=EXPERTS, timeout_s=20)  # fmt: skip
    with Pod.launch(cfg) as p:
        yield p


def default_placement() -> Placement:
    return Placement.default(EXPERTS, tuple(range(DIES)))


def outcome(fn, *args, **kwargs) -> tuple:
    try:
        fn(*args, **kwargs)
        return ("ok", "")
    except Exception as e:  # noqa: BLE001 - the test compares types and messages
        return (type(e).__name__, str(e))


# case -> (how the bad die's dispatch arguments change, exception type, words in the message)
DISPATCH_CASES = {
    "x-float64": (lambda a: a.update(x=a["x"].astype(np.float64)), "TypeError", "float32"),
    "x-int32": (lambda a: a.update(x=a["x"].astype(np.int32)), "TypeError", "float32"),
    "x-1d": (lambda a: a.update(x=a["x"][0]), "TypeError", "[batch, hidden]"),
    "x-list": (lambda a: a.update(x=a["x"].tolist()), "TypeError", "float32"),
    "x-hidden": (lambda a: a.update(x=np.ascontiguousarray(a["x"][:, :-1])), "ValueError",
                 "hidden"),
    "batch-over-max": (lambda a: a.update(x=np.zeros((B + 1, H), np.float32),
                                          topk_idx=np.full((B + 1, K), -1),
                                          topk_weights=np.zeros((B + 1, K), np.float32)),
                       "ValueError", "a2a_max_batch"),
    "expert-too-big": (lambda a: a["topk_idx"].__setitem__((0, 0), EXPERTS), "ValueError",
                       "expert ids must be -1"),
    "expert-below-minus-one": (lambda a: a["topk_idx"].__setitem__((1, 2), -2), "ValueError",
                               "expert ids must be -1"),
    "expert-repeated": (lambda a: a["topk_idx"].__setitem__(0, [5, 5, -1, 1]), "ValueError",
                        "names expert 5 twice"),
    "expert-repeated-same-die": (lambda a: a["topk_idx"].__setitem__(3, [2, 3, 2, 3]),
                                 "ValueError", "twice"),
    "topk-float": (lambda a: a.update(topk_idx=a["topk_idx"].astype(np.float64)), "TypeError",
                   "integer"),
    "topk-shape": (lambda a: a.update(topk_idx=a["topk_idx"][:, :-1]), "ValueError",
                   "topk_idx must have shape"),
    "weights-shape": (lambda a: a.update(topk_weights=a["topk_weights"][:-1]), "ValueError",
                      "topk_weights must have shape"),
    "weights-int": (lambda a: a.update(topk_weights=a["topk_weights"].astype(np.int64)),
                    "TypeError", "float"),
    "event-2**64": (lambda a: a.update(event_id=2**64), "ValueError", "event_id"),
    "event-seven": (lambda a: a.update(event_id="seven"), "ValueError", "event_id"),
    "event-negative": (lambda a: a.update(event_id=-1), "ValueError", "event_id"),
    "event-2**62": (lambda a: a.update(event_id=2**62), "ValueError", "event_id"),
    "event-float": (lambda a: a.update(event_id=1.5), "ValueError", "event_id"),
    "event-none": (lambda a: a.update(event_id=None), "ValueError", "event_id"),
    "quant-int4": (lambda a: a.update(quant="int4"), "ValueError", "quant"),
    "x-nan-int8": (lambda a: (a["x"].__setitem__((2, 3), np.nan), a.update(quant="int8")),
                   "ValueError", "finite"),
    "x-inf-int8": (lambda a: (a["x"].__setitem__((0, 0), np.inf), a.update(quant="int8")),
                   "ValueError", "finite"),
    "placement-not-one": (lambda a: a.update(placement="0,1,2,3"), "TypeError", "Placement"),
    "placement-over-capacity": (
        lambda a: a.update(placement=Placement.from_table(np.zeros(EXPERTS, int), (0, 1))),
        "ValueError", "a2a_max_local_experts"),
    "placement-other-experts": (lambda a: a.update(placement=Placement.default(4, (0, 1))),
                                "ValueError", "experts"),
    "dedup-string": (lambda a: a.update(dedup="yes"), "TypeError", "dedup must be a bool"),
}  # fmt: skip


def dispatch_args(die, seed: int, protocol: str, case: str | None, dedup: bool = False) -> dict:
    x, idx, w = make_inputs(seed, die.die_id, EXPERTS, "full")  # B rows: every case has rows
    args = dict(x=x, topk_idx=idx, topk_weights=w, protocol=protocol, quant=None,
                event_id=seed, placement=None, dedup=dedup)  # fmt: skip
    if case is not None and die.die_id == BAD:
        DISPATCH_CASES[case][0](args)
    return args


def bad_dispatch_then_good(die, protocol: str, case: str, seed: int, dedup: bool = False):
    """Every die dispatches (BAD with bad input) and reports; then a whole good MoE step."""
    first = outcome(comm.dispatch, die, **dispatch_args(die, seed, protocol, case, dedup))
    good = moe_step(die, seed + 1, None, "random", EXPERTS, None, protocol=protocol, dedup=dedup)
    return first, good


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dedup", [False, True], ids=["plain", "dedup"])
@pytest.mark.parametrize("case", sorted(DISPATCH_CASES))
@pytest.mark.parametrize("protocol", ["pull", "fused"])
def test_bad_dispatch_input_on_one_die_refused_and_the_pod_stays_in_step(pod, protocol, case,
                                                                         dedup):  # fmt: skip
    seed = 100 + sorted(DISPATCH_CASES).index(case)
    res = pod.run(bad_dispatch_then_good, protocol, case, seed, dedup)
    _, exc, words = DISPATCH_CASES[case]
    kind, msg = res[BAD][0]
    assert kind == exc and words in msg, res[BAD][0]
    for r in range(DIES):
        if r != BAD:  # every die waits for every source in a dispatch
            assert res[r][0][0] == "PeerRefused" and f"die {BAD} refused" in res[r][0][1], res[r]
    check_against_reference([g for _, g in res], seed + 1, None, "random", DIES, EXPERTS,
                            default_placement(), dedup=dedup)  # fmt: skip


COMBINE_CASES = {
    "out-float64": (lambda a: a.update(expert_out=a["expert_out"].astype(np.float64)),
                    "TypeError", "float32"),
    "out-extra-row": (lambda a: a.update(expert_out=np.zeros((len(a["expert_out"]) + 1, H),
                                                             np.float32)),
                      "ValueError", "rows of hidden"),
    "out-hidden": (lambda a: a.update(expert_out=np.zeros((len(a["expert_out"]), H + 1),
                                                          np.float32)),
                   "ValueError", "rows of hidden"),
    "out-list": (lambda a: a.update(expert_out=a["expert_out"].tolist()), "TypeError",
                 "float32"),
    "event-seven": (lambda a: a.update(event_id="seven"), "ValueError", "event_id"),
    "event-2**64": (lambda a: a.update(event_id=2**64), "ValueError", "event_id"),
    "handle-string": (lambda a: a.update(handle="handle"), "TypeError", "DispatchHandle"),
    "handle-none": (lambda a: a.update(handle=None), "TypeError", "DispatchHandle"),
}  # fmt: skip


def bad_combine_then_good(die, protocol: str, case: str, seed: int, dedup: bool = False):
    args = dispatch_args(die, seed, protocol, None, dedup)
    d = comm.dispatch(die, **args)
    cargs = dict(expert_out=expert_fn(die.die_id, d.x), handle=d.handle, event_id=seed)
    if die.die_id == BAD:
        COMBINE_CASES[case][0](cargs)
    out = None
    try:
        out = comm.combine(die, **cargs)
        first = ("ok", "")
    except Exception as e:  # noqa: BLE001
        first = (type(e).__name__, str(e))
    good = moe_step(die, seed + 1, None, "random", EXPERTS, None, protocol=protocol, dedup=dedup)
    return first, out, good


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dedup", [False, True], ids=["plain", "dedup"])
@pytest.mark.parametrize("case", sorted(COMBINE_CASES))
@pytest.mark.parametrize("protocol", ["pull", "fused"])
def test_bad_combine_input_on_one_die_refused_and_the_pod_stays_in_step(pod, protocol, case,
                                                                        dedup):  # fmt: skip
    seed = 200 + sorted(COMBINE_CASES).index(case)
    res = pod.run(bad_combine_then_good, protocol, case, seed, dedup)
    _, exc, words = COMBINE_CASES[case]
    assert res[BAD][0][0] == exc and words in res[BAD][0][1], res[BAD][0]
    ins = [make_inputs(seed, r, EXPERTS, "full") for r in range(DIES)]
    placement = default_placement()
    for r in range(DIES):
        if r == BAD:
            continue
        needs_bad = bool((placement.die_of[ins[r][1][ins[r][1] >= 0]] == BAD).any())
        if protocol == "pull" or needs_bad:  # fused: only dies whose tokens BAD serves fail
            assert res[r][0][0] == "PeerRefused" and f"die {BAD} refused" in res[r][0][1], res[r]
        else:  # and they got the exact result
            assert res[r][0][0] == "ok", res[r][0]
            want = ref.moe_ref([i[0] for i in ins], [i[1] for i in ins], [i[2] for i in ins],
                               placement, lambda die, d: expert_fn(die, d.x),
                               dedup=dedup)  # fmt: skip
            assert np.array_equal(res[r][1], want[r])
    check_against_reference([g for _, _, g in res], seed + 1, None, "random", DIES, EXPERTS,
                            placement, dedup=dedup)  # fmt: skip


# Valid but different from the other dies' call: both sides must notice (no silent mix-up).
MISPAIRED = {
    "event": (lambda a: a.update(event_id=a["event_id"] + 1), "mis-paired"),
    "quant": (lambda a: a.update(quant="int8"), "quant differs"),
}


def mispaired_dispatch_then_good(die, protocol: str, case: str, seed: int):
    args = dispatch_args(die, seed, protocol, None)
    if die.die_id == BAD:
        MISPAIRED[case][0](args)
    first = outcome(comm.dispatch, die, **args)
    good = moe_step(die, seed + 1, None, "random", EXPERTS, None, protocol=protocol)
    return first, good


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", sorted(MISPAIRED))
@pytest.mark.parametrize("protocol", ["pull", "fused"])
def test_mispaired_dispatch_fails_on_every_die_and_the_pod_stays_in_step(pod, protocol, case):
    seed = 250 + sorted(MISPAIRED).index(case)
    res = pod.run(mispaired_dispatch_then_good, protocol, case, seed)
    for r in range(DIES):  # every die receives from BAD, BAD from every die
        kind, msg = res[r][0]
        assert kind == "ProtocolError" and MISPAIRED[case][1] in msg, (r, res[r][0])
    check_against_reference([g for _, g in res], seed + 1, None, "random", DIES, EXPERTS,
                            default_placement())  # fmt: skip


def stale_or_mispaired_combine(die, protocol: str, case: str, seed: int):
    """Two dispatches; every die combines the second, BAD the first ("stale"), or every die
    the second with BAD naming another event id ("event")."""
    d1 = comm.dispatch(die, **dispatch_args(die, seed, protocol, None))
    d2 = comm.dispatch(die, **dispatch_args(die, seed + 1, protocol, None))
    d, ev = d2, seed + 1
    if die.die_id == BAD:
        d, ev = (d1, seed + 1) if case == "stale" else (d2, seed + 7)
    out = expert_fn(die.die_id, d.x)
    first = outcome(comm.combine, die, out, d.handle, event_id=ev)
    return first, moe_step(die, seed + 2, None, "random", EXPERTS, None, protocol=protocol)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", ["stale", "event"])
@pytest.mark.parametrize("protocol", ["pull", "fused"])
def test_combine_of_another_dispatch_or_event_is_never_silent(pod, protocol, case):
    seed = 270 + 10 * (case == "event")
    res = pod.run(stale_or_mispaired_combine, protocol, case, seed)
    kind, msg = res[BAD][0]
    if protocol == "fused" and case == "stale":  # refused up front: one combine buffer
        assert kind == "ValueError" and "alternate" in msg, res[BAD][0]
    else:
        assert kind == "ProtocolError", res[BAD][0]
    placement = default_placement()
    for r in range(DIES):
        if r == BAD:
            continue
        idx = make_inputs(seed + 1, r, EXPERTS, "full")[1]
        needs_bad = bool((placement.die_of[idx[idx >= 0]] == BAD).any())
        if protocol == "pull" or needs_bad:
            assert res[r][0][0] in ("ProtocolError", "PeerRefused"), (r, res[r][0])
        else:
            assert res[r][0][0] == "ok", (r, res[r][0])
    check_against_reference([g for _, g in res], seed + 2, None, "random", DIES, EXPERTS,
                            placement)  # fmt: skip


def bad_dispatch_raises(die, protocol: str, seed: int):
    args = dispatch_args(die, seed, protocol, "expert-repeated")
    comm.dispatch(die, **args)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("protocol", ["pull", "fused"])
def test_pod_run_raises_the_bad_die_error_not_its_consequences(pod, protocol):
    with pytest.raises(ValueError, match="names expert 5 twice") as ei:
        pod.run(bad_dispatch_raises, protocol, 300)
    assert ei.value.die_id == BAD
    notes = "\n".join(getattr(ei.value, "__notes__", []))
    assert "PeerRefused" in notes, notes  # the other dies' errors are listed
    for seed in (301, 302):  # pull and fused steps after it
        for proto in ("pull", "fused"):
            res = pod.run(moe_step, seed, None, "random", EXPERTS, None, 0.0, proto)
            check_against_reference(res, seed, None, "random", DIES, EXPERTS, default_placement())


# -- the last line of defence: the area bounds ----------------------------------------------------


def overflow_with_checks_off(die, protocol: str, seed: int):
    """Repeated experts with the routing checks switched off on every die: every token sends
    all of its k rows to expert 0, twice what die 0's areas are sized for."""
    distinct, capacity = routing._check_distinct, pull.check_capacity
    routing._check_distinct = lambda arr, name: None
    pull.check_capacity = lambda ep, lay, placement: None  # where dispatch looks it up
    try:
        x, _, w = make_inputs(seed, die.die_id, EXPERTS, "full")
        idx = np.full((len(x), K), 0)  # all to expert 0: die 0 gets 4 x 16 x 4 = 256 rows
        d = comm.dispatch(die, x, idx, w, protocol=protocol, event_id=seed)
        comm.combine(die, d.x, d.handle, event_id=seed)
    finally:
        routing._check_distinct, pull.check_capacity = distinct, capacity


@pytest.mark.timeout(120)
@pytest.mark.parametrize("protocol", ["pull", "fused"])
def test_area_bounds_refuse_an_overflow_that_validation_let_through(pod, protocol):
    # fused: the packets for one destination would overrun its block (ProtocolError, nothing
    # written); pull: the expert die's combine rows would overrun its combine area (refused
    # before it publishes). Either way nothing lands outside an area:
    with pytest.raises((ProtocolError, ValueError), match="area") as ei:
        pod.run(overflow_with_checks_off, protocol, 400)
    assert "rows" in str(ei.value)
    for seed in (401, 402):  # and no other area was touched: exact results afterwards
        for proto in ("fused", "pull"):
            res = pod.run(moe_step, seed, None, "random", EXPERTS, None, 0.0, proto)
            check_against_reference(res, seed, None, "random", DIES, EXPERTS, default_placement())


class _FakeEp:
    die_id = 0


@pytest.mark.parametrize("start, count, cap", [(0, 5, 4), (3, 2, 4), (-1, 1, 4), (0, -1, 4)])
def test_area_check_trips_outside_the_area(start, count, cap):
    with pytest.raises(ProtocolError, match="outside the area"):
        area_check(_FakeEp(), "test area", start, count, cap)


def test_area_check_passes_inside_the_area():
    area_check(_FakeEp(), "test area", 0, 4, 4)
    area_check(_FakeEp(), "test area", 4, 0, 4)


# -- A2E / E2A -----------------------------------------------------------------------------------

N_ATT, N_EXP = 2, 4


@pytest.fixture(scope="module")
def a2e_pod():
    e = 2 * N_EXP
    cfg = PodConfig(num_dies=N_ATT + N_EXP, a2a_max_batch=B, a2a_hidden=H, a2a_topk=K,
                    num_experts=e, a2a_max_local_experts=e // N_EXP, timeout_s=20)  # fmt: skip
    with Pod.launch(cfg) as p:
        yield p


def check_a2e(res, seed: int) -> None:
    n, e = N_ATT + N_EXP, 2 * N_EXP
    att = list(range(N_ATT))
    placement = Placement.default(e, tuple(range(N_ATT, n)))
    ins = [make_inputs(seed, r, e, "random") for r in att]
    douts = ref.a2e_ref([i[0] for i in ins], [i[1] for i in ins], placement, att, None)
    eouts = {d: expert_fn(d, o.x) for d, o in douts.items()}
    couts = ref.e2a_ref(eouts, douts, [i[1] for i in ins], [i[2] for i in ins], att)
    for d, o in douts.items():
        assert np.array_equal(res[d]["x"], o.x), (seed, d)
    for r in att:
        assert np.array_equal(res[r]["out"], couts[r]), (seed, r)


def a2e_bad_attention_input(die, seed: int, case: str):
    if die.die_id == 0:
        x, idx, w = make_inputs(seed, 0, 2 * N_EXP, "random")
        if case == "x-float64":
            x = x.astype(np.float64)
        else:
            idx[0] = [1, 1, -1, -1]
        comm.a2e(die, x, idx, w, N_ATT, event_id=seed)
    a2e_step(die, seed, N_ATT, 2 * N_EXP, None)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", ["x-float64", "expert-repeated"])
def test_a2e_bad_attention_input_raised_then_exact(a2e_pod, case):
    with pytest.raises((TypeError, ValueError)) as ei:
        a2e_pod.run(a2e_bad_attention_input, 500, case)
    assert ei.value.die_id == 0
    for seed in (501, 502):
        check_a2e(a2e_pod.run(a2e_step, seed, N_ATT, 2 * N_EXP, None), seed)


def e2a_bad_expert_output(die, seed: int, bad: int):
    e = 2 * N_EXP
    if die.die_id < N_ATT:
        x, idx, w = make_inputs(seed, die.die_id, e, "random")
        _, h = comm.a2e(die, x, idx, w, N_ATT, event_id=seed)
        first = outcome(comm.e2a, die, None, h, event_id=seed)
    else:
        res, h = comm.a2e(die, None, None, None, N_ATT, event_id=seed)
        out = expert_fn(die.die_id, res.x)
        if die.die_id == bad:
            out = out.astype(np.float64)
        first = outcome(comm.e2a, die, out, h, event_id=seed)
    return first, a2e_step(die, seed + 1, N_ATT, e, None)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("bad", [N_ATT, N_ATT + N_EXP - 1], ids=["trampoline", "expert-only"])
def test_e2a_bad_expert_output_refused_and_the_next_step_exact(a2e_pod, bad):
    res = a2e_pod.run(e2a_bad_expert_output, 600, bad)
    assert res[bad][0][0] == "TypeError" and "float32" in res[bad][0][1], res[bad][0]
    placement = Placement.default(2 * N_EXP, tuple(range(N_ATT, N_ATT + N_EXP)))
    for r in range(N_ATT):  # refused where a token of r had an expert on the bad die
        idx = make_inputs(600, r, 2 * N_EXP, "random")[1]
        served = bool((placement.die_of[idx[idx >= 0]] == bad).any())
        assert res[r][0][0] == ("PeerRefused" if served else "ok"), res[r][0]
    for r in range(N_ATT, N_ATT + N_EXP):
        if r != bad:
            assert res[r][0][0] == "ok", res[r][0]
    check_a2e([g for _, g in res], 601)


def fused_combine_twice(die, seed: int):
    d = comm.dispatch(die, **dispatch_args(die, seed, "fused", None))
    comm.combine(die, expert_fn(die.die_id, d.x), d.handle, event_id=seed)
    again = outcome(comm.combine, die, expert_fn(die.die_id, d.x), d.handle, event_id=seed)
    return again, moe_step(die, seed + 1, None, "random", EXPERTS, None, protocol="fused")


@pytest.mark.timeout(120)
def test_a_fused_dispatch_is_combined_once(pod):
    res = pod.run(fused_combine_twice, 700)
    for r in range(DIES):  # the combine buffer is single: a second combine would race
        assert res[r][0][0] == "ValueError" and "once" in res[r][0][1], res[r][0]
    check_against_reference([g for _, g in res], 701, None, "random", DIES, EXPERTS,
                            default_placement())  # fmt: skip
