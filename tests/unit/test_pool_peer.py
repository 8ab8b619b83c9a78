"""runtime.engine.pool_peer: a pool server's peer socket, the cross-host read of its DRAM tier.
A fetch returns the slots' bytes layer-major (each slot's value names it and its layer); a
fetch of another epoch, of slots out of range or listed twice, a frame that is not a fetch, all
answered with ERROR and no data; a real ROUTER / DEALER round trip over TCP."""

from __future__ import annotations

import os

import msgpack
import numpy as np
import pytest
import zmq

from memory import pool_layout as P
from runtime.engine import wire
from runtime.engine.pool_peer import bind_peer, fetched, serve_peer, unpack_fetched
from runtime.engine.pool_wire import ERROR, OK, pack

L, SLOTS, BS, ROW = 3, 6, 4, 8
FP = P.make_fingerprint("peer-test")


@pytest.fixture
def seg():
    s = P.create_pool(f"utpeer{os.getpid()}", 0, FP, L, SLOTS, BS, ROW)
    view = s.slots()
    for layer in range(L):
        for slot in range(SLOTS):
            view[layer, slot] = 100 * layer + slot  # a value naming its (layer, slot)
    del view
    try:
        yield s
    finally:
        s.close()
        s.unlink()


def reply(seg, body: dict, epoch: int = 2) -> dict:
    return unpack_fetched(fetched(7, epoch, seg, pack("fetch", body)))


def test_a_fetch_returns_its_slots_layer_major(seg):
    r = reply(seg, {"id": 11, "epoch": 2, "slots": [4, 1]})
    assert (r["status"], r["id"], r["server"], r["error"]) == (OK, 11, 7, "")
    got = np.frombuffer(r["data"], np.float32).reshape(L, 2, BS, ROW)
    for layer in range(L):
        for j, slot in enumerate([4, 1]):
            assert np.all(got[layer, j] == 100 * layer + slot), (layer, slot)


@pytest.mark.parametrize(
    "body, match",
    [
        ({"id": 1, "epoch": 1, "slots": [0]}, "epoch 1"),  # meant for a predecessor
        ({"id": 1, "epoch": 2, "slots": [SLOTS]}, "slots"),  # out of range
        ({"id": 1, "epoch": 2, "slots": [2, 2]}, "distinct"),
        ({"id": 1, "epoch": 2, "slots": []}, "slots"),
        ({"id": 1, "epoch": 2, "slots": [True]}, "slots"),
        ({"id": 1, "epoch": 2}, "slots"),
    ],
)
def test_bad_fetches_are_refused_with_no_data(seg, body, match):
    r = reply(seg, body)
    assert r["status"] == ERROR and r["data"] == b"" and match in r["error"] and r["id"] == 1


def test_a_frame_that_is_not_a_fetch_gets_an_error_reply(seg):
    for frame in (
        b"\x00garbage",
        pack("store", {"id": 5}),
        msgpack.packb([wire.MARKER, "fetch", wire.WIRE_VERSION + 1, {"id": 6}]),
    ):
        r = unpack_fetched(fetched(7, 2, seg, frame))
        assert r["status"] == ERROR and r["data"] == b""
    assert unpack_fetched(fetched(7, 2, seg, pack("store", {"id": 5})))["id"] == 5


@pytest.mark.timeout(30)
def test_a_round_trip_over_tcp(seg):
    ctx = zmq.Context()
    router, endpoint = bind_peer(ctx, "tcp://127.0.0.1:*")
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    try:
        assert endpoint.startswith("tcp://127.0.0.1:") and not endpoint.endswith(":*")
        dealer.connect(endpoint)
        dealer.send(pack("fetch", {"id": 3, "epoch": 2, "slots": [5]}))
        dealer.send(b"not a frame")
        assert router.poll(10_000)
        n = 0
        while n < 2:  # both requests answered, in order
            assert router.poll(10_000)
            n += serve_peer(router, 7, 2, seg)
        first, second = unpack_fetched(dealer.recv()), unpack_fetched(dealer.recv())
        assert first["status"] == OK and first["id"] == 3
        assert np.frombuffer(first["data"], np.float32)[0] == 5.0
        assert second["status"] == ERROR
    finally:
        dealer.close(linger=0)
        router.close(linger=0)
        ctx.term()
