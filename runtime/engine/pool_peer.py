"""A pool server's peer socket: the cross-host read of its DRAM tier (KVPOOL.md §4.9, the
"VPC plane"; 000 §4.4's UB vs VPC paths, Fig. 23).

On a pod over several hosts (`--hosts`) each host has its own pool server, and a master maps
only its own host's DRAM tier (another host's memory is not reachable by load and store:
docs/protocols.md §11). A hit held by another host's server is read over TCP instead: the
master sends `fetch` to that server's peer socket (a ROUTER bound on TCP, its endpoint in the
server's inventory), the server answers `fetched` with the slots' bytes, and the master writes
them into its die's blocks itself (two copies at TCP speed, where a same-host hit is one copy
at memory speed: the gap `xpod bench pool --hosts` measures).

```
 master g (host A) --DEALER: fetch{id, epoch, slots}-->  pool server s (host B): ROUTER (tcp)
 die g's blocks <--scatter-- master g <--fetched{id, status, data}--'   reads its slots
```

Frames are `runtime.engine.pool_wire`'s (msgpack, a type and a version; nothing pickled), one
message part after the ROUTER's identity. `fetch {id, epoch, slots}` -> `fetched {server, id,
status, error, data}`: `data` is every (layer, slot) span of the slots, layer-major (the order
of a load's scatter list, `KVGeometry.offsets`), `n_layers * len(slots) * block_size * row`
bytes. Refused (status ERROR, no data): another epoch (a fetch meant for this server's
predecessor: its slots hold other blocks now), a slot out of range, a slot listed twice. A
frame that is not a fetch gets `fetched` with ERROR too (its id if it has one): a peer is
never left waiting for a reply that does not come. The slots a fetch reads are leased by the
shell's index (complete, not reused until the lease goes back), so their bytes are stable.
"""

from __future__ import annotations

import contextlib

import numpy as np
import zmq

from memory import pool_layout as P
from runtime.engine.pool_wire import ERROR, OK, frame_id, pack, unpack
from runtime.engine.wire import WireError

FETCH = frozenset({"fetch"})
FETCHED = frozenset({"fetched"})
MAX_FETCH_SLOTS = 1 << 16


def bind_peer(ctx: zmq.Context, addr: str) -> tuple[zmq.Socket, str]:
    """The ROUTER of a server's peer socket bound at `addr` (`tcp://HOST:*`: a free port) and
    the endpoint it got (what the inventory tells the masters)."""
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 0)  # a reply to a peer gone is dropped, not raised
    sock.bind(addr)
    return sock, sock.getsockopt_string(zmq.LAST_ENDPOINT)


def fetch_data(seg: P.PoolSegment, slots: list[int]) -> bytes:
    """Every (layer, slot) span of `slots`, layer-major."""
    view = seg.slots()  # [n_layers, n_slots, block_size, row]
    return np.ascontiguousarray(view[:, np.asarray(slots, np.int64)]).tobytes()


def fetched(server: int, epoch: int, seg: P.PoolSegment, frame: bytes) -> bytes:
    """The `fetched` reply frame of one request frame (never raises on a bad request)."""
    try:
        kind, body = unpack(frame, FETCH)
    except WireError as e:
        return pack("fetched", {"server": server, "id": frame_id(frame), "status": ERROR,
                                "error": str(e), "data": b""})  # fmt: skip
    reply = {"server": server, "id": body.get("id"), "status": ERROR, "data": b""}
    slots = body.get("slots")
    if body.get("epoch") != epoch:
        return pack("fetched", {**reply, "error": f"a fetch of epoch {body.get('epoch')!r}, this"
                                f" server is epoch {epoch} (meant for a predecessor)"})  # fmt: skip
    if not (isinstance(slots, list) and 0 < len(slots) <= MAX_FETCH_SLOTS
            and all(isinstance(s, int) and not isinstance(s, bool) and 0 <= s < seg.n_slots
                    for s in slots) and len(set(slots)) == len(slots)):  # fmt: skip
        return pack("fetched", {**reply, "error": f"slots {str(slots)[:60]} are not distinct"
                                f" slots of the {seg.n_slots}"})  # fmt: skip
    return pack("fetched", {**reply, "status": OK, "error": "", "data": fetch_data(seg, slots)})


def serve_peer(sock: zmq.Socket, server: int, epoch: int, seg: P.PoolSegment) -> int:
    """Answer every fetch waiting on the ROUTER `sock` (non-blocking); how many."""
    n = 0
    while True:
        try:
            parts = sock.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return n
        if len(parts) < 2:
            continue
        reply = fetched(server, epoch, seg, parts[-1])
        with contextlib.suppress(zmq.Again):  # a peer that does not read: its load times out
            sock.send_multipart([*parts[:-1], reply], zmq.NOBLOCK)
        n += 1


def unpack_fetched(frame: bytes) -> dict:
    """The body of a `fetched` frame (WireError if it is not one)."""
    return unpack(frame, FETCHED)[1]


__all__ = ["bind_peer", "fetch_data", "fetched", "serve_peer", "unpack_fetched"]
