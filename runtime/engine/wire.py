"""Typed messages of the serving processes: a type tag, a version and a msgpack body.

```
 frame = msgpack [ "xpod", kind, WIRE_VERSION, body ]      body: a dict of plain values
```
Every message between the engine, the masters and the dies (zmq between processes, the shared
memory step rings between a master and its die) is one frame. Nothing is ever pickled on a
socket: a frame from anywhere is checked (marker, known kind, version, dict body) before any of
it is used, and a bad one is a `WireError` naming what was wrong.

Kinds (sender -> receiver):
- engine -> master: `add` {id, prompt, params, stream, render}, `abort` {id}, `shutdown` {},
  `ping` {seq}
- master -> engine: `ready` {group}, `out` {deltas: [[id, [tokens]]], done: [[id, reason,
  n_prompt, n_cached, error, t_first, t_sched]], cached: [[id, n_cached]] (admitted since)},
  `stats` {...}, `pong` {seq, die_step},
  `log` {steps}
- master -> output process (output shortcutting): `open` {id, n_prompt, render}, `out`, `eof`
- output process -> engine: `out` {deltas, done, data: [[id, n_tokens, bytes, final, status]]};
  -> master: `abort` {id} (a stop string)
- master -> die (step ring): `step` {plan, rows, released}, `stop` {}
- die -> master (result ring): `result` {plan, step, sampled, fed, t_*, logits}
- KV pool (`--kv-pool`): shell / master -> pool server: its orders (`runtime.engine.pool_server`,
  same frames); pool server -> shell: `inventory`, `stored`, `demoted`, `promoted`, `deleted`,
  `dropped`, `echo`, `error`; -> master: `loaded`; shell -> master: `pool_release` {hold},
  `pool_dead` {server}, `pool_up` {server, pid} (its inventory came: a master maps its tier)
"""

from __future__ import annotations

import os

import msgpack
import numpy as np

from memory.errors import ProtocolError

MARKER = "xpod"
WIRE_VERSION = 1
KINDS = frozenset(
    {"add", "abort", "shutdown", "ping", "ready", "out", "stats", "pong", "log", "step", "stop",
     "result", "open", "cached", "eof", "kv_dst", "kv_done", "kv_cancel", "xfer", "probe",
     # the KV pool (runtime.engine.pool_server's replies; the shell's to a master)
     "inventory", "stored", "loaded", "demoted", "promoted", "deleted", "dropped", "echo",
     "error", "pool_release", "pool_dead", "pool_up"}
)  # fmt: skip


class WireError(ProtocolError):
    """A frame that is not an xpod message of a known kind and this version."""


def pack(kind: str, body: dict | None = None) -> bytes:
    """One frame: `kind` (one of KINDS) and a dict of msgpack-able values."""
    if kind not in KINDS:
        raise WireError(f"pack: unknown message kind {kind!r}")
    return msgpack.packb([MARKER, kind, WIRE_VERSION, body or {}], use_bin_type=True)


def unpack(frame: bytes, expect: frozenset[str] | set[str] | None = None) -> tuple[str, dict]:
    """(kind, body) of a frame; WireError if it is not one of ours (or not of `expect`)."""
    try:
        msg = msgpack.unpackb(frame, raw=False, strict_map_key=False)
    except (msgpack.UnpackException, ValueError, TypeError) as e:
        raise WireError(f"unpack: not msgpack ({len(frame)} bytes): {e}") from None
    if not (isinstance(msg, list) and len(msg) == 4 and msg[0] == MARKER):
        raise WireError(f"unpack: not an xpod frame: {str(msg)[:80]}")
    _, kind, version, body = msg
    if version != WIRE_VERSION:
        raise WireError(
            f"unpack: {kind!r} frame of version {version}, this code speaks {WIRE_VERSION}"
        )
    if kind not in KINDS or (expect is not None and kind not in expect):
        raise WireError(f"unpack: unexpected message kind {kind!r}")
    if not isinstance(body, dict):
        raise WireError(f"unpack: {kind!r} body is {type(body).__name__}, not a dict")
    return kind, body


def pack_array(a: np.ndarray) -> list:
    """[dtype str, shape, raw bytes] of a numpy array (for a frame body)."""
    a = np.ascontiguousarray(a)
    return [a.dtype.str, list(a.shape), a.tobytes()]


def unpack_array(v: list) -> np.ndarray:
    dtype, shape, raw = v
    return np.frombuffer(raw, dtype=np.dtype(dtype)).reshape(shape)


# -- where the frames go: zmq ipc:// sockets in the pod's owner-only run directory -------------


def output_socket(run_dir: str, group: int) -> str:
    """The PULL socket of `group`'s output process."""
    return f"ipc://{os.path.join(run_dir, f'o{group}.sock')}"


def master_socket(run_dir: str, group: int) -> str:
    """The PULL socket of `group`'s master."""
    return f"ipc://{os.path.join(run_dir, f'm{group}.sock')}"


def kv_socket(run_dir: str, die: int) -> str:
    """The PULL socket of a PD prefill die's KV thread (`runtime.engine.pd`)."""
    return f"ipc://{os.path.join(run_dir, f'k{die}.sock')}"


def engine_socket(run_dir: str) -> str:
    """The engine's PULL socket (every master's and output process's messages)."""
    return f"ipc://{os.path.join(run_dir, 'engine.sock')}"
