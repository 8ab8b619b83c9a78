"""Point-to-point send / recv between dies (docs/protocols.md §4): data, errors, async, trace.

Payloads name their sender: int64 word i of a message from `src` to `dst` with event id `ev`
is `src << 56 | dst << 48 | (ev & 0xFFFF) << 32 | i`, so a wrong route or a stale message is
visible in the first word that differs (see `who_sent`).

The shared pod uses small rings (4 slots x 4 KiB) so that messages of a few tens of KiB already
stream through the ring under credit flow control.
"""

from __future__ import annotations

import itertools
import json
import os
import time

import numpy as np
import pytest

import comm
from runtime import PeerTimeout, PodError, ProtocolError

KiB, MiB = 1 << 10, 1 << 20
SLOTS, SLOT = 4, 4 * KiB
RING = SLOTS * SLOT
LANES = 4
CFG = dict(num_dies=4, lanes=LANES, ring_slots=SLOTS, slot_bytes=SLOT, app_bytes=16 * MiB,
           timeout_s=20.0)  # fmt: skip
VARIANTS = ["mte", "dma", "zero-copy"]
_events = itertools.count(100)


def next_event() -> int:
    return next(_events)


@pytest.fixture(scope="module")
def shared(shared_pod_factory):
    return shared_pod_factory(**CFG)


@pytest.fixture
def pod(shared, shared_pod_guard):
    return shared_pod_guard(shared)


# -- payloads --------------------------------------------------------------------------------------


def payload(src: int, dst: int, ev: int, shape, dtype=np.uint8) -> np.ndarray:
    dtype = np.dtype(dtype)
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    head = np.int64(src << 56 | dst << 48 | (ev & 0xFFFF) << 32)
    words = head | np.arange(-(-nbytes // 8), dtype=np.int64)
    return words.view(np.uint8)[:nbytes].copy().view(dtype).reshape(shape)


def who_sent(buf: np.ndarray) -> str:
    raw = np.ascontiguousarray(buf).reshape(-1).view(np.uint8)
    if raw.size < 8:
        return f"(short message {raw.tobytes().hex()})"
    w = int(raw[:8].view(np.int64)[0])
    src, dst, ev = w >> 56 & 0xFF, w >> 48 & 0xFF, w >> 32 & 0xFFFF
    return f"src {src} dst {dst} event {ev} word {w & 0xFFFFFFFF}"


def assert_payload(got, src, dst, ev, shape, dtype=np.uint8):
    want = payload(src, dst, ev, shape, dtype)
    assert got is not None, f"die {dst} returned nothing"
    assert got.shape == want.shape and got.dtype == want.dtype
    g, w = got.reshape(-1).view(np.uint8), want.reshape(-1).view(np.uint8)
    if not np.array_equal(g, w):
        bad = int(np.flatnonzero(g != w)[0])
        raise AssertionError(
            f"{src}->{dst} event {ev}: first wrong byte {bad} of {w.size}; received message"
            f" starts as {who_sent(got)}"
        )


def outcome(fn, *args, **kwargs):
    """('ok', result) or (exception type name, message): both sides report, nobody raises."""
    try:
        return ("ok", fn(*args, **kwargs))
    except (PodError, ValueError, TypeError) as e:
        return (type(e).__name__, str(e))


def recv_buffer(die, shape, dtype, variant):
    """A receive buffer full of 0xEE (zero-copy ones from the app area)."""
    zc = variant == "zero-copy"
    buf = die.alloc(shape, dtype) if zc else np.empty(shape, dtype)
    buf.reshape(-1).view(np.uint8)[:] = 0xEE
    return buf


def release(die, buf, variant):
    if variant == "zero-copy":
        die.free(buf)


# -- functions run on the dies ---------------------------------------------------------------------


def xfer(die, pairs, shape, dtype, variant, cores, ev):
    """Each (src, dst) pair moves one message (a die is in at most one); returns what dst got."""
    me = die.die_id
    for src, dst in pairs:
        if me == src:
            comm.send(die, payload(src, dst, ev, shape, dtype), dst, ev, cores=cores,
                      variant=variant)  # fmt: skip
        elif me == dst:
            buf = recv_buffer(die, shape, dtype, variant)
            out = comm.recv(die, buf, src, ev, cores=cores, variant=variant)
            assert out is buf or out is None
            got = buf.copy()
            release(die, buf, variant)
            return got
    return None


def waitall(reqs, how):
    if how == "wait_each":
        for r in reqs:
            r.wait()
        return
    deadline = time.monotonic() + 30.0
    pending = list(reqs)
    while pending:
        pending = [r for r in pending if not r.test()]
        if pending:
            assert time.monotonic() < deadline, "waitall: no progress for 30 s"
            os.sched_yield()


def all_to_all(die, nbytes, variant, cores, ev, how, order):
    me, n = die.die_id, die.num_dies
    peers = [p for p in range(n) if p != me]
    bufs = {p: recv_buffer(die, nbytes, np.uint8, variant) for p in peers}
    data = {p: payload(me, p, ev, nbytes) for p in peers}

    def post_recvs():
        return [comm.irecv(die, bufs[p], p, ev, cores=cores, variant=variant) for p in peers]

    def post_sends():
        # rotate the destinations so that not every die sends to die 0 first
        dsts = peers[me % len(peers) :] + peers[: me % len(peers)]
        return [comm.isend(die, data[p], p, ev, cores=cores, variant=variant) for p in dsts]

    first, second = (post_recvs, post_sends) if order == "recv_first" else (post_sends, post_recvs)
    reqs = first() + second()
    waitall(reqs, how)
    got = {p: bufs[p].copy() for p in peers}
    for p in peers:
        release(die, bufs[p], variant)
    return got


def async_semantics(die, nbytes, variant, ev):
    """Die 1 posts irecv before die 0 sends: test() is False until the data is there."""
    me = die.die_id
    if me == 1:
        buf = recv_buffer(die, nbytes, np.uint8, variant)
        req = comm.irecv(die, buf, 0, ev, variant=variant)
        early = [req.test() for _ in range(50)]
        die.barrier()  # die 0 sends only after this
        deadline = time.monotonic() + 20
        polls = 0
        while not req.test():
            polls += 1
            assert time.monotonic() < deadline
            time.sleep(0.0002)
        again = req.test()
        req.wait()  # a completed request waits no more
        got = buf.copy()
        release(die, buf, variant)
        return early, again, got
    if me == 0:
        die.barrier()
        req = comm.isend(die, payload(0, 1, ev, nbytes), 1, ev, variant=variant)
        req.wait()
        return req.test()
    die.barrier()
    return None


def isend_before_recv(die, nbytes, variant, ev):
    """Die 0 isends before die 1 has posted anything: test() stays False until die 1 receives."""
    me = die.die_id
    if me == 0:
        req = comm.isend(die, payload(0, 1, ev, nbytes), 1, ev, variant=variant)
        time.sleep(0.05)
        early = [req.test() for _ in range(20)]
        die.barrier()
        req.wait()
        return early, req.test()
    if me == 1:
        die.barrier()
        buf = recv_buffer(die, nbytes, np.uint8, variant)
        comm.recv(die, buf, 0, ev, variant=variant)
        got = buf.copy()
        release(die, buf, variant)
        return got
    die.barrier()
    return None


def repeated_event(die, count, nbytes, variants, ev):
    """`count` back-to-back messages 0 -> 1, all with the same event id, variants cycling."""
    me = die.die_id
    got = []
    for k in range(count):
        variant = variants[k % len(variants)]
        if me == 0:
            comm.send(die, payload(0, 1, k, nbytes), 1, ev, variant=variant)
        elif me == 1:
            buf = recv_buffer(die, nbytes, np.uint8, variant)
            comm.recv(die, buf, 0, ev, variant=variant)
            got.append(buf.copy())
            release(die, buf, variant)
    return got


def pipelined(die, count, nbytes, variant, ev, reverse):
    """Die 0 posts `count` isends at once; die 1 posts the irecvs and waits them in any order."""
    me = die.die_id
    if me == 0:
        reqs = [comm.isend(die, payload(0, 1, ev + k, nbytes), 1, ev + k, variant=variant)
                for k in range(count)]  # fmt: skip
        for r in reqs:
            r.wait()
        return None
    if me == 1:
        bufs = [recv_buffer(die, nbytes, np.uint8, variant) for _ in range(count)]
        reqs = [comm.irecv(die, bufs[k], 0, ev + k, variant=variant) for k in range(count)]
        for r in reversed(reqs) if reverse else reqs:
            r.wait()
        got = [b.copy() for b in bufs]
        for b in bufs:
            release(die, b, variant)
        return got
    return None


def exchange(die, nbytes, variant, ev):
    """Dies 0 and 1 send each other a message at once: isend, irecv, wait send then recv."""
    me = die.die_id
    if me > 1:
        return None
    peer = 1 - me
    buf = recv_buffer(die, nbytes, np.uint8, variant)
    s = comm.isend(die, payload(me, peer, ev, nbytes), peer, ev, variant=variant)
    r = comm.irecv(die, buf, peer, ev, variant=variant)
    s.wait()
    r.wait()
    got = buf.copy()
    release(die, buf, variant)
    return got


# Mismatched send / recv pairs: (send kwargs, recv kwargs); shapes in elements.
MISMATCH = {
    "dtype": (dict(shape=64, dtype=np.float32), dict(shape=64, dtype=np.int32)),
    "size": (dict(shape=100), dict(shape=200)),
    "size-streamed": (dict(shape=3 * RING + 123), dict(shape=2 * RING)),
    "event": (dict(shape=64, ev=8), dict(shape=64, ev=7)),
    "cores": (dict(shape=5000, cores=2), dict(shape=5000, cores=1)),
    "cores-rev": (dict(shape=5000, cores=1), dict(shape=5000, cores=4)),
    "variant-zc-recv": (dict(shape=3000, variant="mte"), dict(shape=3000, variant="zero-copy")),
    "variant-dma-zc-recv": (dict(shape=3000, variant="dma"),
                            dict(shape=3000, variant="zero-copy")),
}  # fmt: skip


def mismatched_then_good(die, case, variant, ev):
    me = die.die_id
    if me > 1:
        return None
    tx, rx = MISMATCH[case]
    first = None
    if me == 0:
        first = outcome(
            comm.send, die, payload(0, 1, tx.get("ev", ev), tx["shape"], tx.get("dtype", np.uint8)),
            1, tx.get("ev", ev), cores=tx.get("cores", 1), variant=tx.get("variant", variant),
        )  # fmt: skip
    else:
        rv = rx.get("variant", variant)
        buf = recv_buffer(die, rx["shape"], rx.get("dtype", np.uint8), rv)
        first = outcome(comm.recv, die, buf, 0, rx.get("ev", ev), cores=rx.get("cores", 1),
                        variant=rv)  # fmt: skip
        release(die, buf, rv)
    # the pair must still work: a correct transfer, same variant, a new event id
    second = xfer(die, [(0, 1)], 1000, np.uint8, variant, 1, ev + 1)
    return first, second


def bad_input(die, what, variant, ev):
    """Die 0 makes a bad call (which must raise before anything is sent), then a good one."""
    me = die.die_id
    if me > 1:
        return None
    errors = []
    if me == 0:
        good = payload(0, 1, ev, 256)
        bad_calls = {
            "non-contiguous": lambda: comm.send(die, payload(0, 1, ev, 512)[::2], 1, ev,
                                                variant=variant),
            "object": lambda: comm.send(die, np.array([1, "x"], dtype=object), 1, ev,
                                        variant=variant),
            "list": lambda: comm.send(die, [1, 2, 3], 1, ev, variant=variant),
            "isend-non-contiguous": lambda: comm.isend(die, np.zeros((16, 16))[:, 0], 1, ev,
                                                       variant=variant),
        }  # fmt: skip
        if what in bad_calls:
            errors.append(outcome(bad_calls[what]))
        comm.send(die, good, 1, ev, variant=variant)
        return errors, None
    buf = recv_buffer(die, 256, np.uint8, variant)
    if what == "recv-non-contiguous":
        errors.append(outcome(comm.recv, die, np.zeros(512, np.uint8)[::2], 0, ev, variant=variant))
    if what == "recv-read-only":
        ro = np.zeros(256, np.uint8)
        ro.flags.writeable = False
        errors.append(outcome(comm.recv, die, ro, 0, ev, variant=variant))
    comm.recv(die, buf, 0, ev, variant=variant)
    got = buf.copy()
    release(die, buf, variant)
    return errors, got


def bad_peers_and_args(die, variant):
    """Every call here must raise ValueError at once; returns [(label, outcome)]."""
    me, n = die.die_id, die.num_dies
    buf = die.alloc(64, np.uint8)
    calls = []
    for peer in (-1, n, n + 7, me):
        for name, fn in (("send", comm.send), ("recv", comm.recv), ("isend", comm.isend),
                         ("irecv", comm.irecv)):  # fmt: skip
            calls.append((f"{name} peer {peer}", lambda fn=fn, peer=peer: fn(
                die, buf, peer, 1, variant=variant)))  # fmt: skip
    other = (me + 1) % n
    for cores in (0, LANES + 1, -1):
        calls.append(
            (
                f"send cores {cores}",
                lambda c=cores: comm.send(die, buf, other, 1, cores=c, variant=variant),
            )
        )
        calls.append(
            (
                f"recv cores {cores}",
                lambda c=cores: comm.recv(die, buf, other, 1, cores=c, variant=variant),
            )
        )
    for ev in (-1, 1 << 62, 1.5):
        calls.append(
            (f"send event {ev}", lambda e=ev: comm.send(die, buf, other, e, variant=variant))
        )
        calls.append(
            (f"recv event {ev}", lambda e=ev: comm.recv(die, buf, other, e, variant=variant))
        )
    calls.append(("send variant bogus", lambda: comm.send(die, buf, other, 1, variant="bogus")))
    calls.append(("recv variant bogus", lambda: comm.recv(die, buf, other, 1, variant="bogus")))
    out = [(label, outcome(fn)) for label, fn in calls]
    die.free(buf)
    return out


def zero_copy_outside_app(die, ev):
    me = die.die_id
    if me == 0:
        comm.send(die, payload(0, 1, ev, 4096), 1, ev, variant="zero-copy")
        return None
    if me == 1:
        errors = [
            outcome(comm.recv, die, np.zeros(4096, np.uint8), 0, ev, variant="zero-copy"),
            outcome(comm.irecv, die, np.zeros(4096, np.uint8), 0, ev, variant="zero-copy"),
            outcome(comm.recv, die, die.region.managed[:4096], 0, ev, variant="zero-copy"),
        ]
        buf = die.alloc(4096, np.uint8)
        comm.recv(die, buf, 0, ev, variant="zero-copy")
        got = buf.copy()
        die.free(buf)
        return errors, got
    return None


def silent_peer(die, variant, direction, nbytes):
    """Die 0 sends to / receives from die 1, which never answers (it returns at once)."""
    if die.die_id != 0:
        return die.die_id
    t0 = time.monotonic()
    if direction == "recv":
        buf = recv_buffer(die, nbytes, np.uint8, variant)
        res = outcome(comm.recv, die, buf, 1, 5, variant=variant)
    else:
        res = outcome(comm.send, die, payload(0, 1, 5, nbytes), 1, 5, variant=variant)
    return res, time.monotonic() - t0


def traced_xfer(die, nbytes, variant, cores, ev):
    return xfer(die, [(0, 1)], nbytes, np.uint8, variant, cores, ev)


# -- data: every variant, core count and size -----------------------------------------------------

SIZES = [0, 1, 8, 63, 65, 4096, SLOT, SLOT + 1, 3 * RING + 123, 100_003, 2 * MiB + 5]
SIZES = sorted(set(SIZES))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("nbytes", SIZES)
@pytest.mark.parametrize("cores", [1, 2, 4])
@pytest.mark.parametrize("variant", VARIANTS)
def test_sizes(pod, variant, cores, nbytes):
    ev = next_event()
    res = pod.run(xfer, [(0, 1), (3, 2)], nbytes, np.uint8, variant, cores, ev)
    assert_payload(res[1], 0, 1, ev, nbytes)
    assert_payload(res[2], 3, 2, ev, nbytes)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "shape, dtype",
    [
        ((1000,), np.float32),
        ((3, 5, 7), np.float32),
        ((129, 33), np.int64),
        ((2, 3, 4, 5), np.uint8),
        ((17, 4096), np.uint8),  # 17 slots: streams through the ring
        ((64, 64), np.float16),
        ((10, 3), np.complex128),
        ((0, 5), np.float32),
        ((3,), np.dtype([("a", "<i4"), ("b", "<f8")])),
    ],
    ids=lambda v: str(v) if not isinstance(v, tuple) else "x".join(map(str, v)),
)
@pytest.mark.parametrize("variant", VARIANTS)
def test_dtypes_and_shapes(pod, variant, shape, dtype):
    ev = next_event()
    res = pod.run(xfer, [(2, 0)], shape, dtype, variant, 2, ev)
    assert_payload(res[0], 2, 0, ev, shape, dtype)


PAIRS = [(i, j) for i in range(4) for j in range(4) if i != j]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("src, dst", PAIRS)
def test_every_pair(pod, variant, src, dst):
    ev = next_event()
    nbytes = 2 * RING + 77  # more than a ring: credits flow on this pair's fields
    res = pod.run(xfer, [(src, dst)], nbytes, np.uint8, variant, 2, ev)
    assert_payload(res[dst], src, dst, ev, nbytes)


@pytest.mark.timeout(60)
def test_event_id_limits(pod):
    for ev in (0, (1 << 62) - 1):
        res = pod.run(xfer, [(0, 1)], 64, np.uint8, "mte", 1, ev)
        assert_payload(res[1], 0, 1, ev, 64)
    res = pod.run(xfer, [(0, 1)], 64, np.uint8, "mte", 1, np.int64(5))
    assert_payload(res[1], 0, 1, 5, 64)


# -- concurrency and async -------------------------------------------------------------------------


@pytest.mark.timeout(90)
@pytest.mark.parametrize("order", ["recv_first", "send_first"])
@pytest.mark.parametrize("how", ["test_loop", "wait_each"])
@pytest.mark.parametrize("nbytes", [100, 3 * RING + 5])
@pytest.mark.parametrize("variant", VARIANTS)
def test_all_to_all_concurrent(pod, variant, nbytes, how, order):
    ev = next_event()
    res = pod.run(all_to_all, nbytes, variant, 1, ev, how, order)
    for dst, got in enumerate(res):
        assert sorted(got) == [p for p in range(4) if p != dst]
        for src, buf in got.items():
            assert_payload(buf, src, dst, ev, nbytes)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("variant", VARIANTS)
def test_all_to_all_multi_lane(pod, variant):
    ev = next_event()
    nbytes = 5 * RING + 3
    res = pod.run(all_to_all, nbytes, variant, 4, ev, "test_loop", "recv_first")
    for dst, got in enumerate(res):
        for src, buf in got.items():
            assert_payload(buf, src, dst, ev, nbytes)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("nbytes", [8, 3 * RING + 1])
@pytest.mark.parametrize("variant", VARIANTS)
def test_exchange_isend_irecv_wait_send_first(pod, variant, nbytes):
    ev = next_event()
    res = pod.run(exchange, nbytes, variant, ev)
    assert_payload(res[0], 1, 0, ev, nbytes)
    assert_payload(res[1], 0, 1, ev, nbytes)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("nbytes", [8, 3 * RING + 1])
@pytest.mark.parametrize("variant", VARIANTS)
def test_irecv_test_false_until_sent(pod, variant, nbytes):
    ev = next_event()
    res = pod.run(async_semantics, nbytes, variant, ev)
    early, again, got = res[1]
    assert not any(early), "test() returned True before the sender posted anything"
    assert again is True
    assert_payload(got, 0, 1, ev, nbytes)
    assert res[0] is True


@pytest.mark.timeout(60)
@pytest.mark.parametrize("nbytes", [8, 3 * RING + 1])
@pytest.mark.parametrize("variant", VARIANTS)
def test_isend_test_false_until_received(pod, variant, nbytes):
    ev = next_event()
    res = pod.run(isend_before_recv, nbytes, variant, ev)
    early, final = res[0]
    assert not any(early), "isend completed before the receiver posted its recv"
    assert final is True
    assert_payload(res[1], 0, 1, ev, nbytes)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "variants",
    [["mte"], ["dma"], ["zero-copy"], ["mte", "dma", "zero-copy", "dma", "mte"]],
    ids=["mte", "dma", "zero-copy", "mixed"],
)
@pytest.mark.parametrize("nbytes", [8, RING + 9])
def test_back_to_back_same_event_id(pod, variants, nbytes):
    ev = next_event()
    count = 12
    res = pod.run(repeated_event, count, nbytes, variants, ev)
    assert len(res[1]) == count
    for k, got in enumerate(res[1]):
        assert_payload(got, 0, 1, k, nbytes)  # in order, none lost or repeated


@pytest.mark.timeout(60)
@pytest.mark.parametrize("reverse", [False, True], ids=["in-order", "reversed"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_many_outstanding_requests_complete_in_issue_order(pod, variant, reverse):
    ev = next_event() * 100
    res = pod.run(pipelined, 6, RING + 17, variant, ev, reverse)
    for k, got in enumerate(res[1]):
        assert_payload(got, 0, 1, ev + k, RING + 17)


# -- bad input: refused before anything moves, and the pod stays usable --------------------------


def _mismatch_params():
    for variant in VARIANTS:
        for case in sorted(MISMATCH):
            if case.startswith("variant") and variant != "zero-copy":
                continue  # the variant cases fix their own variants
            yield pytest.param(variant, case, id=f"{variant}-{case}")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("variant, case", list(_mismatch_params()))
def test_mismatch_fails_on_both_sides_then_pair_usable(pod, variant, case):
    check_mismatch(pod, variant, case)


def check_mismatch(pod, variant, case):
    ev = next_event()
    res = pod.run(mismatched_then_good, case, variant, ev)
    (tx_kind, tx_msg), tx_second = res[0]
    (rx_kind, rx_msg), rx_second = res[1]
    assert (tx_kind, rx_kind) == ("ProtocolError", "ProtocolError"), (tx_msg, rx_msg)
    for msg in (tx_msg, rx_msg):
        assert "die 0" in msg and "die 1" in msg
    if case == "event":
        for msg in (tx_msg, rx_msg):
            assert "7" in msg and "8" in msg
        assert "event" in rx_msg
    expect_word = {"dtype": "dtype", "size": "size", "size-streamed": "size", "event": "event",
                   "cores": "cores", "cores-rev": "cores", "variant-zc-recv": "variant",
                   "variant-dma-zc-recv": "variant"}[case]  # fmt: skip
    assert expect_word in rx_msg and expect_word in tx_msg
    assert tx_second is None
    assert_payload(rx_second, 0, 1, ev + 1, 1000)


def event_mismatch_raises(die, variant):
    if die.die_id == 0:
        comm.send(die, payload(0, 1, 8, 64), 1, 8, variant=variant)
    elif die.die_id == 1:
        buf = recv_buffer(die, 64, np.uint8, variant)
        try:
            comm.recv(die, buf, 0, 7, variant=variant)
        finally:
            release(die, buf, variant)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("variant", VARIANTS)
def test_protocol_error_through_pod_run(pod, variant):
    with pytest.raises(ProtocolError) as ei:
        pod.run(event_mismatch_raises, variant)
    assert ei.value.die_id in (0, 1)
    assert "7" in str(ei.value) and "8" in str(ei.value)
    ev = next_event()
    assert_payload(pod.run(xfer, [(0, 1)], 64, np.uint8, variant, 1, ev)[1], 0, 1, ev, 64)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("recv_variant", ["mte", "dma"])
def test_zero_copy_send_to_plain_recv_is_a_protocol_error(pod_factory, recv_variant):
    pod = pod_factory(num_dies=2, timeout_s=60.0)
    t0 = time.monotonic()
    res = pod.run(zc_send_plain_recv, recv_variant)
    assert [r[0] for r in res] == ["ProtocolError", "ProtocolError"], res
    assert "zero-copy" in res[0][1] and "zero-copy" in res[1][1], res
    # rejected by the probe, not by the 60 s deadline (half of it: any machine tells them apart)
    assert time.monotonic() - t0 < 30.0
    # the pair is usable afterwards, in every variant and both directions
    for v in VARIANTS:
        for src, dst in ((0, 1), (1, 0)):
            ev = next_event()
            got = pod.run(xfer, [(src, dst)], 100, np.uint8, v, 1, ev)[dst]
            assert_payload(got, src, dst, ev, 100)


# Regression: a zero-copy send with cores < lanes used to consume its unused lanes' rendezvous
# after publishing, and could swallow the receiver's NEXT rendezvous (both sides then timed out).


class DelayAfterPublish(comm.Trace):
    """A die trace that sleeps right after a zero-copy sender lane publishes its descriptor.

    Fault injection through the public trace hook: it widens a window that is normally a few
    microseconds so the old race would happen on every message.
    """

    def rec(self, t_ns, dur_ns, op, step, peer, lane, event_id, nbytes):
        super().rec(t_ns, dur_ns, op, step, peer, lane, event_id, nbytes)
        if op == "zc_send" and step == 3:
            time.sleep(0.005)


def zc_fewer_cores_then_more(die, iters):
    """Die 0 alternates zero-copy sends with cores=1 and cores=lanes to die 1."""
    me = die.die_id
    if me > 1:
        return None
    saved = die.trace
    if me == 0:
        die.trace = DelayAfterPublish(me, enabled=True)
    buf = die.alloc(64, np.uint8) if me == 1 else None
    done = 0
    try:
        for i in range(iters):
            for cores in (1, die.lanes):
                ev = 2 * i + (cores > 1)
                if me == 0:
                    data = payload(0, 1, ev, 64)
                    comm.send(die, data, 1, ev, cores=cores, variant="zero-copy")
                else:
                    comm.recv(die, buf, 0, ev, cores=cores, variant="zero-copy")
                    assert np.array_equal(buf, payload(0, 1, ev, 64)), who_sent(buf)
            done += 1
        return ("ok", done)
    except PodError as e:
        return (type(e).__name__, done, str(e))
    finally:
        die.trace = saved
        if buf is not None:
            die.free(buf)


@pytest.mark.timeout(60)
def test_zero_copy_fewer_cores_than_lanes_then_more(pod_factory):
    pod = pod_factory(**{**CFG, "num_dies": 2, "timeout_s": 1.0})
    res = pod.run(zc_fewer_cores_then_more, 20)
    assert res[0][0] == "ok" and res[1][0] == "ok", res


def zc_send_plain_recv(die, recv_variant):
    if die.die_id == 0:
        return outcome(comm.send, die, payload(0, 1, 3, 100), 1, 3, variant="zero-copy")
    buf = np.zeros(100, np.uint8)
    return outcome(comm.recv, die, buf, 0, 3, variant=recv_variant)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "what, exc",
    [
        ("non-contiguous", "ValueError"),
        ("isend-non-contiguous", "ValueError"),
        ("object", "TypeError"),
        ("list", "TypeError"),
        ("recv-non-contiguous", "ValueError"),
        ("recv-read-only", "ValueError"),
    ],
)
@pytest.mark.parametrize("variant", VARIANTS)
def test_bad_buffer_refused_nothing_sent(pod, variant, what, exc):
    ev = next_event()
    res = pod.run(bad_input, what, variant, ev)
    tx_errors, _ = res[0]
    rx_errors, got = res[1]
    errors = tx_errors + rx_errors
    assert len(errors) == 1 and errors[0][0] == exc, errors
    # the receiver got exactly the good message: the refused one never entered the ring
    assert_payload(got, 0, 1, ev, 256)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("variant", VARIANTS)
def test_bad_peer_cores_event_variant_are_value_errors(pod, variant):
    for die_id, results in enumerate(pod.run(bad_peers_and_args, variant)):
        wrong = [(label, out) for label, out in results if out[0] != "ValueError"]
        assert not wrong, f"die {die_id}: {wrong}"
    ev = next_event()
    assert_payload(pod.run(xfer, [(0, 1)], 64, np.uint8, variant, 1, ev)[1], 0, 1, ev, 64)


@pytest.mark.timeout(60)
def test_zero_copy_recv_buffer_must_be_in_app_area(pod):
    ev = next_event()
    errors, got = pod.run(zero_copy_outside_app, ev)[1]
    assert [e[0] for e in errors] == ["ValueError"] * 3, errors
    assert all("app area" in e[1] for e in errors)
    assert_payload(got, 0, 1, ev, 4096)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("direction, nbytes", [("recv", 64), ("send", 64), ("send", 3 * RING)])
@pytest.mark.parametrize("variant", VARIANTS)
def test_peer_that_never_answers_times_out(pod_factory, variant, direction, nbytes):
    pod = pod_factory(num_dies=2, timeout_s=0.5, ring_slots=SLOTS, slot_bytes=SLOT)
    t0 = time.monotonic()
    res = pod.run(silent_peer, variant, direction, nbytes)
    (kind, msg), waited = res[0]
    assert res[1] == 1, "the silent die returns at once"
    assert kind == "PeerTimeout", msg
    assert 0.4 <= waited < 60 * 0.5  # its own 0.5 s deadline, not another one
    assert "die 0" in msg and "die 1" in msg
    if direction == "recv":  # the fast path polls tail_ptr, the general one chunk_id
        assert "desc.tail_ptr" in msg or "desc.chunk_id" in msg, msg
    else:
        assert any(f in msg for f in ("ack.", "rdv.")), msg
    assert time.monotonic() - t0 < 60 * 0.5
    pod.close()


@pytest.mark.timeout(60)
def test_peer_timeout_raised_by_pod_run(pod_factory):
    pod = pod_factory(num_dies=2, timeout_s=0.5)
    with pytest.raises(PeerTimeout) as ei:
        pod.run(raise_timeout)
    assert ei.value.die_id == 0
    assert "desc.tail_ptr" in str(ei.value)


def raise_timeout(die):
    if die.die_id == 0:
        comm.recv(die, np.zeros(4, np.uint8), 1, 1)


# -- trace: the steps of §4, in order --------------------------------------------------------------


def _traced(pod, nbytes, variant, cores=1):
    ev = next_event()
    pod.set_trace(True)
    try:
        pod.trace_records(clear=True)
        res = pod.run(traced_xfer, nbytes, variant, cores, ev)
        recs = pod.trace_records(clear=True)
    finally:
        pod.set_trace(False)
    assert_payload(res[1], 0, 1, ev, nbytes)
    mine = {d: [r for r in rs if r[6] == ev] for d, rs in recs.items()}
    return mine


def steps(recs, op):
    return [s for o, s in comm.steps_of(recs, op) if o == op]


@pytest.mark.timeout(60)
def test_trace_mte_small_message(pod):
    recs = _traced(pod, 64, "mte")
    assert steps(recs[0], "send") == [1, 2, 3, 4, 8]
    assert steps(recs[1], "recv") == [5, 6, 7]
    assert recs[2] == [] and recs[3] == []


def _split_chunks(seq):
    """Count chunks in [1, 2, (1, 2 ...), 3, 1, 2, 3, ...]; AssertionError if out of order."""
    chunks, i = 0, 0
    while i < len(seq):
        halves = 0
        while i + 1 < len(seq) and seq[i] == 1 and seq[i + 1] == 2:
            i += 2
            halves += 1
        assert halves >= 1 and i < len(seq) and seq[i] == 3, f"bad step order at {i}: {seq}"
        i += 1
        chunks += 1
    return chunks


@pytest.mark.timeout(60)
def test_trace_mte_streamed_chunk_steps(pod):
    nbytes = 3 * RING + 123
    nchunks = -(-nbytes // SLOT)
    recs = _traced(pod, nbytes, "mte")
    tx = steps(recs[0], "send")
    body = [s for s in tx if s in (1, 2, 3)]
    assert _split_chunks(body) == nchunks
    assert steps(recs[1], "recv") == [5] + [6] * nchunks + [7]
    assert tx[-2:] == [4, 8] and tx.count(4) == tx.count(8) == 1, tx


@pytest.mark.timeout(60)
@pytest.mark.parametrize("nbytes, cores", [(3 * RING + 123, 1), (64, 2)])
def test_trace_mte_general_path_records_steps_4_and_8(pod, nbytes, cores):
    recs = _traced(pod, nbytes, "mte", cores)
    for lane in range(cores):
        tx = [s for o, s in comm.steps_of([r for r in recs[0] if r[5] == lane], "send")]
        assert tx[-2:] == [4, 8], f"lane {lane}: {tx}"


@pytest.mark.timeout(60)
def test_trace_dma(pod):
    nbytes = 3 * RING + 123
    recs = _traced(pod, nbytes, "dma")
    tx = steps(recs[0], "dma_send")
    assert tx and tx[0] == 2
    for a, b in zip(tx, tx[1:], strict=False):
        assert (a, b) in ((2, 3), (3, 2), (3, 4), (4, 8)), tx
    rx = steps(recs[1], "dma_recv")
    assert rx[0] == 5 and rx[-1] == 7 and set(rx[1:-1]) == {6}, rx
    moved = sum(r[7] for r in recs[1] if r[2] == "dma_recv" and r[3] == 6)
    assert moved == nbytes
    assert not [r for r in recs[0] + recs[1] if r[2] in ("send", "recv")]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("cores", [1, 2])
def test_trace_zero_copy(pod, cores):
    nbytes = 256 * KiB
    recs = _traced(pod, nbytes, "zero-copy", cores)
    rx, tx = recs[1], recs[0]
    for lane in range(cores):
        rl = [r for r in rx if r[5] == lane]
        tl = [r for r in tx if r[5] == lane]
        assert steps(rl, "zc_recv") == [0, 5, 7]
        assert steps(tl, "zc_send") == [0, 2, 3, 4, 8]
        rdv = next(r for r in rl if r[2] == "zc_recv" and r[3] == 0)
        write = next(r for r in tl if r[2] == "zc_send" and r[3] == 2)
        ack = next(r for r in rl if r[2] == "zc_recv" and r[3] == 7)
        # the rendezvous is published before the sender's write ends; the ack comes after the
        # sender's data steps (its 4 and 8 only end once it has seen the ack)
        assert rdv[0] <= write[0] + write[1]
        assert ack[0] >= max(r[0] for r in tl if r[3] in (0, 2, 3))
        assert write[7] == sum(b - a for a, b in [_stripe(nbytes, cores, lane)])
    assert not [r for r in tx + rx if r[2] in ("send", "recv", "dma_send", "dma_recv")]


def _stripe(nbytes, cores, lane):
    from comm.p2p import stripes

    return stripes(nbytes, cores)[lane]


@pytest.mark.timeout(60)
def test_write_trace_is_chrome_json_with_a_process_per_die(pod, tmp_path):
    ev = next_event()
    pod.set_trace(True)
    try:
        pod.trace_records(clear=True)
        pod.run(xfer, [(0, 1), (2, 3)], 3 * RING, np.uint8, "mte", 2, ev)
        path = tmp_path / "trace.json"
        n = pod.write_trace(str(path), clear=True)
    finally:
        pod.set_trace(False)
    doc = json.loads(path.read_text())
    evs = doc["traceEvents"]
    procs = {e["pid"]: e["args"]["name"] for e in evs if e["ph"] == "M"
             and e["name"] == "process_name"}  # fmt: skip
    assert procs == {d: f"die {d}" for d in range(4)}
    steps_ = [e for e in evs if e["ph"] in ("X", "i")]
    assert len(steps_) == n > 0
    assert {e["pid"] for e in steps_} == {0, 1, 2, 3}
    lanes = {(e["pid"], e["tid"]) for e in evs if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {(0, 0), (0, 1)} <= lanes


# -- randomized: many transfers between random pairs with random shapes --------------------------


def random_rounds(die, plan):
    """Run every round of `plan`; returns the descriptions of wrong payloads seen here."""
    me, wrong = die.die_id, []
    for r, pairs in enumerate(plan):
        for src, dst, nbytes, variant, cores in pairs:
            ev = r * 16 + src
            if me == src:
                comm.send(die, payload(src, dst, ev, nbytes), dst, ev, cores=cores,
                          variant=variant)  # fmt: skip
            elif me == dst:
                buf = recv_buffer(die, nbytes, np.uint8, variant)
                comm.recv(die, buf, src, ev, cores=cores, variant=variant)
                if not np.array_equal(buf, payload(src, dst, ev, nbytes)):
                    wrong.append(f"round {r} {src}->{dst} {nbytes} B {variant} x{cores}:"
                                 f" got {who_sent(buf)}")  # fmt: skip
                release(die, buf, variant)
    return wrong


@pytest.mark.timeout(120)
def test_random_transfers(pod):
    seed = int(os.environ.get("XPOD_TEST_SEED", time.time_ns() % 2**32))
    print(f"test_random_transfers seed={seed} (rerun with XPOD_TEST_SEED={seed})")
    rng = np.random.default_rng(seed)
    plan = []
    for _ in range(60):
        order = [int(d) for d in rng.permutation(4)]
        pairs = []
        for k in range(int(rng.integers(1, 3))):
            src, dst = order[2 * k], order[2 * k + 1]
            nbytes = int(rng.choice([0, 1, 8, 100, SLOT, RING + 1, 5 * RING + 7, 200_001]))
            variant = str(rng.choice(VARIANTS))
            cores = int(rng.integers(1, LANES + 1))
            pairs.append((src, dst, nbytes, variant, cores))
        plan.append(pairs)
    wrong = [w for ws in pod.run(random_rounds, plan) for w in ws]
    assert not wrong, f"seed {seed}: {wrong[:5]}"


# -- a run that fails mid-transfer leaves the pod usable -------------------------------------------


def fail_mid_transfer(die, variant, ev, nbytes, who_fails):
    """One side of a 0 -> 1 transfer raises part-way; the other is left waiting (and aborted)."""
    me = die.die_id
    if me == 0:
        if who_fails == "sender":
            comm.isend(die, payload(0, 1, ev, nbytes), 1, ev, variant=variant).test()
            raise ValueError("sender gives up")
        comm.send(die, payload(0, 1, ev, nbytes), 1, ev, variant=variant)
    elif me == 1:
        buf = recv_buffer(die, nbytes, np.uint8, variant)
        if who_fails == "receiver":
            comm.irecv(die, buf, 0, ev, variant=variant).test()
            raise ValueError("receiver gives up")
        comm.recv(die, buf, 0, ev, variant=variant)
    return me


# Regression: resync after a failed run used to realign counters while a sender's DMA engine was
# still streaming, leaving stale chunks; it now stops every engine first, then realigns.


def abandon_dma_send(die, ev, nbytes, src, dst):
    """`src` streams a large dma message to `dst`, which fails at once without receiving."""
    if die.die_id == dst:
        raise ValueError("receiver gives up")
    if die.die_id == src:
        comm.send(die, payload(src, dst, ev, nbytes), dst, ev, variant="dma")


@pytest.mark.timeout(60)
def test_resync_after_abandoned_dma_send_leaves_no_stale_chunks(pod_factory):
    # sender die 3, receiver die 0: the launcher resyncs die 0 first and die 3 last
    pod = pod_factory(**{**CFG, "timeout_s": 1.0})
    src, dst = 3, 0
    for i in range(8):
        ev = next_event()
        with pytest.raises(ValueError, match="gives up"):
            pod.run(abandon_dma_send, ev, MiB, src, dst)
        tail = int(pod.region(dst).field("desc", src, 0)["tail_ptr"])
        head = int(pod.region(src).field("ack", dst, 0)["head_ptr"])
        assert tail == head, f"iteration {i}: {tail - head} stale chunks left in the ring"
        res = pod.run(xfer, [(src, dst)], 100, np.uint8, "mte", 1, ev + 1)
        assert_payload(res[dst], src, dst, ev + 1, 100)


def _failed_run_params():
    for variant in VARIANTS:
        for who_fails in ("sender", "receiver"):
            yield pytest.param(variant, who_fails, id=f"{variant}-{who_fails}")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("variant, who_fails", list(_failed_run_params()))
def test_failed_run_mid_transfer_leaves_pod_usable(pod, variant, who_fails):
    ev = next_event()
    nbytes = 5 * RING + 11  # more than the ring: the sender is stuck part-way
    with pytest.raises(ValueError, match="gives up") as ei:
        pod.run(fail_mid_transfer, variant, ev, nbytes, who_fails)
    assert ei.value.die_id == (0 if who_fails == "sender" else 1)
    for src, dst in [(0, 1), (1, 0), (0, 1)]:
        for v in VARIANTS:
            ev2 = next_event()
            res = pod.run(xfer, [(src, dst)], nbytes, np.uint8, v, 2, ev2)
            assert_payload(res[dst], src, dst, ev2, nbytes)


# -- other pod configurations move the same bytes --------------------------------------------------


def all_variants_xfer(die, sizes, max_cores, ev):
    """0 -> 1 and 3 -> 2 for every size, variant and core count; returns what 1 and 2 got."""
    got = []
    k = 0
    for nbytes in sizes:
        for variant in VARIANTS:
            for cores in sorted({1, max_cores}):
                got.append(xfer(die, [(0, 1), (3, 2)], nbytes, np.uint8, variant, cores, ev + k))
                k += 1
    return got, len(die.trace.snapshot())


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    "extra",
    [
        dict(ub_bytes=1024),  # a UB half (512 B) smaller than a slot: several MTE steps per chunk
        dict(ub_bytes=128, slot_bytes=64, ring_slots=2),
        dict(wait="spin"),
        dict(wait="yield"),
        dict(pin="on"),
        dict(pin="off"),
        dict(lanes=1),
        dict(ring_slots=2, slot_bytes=64),
        dict(ring_slots=64, slot_bytes=256 * KiB, app_bytes=8 * MiB),
        dict(trace=True, trace_capacity=16),
    ],
    ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()),
)
def test_configurations(pod_factory, extra):
    cfg = {**CFG, **extra}
    pod = pod_factory(**cfg)
    sizes = [0, 1, 200, SLOT + 3, 3 * RING + 123, 300_001]
    ev = next_event() * 1000
    res = pod.run(all_variants_xfer, sizes, cfg["lanes"], ev)
    k = 0
    for nbytes in sizes:
        for _variant in VARIANTS:
            for _cores in sorted({1, cfg["lanes"]}):
                assert_payload(res[1][0][k], 0, 1, ev + k, nbytes)
                assert_payload(res[2][0][k], 3, 2, ev + k, nbytes)
                k += 1
    n_recs = [r[1] for r in res]
    if extra.get("trace"):
        assert all(0 < n <= 16 for n in n_recs[:4]), n_recs
    else:
        assert n_recs == [0, 0, 0, 0]
