"""The expert-parallel all-to-all with the dies split over two emulated hosts (MULTIHOST §4).

The conformance checks of `test_alltoall.py`, `test_split_alltoall.py` and
`test_alltoall_faults.py` run again on pods whose dies are on two "hosts" (`fabric="mirror"`):
each die sees the other host's regions as poisoned mirrors, so a row that is not pushed never
arrives, a row read without a pull reads poison, and a guard word stored into a mirror wakes
nobody. Pull and fused dispatch / combine, dedup, INT8, bfloat16 and float32 combine rows,
A2E / E2A through trampolines on either host, refusals and the launcher's resync must stay bit
for bit `comm.reference`; after every test no die polled a mirror (`fab.remote_polls == 0`)
and every die pushed and published over the fabric (the remote path ran). The default run
takes a subset of each suite; `-m multihost` runs the rest.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import comm
from comm.routing import Placement
from memory.errors import PeerTimeout
from runtime import Pod, PodConfig
from tests.integration import test_alltoall as base
from tests.integration import test_alltoall_faults as faults
from tests.integration import test_split_alltoall as split_base

# The whole module is the `multihost` suite (`make test-multihost`): `make test` runs its
# MPI counterpart, test_multihost_mpi.py, which covers the same protocols in less time.
pytestmark = pytest.mark.multihost

H, K, B = base.H, base.K, base.B
SLOW = pytest.mark.multihost  # the full suite: `pytest -m multihost` (CI runs the rest)

# (dies, hosts, combine dtype): an even split, and an uneven one with die 0 alone
EP_PODS = [(4, (0, 0, 1, 1), "bfloat16"), (3, (0, 1, 1), "float32")]


def _facts(die) -> tuple:
    f = die.fab
    return f.kind, list(f.remote), f.remote_polls, f.pushes, f.pulls, f.publishes


def check_fabric(pod: Pod, pulls: bool = False, local: tuple = ()) -> None:
    """Every die: a mirror fabric with the pod's hosts, no poll of a mirror, and pushes and
    publishes to its remote peers (and pulls, `pulls`: a pull protocol ran), but the dies
    `local` (an attention die whose trampoline is on its own host writes nowhere else)."""
    hosts = pod.config.hosts
    want = "mirror" if pod.config.fabric == "mirror" else "mpi"
    for die, (kind, remote, polls, pushes, pulled, publishes) in enumerate(pod.run(_facts)):
        assert kind == want
        assert remote == [h != hosts[die] for h in hosts]
        assert polls == 0, f"die {die} polled a mirror {polls} times (rule R1)"
        if die in local:
            continue
        assert pushes > 0 and publishes > 0, f"die {die}: {pushes} pushes, {publishes} publishes"
        assert pulled > 0 or not pulls, f"die {die}: no pull"


def mirrored(cfg: PodConfig, hosts: tuple) -> PodConfig:
    return dataclasses.replace(cfg, hosts=hosts, fabric="mirror")


def ep_config(n: int, hosts: tuple, combine_dtype: str, fabric: str = "mirror") -> PodConfig:
    return PodConfig(a2a_combine_dtype=combine_dtype, num_dies=n, a2a_max_batch=B, a2a_hidden=H,
                     a2a_topk=K, num_experts=2 * n, a2a_max_local_experts=2 * n, timeout_s=20,
                     hosts=hosts, fabric=fabric)  # fmt: skip


@pytest.fixture(scope="module", params=EP_PODS, ids=lambda p: f"ep{p[0]}-hosts{len(set(p[1]))}")
def ep_pod(request):
    n, hosts, combine_dtype = request.param
    cfg = ep_config(n, hosts, combine_dtype)
    with Pod.launch(cfg) as pod:
        yield pod


@pytest.fixture
def ep(ep_pod):
    """The module's pod; after the test, the fabric checks (`check_fabric`)."""
    yield ep_pod
    check_fabric(ep_pod)


# -- dispatch / combine (test_alltoall.py) --------------------------------------------------------

CASES = ["random", "full", "sends-nothing", "receives-nothing", "one-expert", "same-die",
         "unrouted"]  # fmt: skip
QUICK = ("random", "receives-nothing", "same-die")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dedup", [False, True], ids=["plain", "dedup"])
@pytest.mark.parametrize("protocol", ["pull", "fused"])
@pytest.mark.parametrize("quant", [None, "int8"])
def test_matches_reference(ep, protocol, quant, dedup):
    """Three routing cases, two seeds each, bit for bit against `comm.reference`."""
    n, e = ep.config.num_dies, ep.config.num_experts
    for case in QUICK:
        placement = base.placement_for(case, n, e)
        for seed in range(2):
            res = ep.run(base.moe_step, seed, quant, case, e, placement, 0.0, protocol, dedup)
            base.check_against_reference(res, seed, quant, case, n, e, placement, base.cdt(ep),
                                         dedup)  # fmt: skip


@SLOW
@pytest.mark.timeout(300)
@pytest.mark.parametrize("dedup", [False, True], ids=["plain", "dedup"])
@pytest.mark.parametrize("protocol", ["pull", "fused"])
@pytest.mark.parametrize("quant", [None, "int8"])
@pytest.mark.parametrize("case", CASES)
def test_matches_reference_every_case(ep, protocol, quant, case, dedup):
    base.test_matches_reference(ep, protocol, quant, case, dedup)


@pytest.mark.timeout(120)
def test_back_to_back_alternating_quant_and_a_slow_die(ep):
    base.test_back_to_back_alternating_quant_and_a_slow_die(ep)


@pytest.mark.timeout(120)
def test_the_pull_protocol_pulls(ep):
    n, e = ep.config.num_dies, ep.config.num_experts
    placement = base.placement_for("random", n, e)
    res = ep.run(base.moe_step, 40, "int8", "random", e, placement, 0.0, "pull", False)
    base.check_against_reference(res, 40, "int8", "random", n, e, placement, base.cdt(ep))
    check_fabric(ep, pulls=True)


@pytest.mark.timeout(120)
def test_bad_input_is_refused_and_the_pod_stays_usable(ep):
    base.test_bad_input_is_refused_and_the_pod_stays_usable(ep)


@SLOW
@pytest.mark.timeout(120)
@pytest.mark.parametrize("protocol", ["pull", "fused"])
def test_dedup_on_some_dies_only_is_a_protocol_error_and_the_pod_stays_usable(ep, protocol):
    base.test_dedup_on_some_dies_only_is_a_protocol_error_and_the_pod_stays_usable(ep, protocol)


@SLOW
@pytest.mark.timeout(120)
@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("dedup", [False, True])
@pytest.mark.parametrize("quant", [None, "int8"])
@pytest.mark.parametrize("protocol", ["pull", "fused"])
def test_read_only_and_strided_inputs_are_taken(ep, protocol, quant, dedup, strided):
    base.test_read_only_and_strided_inputs_are_taken(ep, protocol, quant, dedup, strided)


# -- refusals and resync (test_alltoall_faults.py) ------------------------------------------------

FAULT_HOSTS = (0, 0, 1, 1)  # the bad die (faults.BAD = 2) on the second host


@pytest.fixture(scope="module")
def fault_pod():
    cfg = PodConfig(num_dies=faults.DIES, a2a_max_batch=B, a2a_hidden=H, a2a_topk=K,
                    num_experts=faults.EXPERTS, timeout_s=20, hosts=FAULT_HOSTS,
                    fabric="mirror")  # fmt: skip
    with Pod.launch(cfg) as pod:
        yield pod


@pytest.fixture
def fpod(fault_pod):
    yield fault_pod
    check_fabric(fault_pod)


def _some(cases: list, quick: int = 1) -> list:
    """The first `quick` cases in the default run, the rest slow."""
    return [c if i < quick else pytest.param(c, marks=SLOW) for i, c in enumerate(cases)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dedup", [False, True], ids=["plain", "dedup"])
@pytest.mark.parametrize("case", _some(sorted(faults.DISPATCH_CASES)))
@pytest.mark.parametrize("protocol", ["pull", "fused"])
def test_bad_dispatch_input_refused(fpod, protocol, case, dedup):
    faults.test_bad_dispatch_input_on_one_die_refused_and_the_pod_stays_in_step(
        fpod, protocol, case, dedup
    )


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dedup", [False, True], ids=["plain", "dedup"])
@pytest.mark.parametrize("case", _some(sorted(faults.COMBINE_CASES)))
@pytest.mark.parametrize("protocol", ["pull", "fused"])
def test_bad_combine_input_refused(fpod, protocol, case, dedup):
    faults.test_bad_combine_input_on_one_die_refused_and_the_pod_stays_in_step(
        fpod, protocol, case, dedup
    )


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", ["stale", "event"])
@pytest.mark.parametrize("protocol", ["pull", "fused"])
def test_combine_of_another_dispatch_or_event_is_never_silent(fpod, protocol, case):
    faults.test_combine_of_another_dispatch_or_event_is_never_silent(fpod, protocol, case)


@SLOW
@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", sorted(faults.MISPAIRED))
@pytest.mark.parametrize("protocol", ["pull", "fused"])
def test_mispaired_dispatch_fails_on_every_die(fpod, protocol, case):
    faults.test_mispaired_dispatch_fails_on_every_die_and_the_pod_stays_in_step(
        fpod, protocol, case
    )


@pytest.mark.timeout(120)
def test_a_fused_dispatch_is_combined_once(fpod):
    faults.test_a_fused_dispatch_is_combined_once(fpod)


def _stall_after_dispatch(die, protocol: str, seed: int) -> None:
    """Every die dispatches; then die 3 (second host) skips the combine: the others time out."""
    d = comm.dispatch(die, **faults.dispatch_args(die, seed, protocol, None))
    if die.die_id != 3:
        comm.combine(die, base.expert_fn(die.die_id, d.x), d.handle, event_id=seed)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("protocol", ["pull", "fused"])
def test_resync_after_a_failed_run(pod_factory, protocol):
    """A combine a die on the other host never joined fails the run; the launcher's resync
    realigns every die's operation numbers and the next step is exact on every die."""
    pod = pod_factory(num_dies=faults.DIES, a2a_max_batch=B, a2a_hidden=H, a2a_topk=K,
                      num_experts=faults.EXPERTS, timeout_s=1.0, hosts=FAULT_HOSTS,
                      fabric="mirror")  # fmt: skip
    with pytest.raises(PeerTimeout):
        pod.run(_stall_after_dispatch, protocol, 800)
    placement = faults.default_placement()
    for seed in (801, 802):
        res = pod.run(base.moe_step, seed, None, "random", faults.EXPERTS, placement, 0.0,
                      protocol)  # fmt: skip
        base.check_against_reference(res, seed, None, "random", faults.DIES, faults.EXPERTS,
                                     placement)  # fmt: skip
    check_fabric(pod)


# -- A2E / E2A through trampolines (test_alltoall.py, test_alltoall_faults.py) --------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "n_att, n_exp, hosts, local",
    [(2, 4, (0, 0, 0, 1, 1, 1), (0,)), pytest.param(2, 2, (0, 1, 1, 1), (1, 3), marks=SLOW)],
    ids=["2+4", "2+2"],
)
@pytest.mark.parametrize("quant", [None, "int8"])
@pytest.mark.parametrize("combine_dtype", ["bfloat16", "float32"])
def test_a2e_e2a_through_trampolines_match_reference(n_att, n_exp, hosts, local, quant,
                                                     combine_dtype):  # fmt: skip
    """One attention die's trampoline (die n_att + i for attention die i) on its own host, the
    other's on the other host; the dies `local` write only to dies of their own host."""
    run_a2e_case(quant, combine_dtype, n_att, n_exp, hosts, local)


def run_a2e_case(quant, combine_dtype: str, n_att: int = 2, n_exp: int = 4,
                 hosts: tuple = (0, 0, 0, 1, 1, 1), local: tuple = (0,),
                 fabric: str = "mirror") -> None:  # fmt: skip
    """Three A2E / E2A rounds through trampolines on `hosts`, bit-exact (see above)."""
    n, e = n_att + n_exp, 2 * n_exp
    cfg = PodConfig(num_dies=n, a2a_max_batch=B, a2a_hidden=H, a2a_topk=K, num_experts=e,
                    a2a_max_local_experts=e // n_exp, a2a_combine_dtype=combine_dtype,
                    timeout_s=20, hosts=hosts, fabric=fabric)  # fmt: skip
    placement = Placement.default(e, tuple(range(n_att, n)))
    att = list(range(n_att))
    ref = base.ref
    with Pod.launch(cfg) as pod:
        for seed in range(3):
            res = pod.run(base.a2e_step, seed, n_att, e, quant, seed == 2)
            ins = [base.make_inputs(seed, r, e, "random") for r in att]
            douts = ref.a2e_ref([i[0] for i in ins], [i[1] for i in ins], placement, att, quant)
            for d, o in douts.items():
                for f in ("x", "src_rank", "batch_slot", "k_index", "local_expert",
                          "expert_counts"):  # fmt: skip
                    assert np.array_equal(res[d][f], getattr(o, f)), (seed, d, f)
            rows = {d: o.x.astype(np.float32) * o.scales[:, None] if quant == "int8" else o.x
                    for d, o in douts.items()}  # fmt: skip
            eouts = {d: base.expert_fn(d, rows[d]) for d in douts}
            couts = ref.e2a_ref(eouts, douts, [i[1] for i in ins], [i[2] for i in ins], att,
                                combine_dtype)  # fmt: skip
            for r in att:
                assert np.array_equal(res[r]["out"], couts[r]), (seed, r, "e2a")
        check_fabric(pod, local=local)


A2E_HOSTS = (0, 0, 0, 1, 1, 1)  # attention dies 0, 1; trampolines 2 (same host) and 3 (other)


@pytest.fixture(scope="module")
def a2e_pod():
    e = 2 * faults.N_EXP
    cfg = PodConfig(num_dies=faults.N_ATT + faults.N_EXP, a2a_max_batch=B, a2a_hidden=H,
                    a2a_topk=K, num_experts=e, a2a_max_local_experts=e // faults.N_EXP,
                    timeout_s=20, hosts=A2E_HOSTS, fabric="mirror")  # fmt: skip
    with Pod.launch(cfg) as pod:
        yield pod


@pytest.fixture
def apod(a2e_pod):
    yield a2e_pod
    check_fabric(a2e_pod, local=(0,))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", ["x-float64", "expert-repeated"])
def test_a2e_bad_attention_input_raised_then_exact(apod, case):
    faults.test_a2e_bad_attention_input_raised_then_exact(apod, case)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("bad", [2, 3, 5], ids=["trampoline-near", "trampoline-far", "expert"])
def test_e2a_bad_expert_output_refused_and_the_next_step_exact(apod, bad):
    faults.test_e2a_bad_expert_output_refused_and_the_next_step_exact(apod, bad)


# -- split pods: DP domains and micro-batches (test_split_alltoall.py) ---------------------------


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "n_att, n_exp, domains, m, hosts",
    [
        (2, 2, 2, 2, (0, 0, 1, 1)),
        pytest.param(3, 5, 2, 2, (0, 0, 0, 0, 1, 1, 1, 1), marks=SLOW),
        pytest.param(2, 6, 1, 1, (0, 1, 1, 1, 1, 1, 1, 1), marks=SLOW),
    ],
)
def test_domains_and_microbatches_match_the_reference(n_att, n_exp, domains, m, hosts):
    n, e = n_att + n_exp, 2 * n_exp
    split = split_base.Split.make(n, n_att, domains, m)
    with Pod.launch(mirrored(split_base.pod_config(n, n_exp, e), hosts)) as pod:
        for seed, quant in ((1, None), (2, "int8")):
            res = pod.run(split_base.split_step, seed, split, e, quant)
            split_base.check(res, seed, split, e, quant, "bfloat16")
        assert all(r == "ok" for r in pod.run(split_base.colocated_step, 7, split))
        check_fabric(pod)


# -- the KV link (comm.kvlink; test_kvlink.py) ---------------------------------------------------


def _link_over_fabric(die) -> dict:
    """test_kvlink's link, the decode side given its fabric (its acks and probe published)."""
    from comm.kvlink import KVLinkRx
    from tests.integration import test_kvlink as kv

    kv.KVLinkRx = lambda me, lo, own, remote: KVLinkRx(me, lo, own, remote, fab=die.fab)
    try:
        return kv.link_main(die)
    finally:
        kv.KVLinkRx = KVLinkRx


@pytest.mark.timeout(120)
def test_kv_link_to_decode_dies_on_another_host():
    """Prefill die 0 alone on its host pushes KV segments and records into decode dies 1 and 2
    (more transfers than record slots: the acks come back over the fabric), then a failed
    transfer and a probe's echo."""
    from tests.integration import test_kvlink as kv

    cfg = PodConfig(num_dies=3, app_bytes=1 << 20, serve_slot_bytes=4096, timeout_s=20.0,
                    hosts=(0, 1, 1), fabric="mirror")  # fmt: skip
    with Pod.launch(cfg) as pod:
        res = pod.run(_link_over_fabric, timeout_s=60)
        for die in (1, 2):
            got = res[die]["got"]
            assert [c["case"] for c in got] == [i for i, c in enumerate(kv.CASES) if c[0] == die]
            for c in got:  # the crc of what landed in the decode die's pool is the source's
                rec = c["rec"]
                assert rec.status == kv.OK and rec.req == 100 + c["case"] and c["crc_ok"], c
                assert rec.first == 7 + c["case"]
                assert list(rec.drafts) == [3 + c["case"], 4 + c["case"]][: c["case"] % 3]
        failed = res[1]["failed"]
        assert failed.status == kv.SOURCE_FAILED and failed.req == 500
        seq, echo = res[1]["echo"]
        assert seq >= 1 and echo == seq
        check_fabric(pod)
