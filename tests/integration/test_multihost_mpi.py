"""Conformance over MPI: the p2p and all-to-all suites with dies on two emulated hosts whose
regions are reached through `comm.fabric_mpi.MpiFabric` (mpirun, btl/tcp over loopback, store
messages and one-sided pulls), bit-exact against the references, no die polling a mirror.

The default run takes a representative subset (every variant and size class, lane counts,
rejections, the all-to-all protocols with dedup and INT8, A2E / E2A); `pytest -m multihost`
runs the whole suites (docs/usage.md, "Pods over several hosts").
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.integration import test_multihost_alltoall as mha
from tests.integration import test_p2p as base

pytestmark = pytest.mark.timeout(180)
FULL = pytest.mark.multihost  # the rest of the suite: `pytest -m multihost`
HOSTS = (0, 0, 1, 1)
CFG = dict(base.CFG, hosts=HOSTS, fabric="mpi")


@pytest.fixture(scope="module")
def shared(shared_pod_factory):
    return shared_pod_factory(**CFG)


@pytest.fixture
def pod(shared, shared_pod_guard):
    return shared_pod_guard(shared)


def _fabric_facts(die):
    f = die.fab
    return f.kind, f.remote, f.remote_polls, f.pushes, f.publishes


def _check_fabric(pod) -> None:
    for die, (kind, remote, polls, pushes, publishes) in enumerate(pod.run(_fabric_facts)):
        assert kind == "mpi"
        assert remote == [HOSTS[d] != HOSTS[die] for d in range(4)]
        assert polls == 0, f"die {die} polled a mirror {polls} times (rule R1)"
        assert pushes + publishes > 0, f"die {die} never used the fabric"


SIZES = [0, 8, base.SLOT + 1, 3 * base.RING + 123, 2 * base.MiB + 5]


@pytest.mark.parametrize("variant", base.VARIANTS)
def test_every_pair_and_size_over_mpi(pod, variant):
    """Every ordered pair (same-host and cross-host), every size class, 1 and 4 lanes."""
    for cores in (1, 4):
        for nbytes in SIZES:
            for src, dst in base.PAIRS:
                ev = base.next_event()
                res = pod.run(base.xfer, [(src, dst)], nbytes, np.uint8, variant, cores, ev)
                base.assert_payload(res[dst], src, dst, ev, nbytes)
    _check_fabric(pod)


@FULL
@pytest.mark.parametrize("variant", base.VARIANTS)
def test_all_to_all_concurrent_over_mpi(pod, variant):
    for how in ("test_loop", "wait_each"):
        base.test_all_to_all_concurrent(pod, variant, 3 * base.RING + 5, how, "send_first")


@FULL
@pytest.mark.parametrize("variant, case", list(base._mismatch_params())[::3])
def test_mismatch_over_mpi(pod, variant, case):
    base.test_mismatch_fails_on_both_sides_then_pair_usable(pod, variant, case)


@FULL
def test_random_transfers_over_mpi(pod):
    base.test_random_transfers(pod)
    _check_fabric(pod)


def test_failed_run_then_resync_over_mpi(pod):
    base.test_failed_run_mid_transfer_leaves_pod_usable(pod, "mte", "receiver")
    base.test_failed_run_mid_transfer_leaves_pod_usable(pod, "zero-copy", "sender")


# -- the all-to-all over MPI (test_multihost_alltoall.py's checks, an MPI pod) ------------------


@pytest.fixture(scope="module")
def ep_pod():
    n, hosts, combine_dtype = mha.EP_PODS[0]
    cfg = mha.ep_config(n, hosts, combine_dtype, fabric="mpi")
    with mha.Pod.launch(cfg) as pod:
        yield pod


@pytest.fixture
def ep(ep_pod):
    yield ep_pod
    mha.check_fabric(ep_pod)


@pytest.mark.parametrize("dedup", [False, pytest.param(True, marks=FULL)], ids=["plain", "dedup"])
@pytest.mark.parametrize("protocol", ["pull", "fused"])
@pytest.mark.parametrize("quant", [None, "int8"])
def test_dispatch_combine_over_mpi(ep, protocol, quant, dedup):
    mha.test_matches_reference(ep, protocol, quant, dedup)


def test_refusal_over_mpi(ep):
    mha.test_bad_input_is_refused_and_the_pod_stays_usable(ep)


@pytest.mark.parametrize("quant", [pytest.param(None, marks=FULL), "int8"])
def test_a2e_e2a_over_mpi(quant):
    mha.run_a2e_case(quant, "bfloat16", fabric="mpi")
