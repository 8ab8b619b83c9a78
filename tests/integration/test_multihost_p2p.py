"""Point-to-point conformance with the dies split over two emulated hosts (docs/protocols.md §11).

The p2p suite of `test_p2p.py` runs again on a pod whose dies 2 and 3 are on another "host":
`fabric="mirror"` gives each die poisoned mirrors of the other host's regions, so a store that
is not pushed never arrives and a read that is not pulled reads poison. Every pair, variant,
size class, lane count, rejection and resync must stay bit-exact, and no die may poll a mirror
(`fab.remote_polls == 0`, checked after every test). The full suite runs with
`pytest -m multihost`; `make test` runs the subset below (CI's time budget).
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.integration import test_p2p as base
from tests.integration.test_p2p import (  # noqa: F401 - collected here with this module's pod
    test_all_to_all_concurrent,
    test_all_to_all_multi_lane,
    test_back_to_back_same_event_id,
    test_dtypes_and_shapes,
    test_every_pair,
    test_exchange_isend_irecv_wait_send_first,
    test_failed_run_mid_transfer_leaves_pod_usable,
    test_irecv_test_false_until_sent,
    test_isend_test_false_until_received,
    test_many_outstanding_requests_complete_in_issue_order,
    test_mismatch_fails_on_both_sides_then_pair_usable,
    test_protocol_error_through_pod_run,
    test_random_transfers,
    test_sizes,
)

# The whole module is the `multihost` suite (`make test-multihost`): `make test` runs its
# MPI counterpart, test_multihost_mpi.py, which covers the same protocols in less time.
pytestmark = pytest.mark.multihost

HOSTS = (0, 0, 1, 1)
CFG = dict(base.CFG, hosts=HOSTS, fabric="mirror")


@pytest.fixture(scope="module")
def shared(shared_pod_factory):
    return shared_pod_factory(**CFG)


def _fabric_facts(die):
    f = die.fab
    return f.kind, f.remote, f.remote_polls, f.pushes, f.publishes


@pytest.fixture
def pod(shared, shared_pod_guard):
    pod = shared_pod_guard(shared)
    yield pod
    if pod.closed:
        return
    facts = pod.run(_fabric_facts)
    for die, (kind, remote, polls, _, _) in enumerate(facts):
        assert kind == "mirror"
        assert remote == [HOSTS[d] != HOSTS[die] for d in range(4)]
        assert polls == 0, f"die {die} polled a mirror {polls} times (rule R1)"


def test_the_remote_path_ran(pod):
    """Every die pushed and published to its remote peers (the suite above did not run on a
    pod whose fabric quietly mapped everything)."""
    for die, (_, _, _, pushes, publishes) in enumerate(pod.run(_fabric_facts)):
        assert pushes > 0 and publishes > 0, f"die {die}: {pushes} pushes, {publishes} publishes"


@pytest.mark.timeout(60)
def test_resync_after_abandoned_dma_send_across_hosts(pod_factory):
    """The launcher's resync realigns a ring whose sender (die 3) is on the other host: the
    receiver publishes head_ptr and done from its shadow, and the pair moves bytes again."""
    pod = pod_factory(**{**CFG, "timeout_s": 1.0})
    src, dst = 3, 0
    for i in range(4):
        ev = base.next_event()
        with pytest.raises(ValueError, match="gives up"):
            pod.run(base.abandon_dma_send, ev, base.MiB, src, dst)
        tail = int(pod.region(dst).field("desc", src, 0)["tail_ptr"])
        head = int(pod.region(src).field("ack", dst, 0)["head_ptr"])
        assert tail == head, f"iteration {i}: {tail - head} stale chunks left in the ring"
        res = pod.run(base.xfer, [(src, dst)], 100, np.uint8, "mte", 1, ev + 1)
        base.assert_payload(res[dst], src, dst, ev + 1, 100)


@pytest.mark.timeout(120)
def test_bench_p2p_hosts_rows_name_their_hosts(tmp_path):
    """`xpod bench p2p --hosts 2,2 --json F` (mirror fabric: no MPI): rows of the cross-host
    pair (0-2) and of the same-host pair (0-1), each with hosts / cross_host / pair."""
    import json

    from runtime import cli

    out = tmp_path / "p2p.jsonl"
    argv = ["bench", "p2p", "--hosts", "2,2", "--fabric", "mirror", "--sizes", "8,70K",
            "--cores", "1", "--variants", "mte,zero-copy", "--iters-scale", "0.01",
            "--json", str(out)]  # fmt: skip
    assert cli.main(argv) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert {(r["pair"], r["cross_host"]) for r in rows} == {("0-2", True), ("0-1", False)}
    assert all(r["hosts"] == "2,2" and r["fabric"] == "mirror" for r in rows)
    assert len(rows) == 2 * 2 * 2 and all(r["p50_us"] > 0 for r in rows)


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--hosts", "2"], "two hosts"),
        (["--hosts", "2,x"], "not a die count"),
        (["--hosts", "a:1,2"], "name every host"),
        (["--hosts", "1,1", "--variants", "kv-link"], "one host only"),
    ],
)
def test_bench_p2p_bad_hosts_refused(argv, match, capsys):
    from runtime import cli

    try:
        rc = cli.main(["bench", "p2p", *argv])
    except SystemExit as e:
        rc = e.code
    assert rc != 0
    assert match in capsys.readouterr().err
