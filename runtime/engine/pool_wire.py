"""The KV pool's frames (`runtime.engine.pool_server`'s orders and replies): `wire`'s format
(msgpack `["xpod", kind, WIRE_VERSION, body]`) with the pool's kinds, and where a server's
order socket is. Nothing is pickled; a bad frame is a `WireError`."""

from __future__ import annotations

import contextlib
import os
from typing import Any

import msgpack

from memory.errors import ProtocolError
from runtime.engine import wire
from runtime.engine.wire import WireError

OK, ERROR = 0, 1
ORDER_KINDS = frozenset({"store", "load", "demote", "promote", "delete", "drop", "probe", "stop"})
REPLY_KINDS = frozenset({"inventory", "stored", "loaded", "demoted", "promoted", "deleted",
                         "dropped", "echo", "error"})  # fmt: skip
# a server's peer socket (cross-host reads of its DRAM tier, runtime.engine.pool_peer)
PEER_KINDS = frozenset({"fetch", "fetched"})
REPLY_OF = {"store": "stored", "load": "loaded", "demote": "demoted", "promote": "promoted",
            "delete": "deleted", "drop": "dropped", "probe": "echo"}  # fmt: skip


# -- frames ------------------------------------------------------------------------------------


def pack(kind: str, body: dict | None = None) -> bytes:
    """A pool frame: `wire`'s format, with the pool's kinds."""
    if kind not in ORDER_KINDS | REPLY_KINDS | PEER_KINDS:
        raise WireError(f"pack: unknown pool message kind {kind!r}")
    return msgpack.packb([wire.MARKER, kind, wire.WIRE_VERSION, body or {}], use_bin_type=True)


def unpack(frame: bytes, expect: frozenset[str] = ORDER_KINDS) -> tuple[str, dict]:
    """(kind, body) of a pool frame; WireError if it is not one of `expect` at this version."""
    try:
        msg = msgpack.unpackb(frame, raw=False, strict_map_key=False)
    except (msgpack.UnpackException, ValueError, TypeError) as e:
        raise WireError(f"unpack: not msgpack ({len(frame)} bytes): {e}") from None
    if not (isinstance(msg, list) and len(msg) == 4 and msg[0] == wire.MARKER):
        raise WireError(f"unpack: not an xpod frame: {str(msg)[:80]}")
    _, kind, version, body = msg
    if version != wire.WIRE_VERSION:
        raise WireError(f"unpack: {kind!r} frame of version {version}, this code speaks"
                        f" {wire.WIRE_VERSION}")  # fmt: skip
    if kind not in expect:
        raise WireError(f"unpack: unexpected pool message kind {kind!r}")
    if not isinstance(body, dict):
        raise WireError(f"unpack: {kind!r} body is {type(body).__name__}, not a dict")
    return kind, body


def frame_id(frame: bytes) -> Any:
    """The `id` of a frame that is not a valid order, if it has one (for its error reply)."""
    with contextlib.suppress(Exception):
        msg = msgpack.unpackb(frame, raw=False, strict_map_key=False)
        if isinstance(msg, list) and len(msg) == 4 and isinstance(msg[3], dict):
            v = msg[3].get("id")
            return v if isinstance(v, int | str) else None
    return None


# -- order fields (ProtocolError naming the field) ----------------------------------------------


def field_int(b: dict, key: str, default: int | None = None) -> int:
    v = b.get(key, default)
    if not isinstance(v, int) or isinstance(v, bool):
        raise ProtocolError(f"order field {key!r} must be an int, got {v!r}")
    return v


def field_ints(b: dict, key: str) -> list[int]:
    v = b.get(key)
    if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool)
                                          for x in v):  # fmt: skip
        raise ProtocolError(f"order field {key!r} must be a list of ints, got {str(v)[:60]}")
    return v


def field_ns(b: dict) -> str | None:
    ns = b.get("ns")
    if ns is not None and not isinstance(ns, str):
        raise ProtocolError(f"order field 'ns' must be a string or nil, got {ns!r}")
    return ns


def order_socket(run_dir: str, server: int) -> str:
    """The PULL socket of pool server `server` (in the pod's run directory)."""
    return f"ipc://{os.path.join(run_dir, f'pool{server}.sock')}"


__all__ = ["ERROR", "OK", "ORDER_KINDS", "PEER_KINDS", "REPLY_KINDS", "REPLY_OF", "field_int",
           "field_ints", "field_ns", "frame_id", "order_socket", "pack", "unpack"]  # fmt: skip
