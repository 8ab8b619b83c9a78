"""Zero-copy and multi-lane transfers after rejected transfers, under CPU contention (issue 8.0).

The bug these tests pin: a zero-copy rendezvous was consumed by count, not by message. After a
rejected zero-copy send (a plain or lane-count-mismatched receiver), some lanes kept a stale
rendezvous; a later multi-lane zero-copy send could take it, write its stripe into an old
buffer (or nowhere), publish its descriptor, and the receiver, which checked lane 0 only, acked
the whole message: both sides reported success while only lane 0's stripe had arrived.

Every payload names its sender (`test_p2p.payload`), and every transfer is checked byte for byte.
"""

from __future__ import annotations

import multiprocessing as mp
import random

import numpy as np
import pytest

import comm
from comm.p2p.lanes import Rx, TxRing
from runtime import ProtocolError
from tests.integration.test_p2p import assert_payload, outcome, payload, who_sent

KiB, MiB = 1 << 10, 1 << 20
LANES = 4
CFG = dict(num_dies=3, lanes=LANES, ring_slots=4, slot_bytes=4 * KiB, app_bytes=8 * MiB,
           timeout_s=20.0)  # fmt: skip

# Every way a transfer 0 -> 1 can be refused: (send kwargs, recv kwargs). nbytes 4096 unless set.
MISMATCHES = {
    "zc-send-plain-recv-4": (dict(variant="zero-copy", cores=4), dict(variant="mte", cores=4)),
    "zc-send-plain-recv-2": (dict(variant="zero-copy", cores=2), dict(variant="mte", cores=2)),
    "zc-send-dma-recv": (dict(variant="zero-copy", cores=3), dict(variant="dma", cores=3)),
    "plain-send-zc-recv": (dict(variant="mte", cores=2), dict(variant="zero-copy", cores=2)),
    "dma-send-zc-recv": (dict(variant="dma", cores=4), dict(variant="zero-copy", cores=4)),
    "zc-lanes-2-vs-3": (dict(variant="zero-copy", cores=2), dict(variant="zero-copy", cores=3)),
    "zc-lanes-4-vs-1": (dict(variant="zero-copy", cores=4), dict(variant="zero-copy", cores=1)),
    "zc-lanes-1-vs-4": (dict(variant="zero-copy", cores=1), dict(variant="zero-copy", cores=4)),
    "zc-event": (dict(variant="zero-copy", cores=3, ev=9), dict(variant="zero-copy", cores=3)),
    "zc-size": (dict(variant="zero-copy", cores=2), dict(variant="zero-copy", cores=2, n=2048)),
    "zc-dtype": (dict(variant="zero-copy", cores=2, dtype=np.int32),
                 dict(variant="zero-copy", cores=2)),
    "mte-lanes": (dict(variant="mte", cores=4), dict(variant="mte", cores=2)),
    "dma-event": (dict(variant="dma", cores=3, ev=9), dict(variant="dma", cores=3)),
}  # fmt: skip


def _buffer(die, n: int, dtype, variant: str) -> np.ndarray:
    """A receive buffer full of 0xEE (in the app area: every variant may use it)."""
    buf = die.alloc(n // np.dtype(dtype).itemsize, dtype)
    buf.view(np.uint8)[:] = 0xEE
    return buf


def refused(die, kind: str, ev: int):
    """Die 0 sends to die 1 with the mismatch `kind`; both must raise ProtocolError."""
    tx, rx = MISMATCHES[kind]
    if die.die_id == 0:
        data = payload(0, 1, ev, tx.get("n", 4096) // np.dtype(tx.get("dtype", np.uint8)).itemsize,
                       tx.get("dtype", np.uint8))  # fmt: skip
        return outcome(comm.send, die, data, 1, tx.get("ev", ev), cores=tx["cores"],
                       variant=tx["variant"])[0]  # fmt: skip
    if die.die_id == 1:
        buf = _buffer(die, rx.get("n", 4096), np.uint8, rx["variant"])
        try:
            return outcome(comm.recv, die, buf, 0, ev, cores=rx["cores"], variant=rx["variant"])[0]
        finally:
            die.free(buf)
    return None


def transfer(die, src: int, dst: int, ev: int, n: int, cores: int, variant: str):
    """One checked transfer src -> dst; the receiver returns what arrived (or None)."""
    me = die.die_id
    if me == src:
        comm.send(die, payload(src, dst, ev, n), dst, ev, cores=cores, variant=variant)
    elif me == dst:
        buf = _buffer(die, n, np.uint8, variant)
        comm.recv(die, buf, src, ev, cores=cores, variant=variant)
        got = buf.copy()
        die.free(buf)
        return got
    return None


def refused_then_late_receiver(die, kind: str):
    """A refused transfer, then a 1-lane zero-copy send whose receiver comes late (the sender
    polls its rendezvous fields first), then a zero-copy send on every lane: each good transfer
    must arrive whole."""
    import time

    out = [refused(die, kind, 1)]
    for ev, n, cores in ((2, 4096, 1), (3, 4096, LANES), (4, 40000, 3)):
        if die.die_id == 1:
            time.sleep(0.02)  # the sender reaches its rendezvous fields first
        out.append(transfer(die, 0, 1, ev, n, cores, "zero-copy"))
    return out


@pytest.fixture(scope="module")
def shared(shared_pod_factory):
    return shared_pod_factory(**CFG)


@pytest.fixture
def pod(shared, shared_pod_guard):
    return shared_pod_guard(shared)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", sorted(MISMATCHES))
def test_refused_transfer_then_multi_lane_zero_copy_arrives_whole(pod, kind):
    res = pod.run(refused_then_late_receiver, kind)
    assert res[0][0] == res[1][0] == "ProtocolError", (res[0][0], res[1][0])
    for got, ev, n in zip(res[1][1:], (2, 3, 4), (4096, 4096, 40000), strict=True):
        assert_payload(got, 0, 1, ev, n)


# -- mismatches, then mixed traffic, under CPU contention ----------------------------------------


def _spin() -> None:  # pragma: no cover - runs in a child process until killed
    while True:
        pass


@pytest.fixture
def busy_cores():
    """Two busy-loop processes on the machine's cores for the length of the test."""
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_spin, daemon=True) for _ in range(2)]
    for p in procs:
        p.start()
    yield
    for p in procs:
        p.kill()
    for p in procs:
        p.join(5)


def mixed_plan(seed: int, count: int) -> list[tuple]:
    """(variant, cores, nbytes, src, dst) of `count` transfers; event id = index (so repeated
    runs reuse the same event ids, as the issue's reproduction does)."""
    rng = random.Random(seed)
    sizes = [8, 1000, 4096, 13377, 40000, 49152]
    return [
        (
            rng.choice(["mte", "dma", "zero-copy"]),
            rng.randint(1, LANES),
            rng.choice([*sizes, rng.randint(8, 49152)]),
            *rng.choice([(0, 1), (1, 0), (2, 1), (0, 2)]),
        )
        for _ in range(count)
    ]


def mismatches_then_mixed(die, seed: int, count: int):
    """Every mismatch kind (both sides must raise), then `count` mixed transfers; returns the
    refusal outcomes and every wrong transfer as (index, plan row, first bad byte, last+1)."""
    refusals = [refused(die, kind, 1000 + i) for i, kind in enumerate(sorted(MISMATCHES))]
    bad = []
    for i, (variant, cores, n, src, dst) in enumerate(mixed_plan(seed, count)):
        got = transfer(die, src, dst, i, n, cores, variant)
        if got is not None:
            want = payload(src, dst, i, n)
            if not np.array_equal(got, want):
                wrong = np.flatnonzero(got != want)
                bad.append((i, variant, cores, n, src, dst, int(wrong[0]), int(wrong[-1]) + 1,
                            who_sent(got)))  # fmt: skip
    return refusals, bad


@pytest.mark.timeout(300)
def test_mismatches_then_mixed_multi_lane_traffic_under_contention(pod_factory, busy_cores):
    pod = pod_factory(**CFG)
    rounds = 20
    for r in range(rounds):
        seed = r % 2  # repeated plans: the same event ids again on the same pod
        res = pod.run(mismatches_then_mixed, seed, 120, timeout_s=120)
        refusals = [x[0] for x in res[:2]]
        assert refusals[0] == refusals[1] == ["ProtocolError"] * len(MISMATCHES), refusals
        bad = [row for die_res in res for row in die_res[1]]
        assert not bad, f"round {r}: transfers reported success but arrived wrong: {bad[:4]}"


# -- the receiver checks every lane of the message it completes ----------------------------------


def forged_lane_send(die, lane_to_forge: int | None):
    """Die 0 sends a 4-lane ring message whose lane `lane_to_forge` claims an older message (as a
    desynchronised lane would); die 1's recv must raise instead of acking it."""
    me = die.die_id
    if me == 0:
        original = TxRing.__init__

        def forged(self, ep, dst, lane, src, lo, hi, seq, *rest):
            original(self, ep, dst, lane, src, lo, hi, seq - (lane == lane_to_forge), *rest)

        TxRing.__init__ = forged
        try:  # the sender's own fate (ok, timeout, aborted) does not matter here
            return outcome(comm.send, die, payload(0, 1, 5, 8192), 1, 5, cores=LANES)[0]
        finally:
            TxRing.__init__ = original
    if me == 1:
        buf = np.zeros(8192, np.uint8)
        comm.recv(die, buf, 0, 5, cores=LANES)
        return buf
    return None


@pytest.mark.timeout(60)
@pytest.mark.parametrize("lane", [1, 3])
def test_receiver_refuses_a_lane_of_another_message(pod_factory, lane):
    pod = pod_factory(**{**CFG, "timeout_s": 2.0})
    with pytest.raises(ProtocolError) as ei:
        pod.run(forged_lane_send, lane)
    assert ei.value.die_id == 1
    msg = str(ei.value)
    assert f"lane {lane} holds message" in msg and "lanes out of step" in msg, msg
    # after the failed run's resync the pair carries whole messages again
    res = pod.run(forged_lane_send, None)
    assert res[0] == "ok", res
    assert_payload(res[1], 0, 1, 5, 8192)


# -- a refused multi-lane message keeps the pair in step, however slowly the receiver drains ----


def refused_then_drained_slowly(die, kind: str, n: int, cores: int, variant: str):
    """A refused `kind` transfer whose receiver drains every lane but lane 0 late (it acks lane
    0 first), then a good transfer 0 -> 1 of `n` bytes on `cores` lanes: the sender must not
    start it before every lane of the refused message is acked, or the slow lanes hold a chunk
    of each message and the good one is taken for the refused one (wrong bytes, or a lane out
    of step)."""
    import time

    if die.die_id == 1:
        original = Rx.pump
        slept = set()

        def slow_drain(self):
            if self.mode == 0 and self.lane > 0 and id(self) not in slept:
                time.sleep(0.05)  # lane 0 is acked by now: the sender has seen the refusal
                slept.add(id(self))
            return original(self)

        Rx.pump = slow_drain
    try:
        out = [refused(die, kind, 5)]
    finally:
        if die.die_id == 1:
            Rx.pump = original
    out.append(transfer(die, 0, 1, 6, n, cores, variant))
    return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "kind, n, cores, variant",
    [
        ("mte-lanes", 4 * 4096, 4, "mte"),
        ("mte-lanes", 4096, 3, "zero-copy"),
        ("dma-event", 3 * 4096, 3, "dma"),
        ("dma-send-zc-recv", 4 * 4096, 4, "mte"),
        ("plain-send-zc-recv", 2 * 4096, 2, "mte"),
    ],
)
def test_a_refused_message_is_drained_on_every_lane_before_the_next(pod, kind, n, cores, variant):
    res = pod.run(refused_then_drained_slowly, kind, n, cores, variant)
    assert res[0][0] == res[1][0] == "ProtocolError", (res[0][0], res[1][0])
    assert_payload(res[1][1], 0, 1, 6, n)
