"""`comm.wait.Doze`: the sleeps of a parked loop. One host: every sleep is the poll period and
no progress is made. Peers on another host: every look drives the fabric, and the sleeps after
a ring (or the park's start) begin short and double up to the poll period."""

from __future__ import annotations

from comm.wait import Doze


def test_one_host_sleeps_the_poll_period_and_makes_no_progress():
    doze = Doze(None, 0.5)
    asked = []
    doze.look()
    for rang in (False, True, False):
        assert doze.sleep(lambda t, rang=rang: asked.append(t) or rang) is rang
    assert asked == [0.5, 0.5, 0.5]


def test_remote_peers_make_progress_and_sleep_short_after_a_ring():
    calls = []
    doze = Doze(lambda: calls.append(1), 0.5, first_s=0.001)
    asked = []

    def wait(rang):
        return lambda t: asked.append(t) or rang

    for _ in range(12):  # a park with nobody ringing: 1, 2, 4 ... ms, then the poll period
        doze.look()
        doze.sleep(wait(False))
    assert len(calls) == 12
    assert asked[:4] == [0.001, 0.002, 0.004, 0.008]
    assert asked[-1] == 0.5 and max(asked) == 0.5
    doze.sleep(wait(True))  # a ring: the next sleep is short again
    doze.sleep(wait(False))
    assert asked[-2:] == [0.5, 0.001]
