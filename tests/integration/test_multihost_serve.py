"""Serving over emulated hosts with no iteration rollback: a step after an idle one finishes.

A die parked in the serving loop (every die voted an idle step) wakes on its doorbell when a
peer votes the next step for its own work; over hosts that vote is a store message that lands
in the parked die's region only while the parked die drives its fabric (MPI target progress,
MULTIHOST §0). The engine here has no rollback and no supervisor and a long collective
deadline, so a parked die that never sees the vote hangs the pod (before the fix: `PeerTimeout
... waiting for die 1 fused.flag[0]` after timeout_s) instead of being hidden by a rollback.

Each request starts only once every die is parked (its progress word says "park": a state that
stays until the next vote), and is pinned to one group, so the other die is the parked one.
The tokens must be the one-host engine's. A split pod's expert dies park too (while every
attention die is parked) and wake on the attention dies' parked words, stores of the other
host as well (before the fix: `PeerTimeout ... waiting for die 2 e2a'.done`).
"""

from __future__ import annotations

import pytest

from memory import layout as L
from runtime.engine import Engine
from sched import SamplingParams
from tests.waiting import wait_for

pytest.importorskip("mpi4py")
pytestmark = [pytest.mark.multihost, pytest.mark.timeout(150)]

BASE = dict(timeout_s=30.0, recover=False, rollback=False)
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
# (group, prompt): a 69-token prompt (a 64-token chunk, then 5) and a short one, on each group
REQUESTS = [(0, [7] * 69), (1, [3, 1, 4, 1, 5]), (1, [9] * 69), (0, [2, 7, 1, 8])]
PARK = L.PROGRESS_STATES.index("park")


def all_parked(eng: Engine) -> bool:
    """Every die sleeps in the serving loop's park (it stays there until a vote for the next
    step lands in its region)."""
    for d in range(eng.config.pod_dies):
        r = eng.pod.region(d)
        if L.unpack_progress(r.words[r.layout.serve_word(L.SV_PROGRESS)])[3] != PARK:
            return False
    return True


def serve(eng: Engine, park_first: bool) -> list[list[int]]:
    outs = []
    for group, prompt in REQUESTS:
        if park_first:
            wait_for(lambda: all_parked(eng), what="every die to park")
        t = eng.tracker.track(prompt, GREEDY, group=group)
        eng.tracker.enqueue([t])
        assert t.done.wait(90), f"request {t.id} did not finish"
        assert t.reason == "length", (t.id, t.reason, t.error)
        outs.append(list(t.out))
    return outs


@pytest.mark.parametrize(
    "options, hosts",
    [
        (dict(dies=2, model="small"), (0, 1)),
        (dict(dies=2, expert_dies=2, model="tiny"), (0, 0, 1, 1)),  # a split pod
    ],
    ids=["colocated", "split"],
)
def test_serving_over_hosts_wakes_parked_dies_without_rollback(options, hosts):
    with Engine.launch(**BASE, **options) as eng:
        one = serve(eng, park_first=False)
    with Engine.launch(**BASE, **options, hosts=hosts, fabric="mpi") as eng:
        assert serve(eng, park_first=True) == one
    assert all(len(o) == GREEDY.max_tokens for o in one)
