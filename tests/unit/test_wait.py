"""comm.wait: wait_ge over an int64 memoryview of a bytearray (no shared memory needed)."""

from __future__ import annotations

import threading
import time

import pytest

from comm.wait import WaitContext, WaitPolicy, wait_ge
from memory import ConfigError, PeerTimeout, PodAborted, PodError


def words(n: int = 16) -> memoryview:
    return memoryview(bytearray(8 * n)).cast("q")


FAST = WaitPolicy(spin_polls=100, yield_every=1, backoff_after_s=0.001, sleep_s=0.0001,
                  timeout_s=5.0, check_every=4)  # fmt: skip


def test_returns_at_once_when_the_value_is_there():
    w = words()
    w[3] = 10
    assert wait_ge(w, 3, 10, FAST, WaitContext(0), 1, "desc.tail_ptr") == 10
    assert wait_ge(w, 3, 5, FAST, WaitContext(0), 1, "desc.tail_ptr") == 10


def test_returns_after_another_thread_publishes():
    w = words()

    def publish():
        time.sleep(0.05)
        w[5] = 3

    t = threading.Thread(target=publish)
    t.start()
    assert wait_ge(w, 5, 3, FAST, WaitContext(2), 0, "ack.done") == 3  # (not PeerTimeout)
    t.join()


@pytest.mark.parametrize("policy", [
    WaitPolicy(timeout_s=0.05),
    WaitPolicy(spin_polls=1000, yield_every=64, timeout_s=0.05),
    WaitPolicy(spin_polls=0, yield_every=1, backoff_after_s=0.0, timeout_s=0.05, check_every=1),
])  # fmt: skip
def test_timeout_names_die_peer_field_expected_and_seen(policy):
    w = words()
    w[2] = 4
    t0 = time.monotonic()
    with pytest.raises(PeerTimeout) as ei:
        wait_ge(w, 2, 9, policy, WaitContext(3), 5, "ack.head_ptr")
    waited = time.monotonic() - t0
    assert 0.05 <= waited < 100 * 0.05  # its 0.05 s deadline, not another one
    msg = str(ei.value)
    assert "die 3" in msg and "die 5" in msg and "ack.head_ptr" in msg
    assert ">= 9" in msg and "seen 4" in msg and "0.05" in msg
    assert isinstance(ei.value, TimeoutError) and isinstance(ei.value, PodError)


def test_abort_word_change_raises_pod_aborted():
    w = words()
    ctl = words(8)
    ctl[5] = 7  # abort epoch
    pol = FAST

    def abort():
        time.sleep(0.05)
        ctl[5] = 8

    t = threading.Thread(target=abort)
    t.start()
    with pytest.raises(PodAborted) as ei:  # not PeerTimeout: the abort, not the deadline
        wait_ge(w, 1, 1, pol, WaitContext(1, (ctl, 5, 7)), 0, "sync.count")
    t.join()
    assert "die 1" in str(ei.value) and "sync.count" in str(ei.value)


def test_abort_already_bumped_before_the_wait():
    w = words()
    ctl = words(8)
    ctl[5] = 1
    with pytest.raises(PodAborted):
        wait_ge(w, 0, 1, FAST, WaitContext(0, (ctl, 5, 0)), 1, "desc.tail_ptr")


def test_unchanged_abort_word_does_not_abort():
    w = words()
    ctl = words(8)
    ctl[5] = 2
    with pytest.raises(PeerTimeout):
        wait_ge(w, 0, 1, FAST.with_timeout(0.05), WaitContext(0, (ctl, 5, 2)), 1, "x")


def test_present_value_wins_over_abort():
    w = words()
    w[0] = 1
    ctl = words(8)
    ctl[5] = 1
    assert wait_ge(w, 0, 1, FAST, WaitContext(0, (ctl, 5, 0)), 1, "x") == 1


def test_policy_validation():
    with pytest.raises(ConfigError, match="yield_every"):
        WaitPolicy(yield_every=0)
    with pytest.raises(ConfigError, match="check_every"):
        WaitPolicy(check_every=0)
    with pytest.raises(ConfigError, match="spin_polls"):
        WaitPolicy(spin_polls=-1)
    with pytest.raises(ConfigError, match="timeout_s"):
        WaitPolicy(timeout_s=-1)
    assert WaitPolicy(spin_polls=0).name == "yield"
    assert WaitPolicy(spin_polls=5).name == "spin"


def test_for_pod_adapts_to_dies_per_core():
    assert WaitPolicy.for_pod(2, 2).spin_polls > 0
    p = WaitPolicy.for_pod(16, 2, timeout_s=7.0)
    assert p.spin_polls == 0 and p.yield_every == 1 and p.timeout_s == 7.0
    assert p.with_timeout(1.0).timeout_s == 1.0
