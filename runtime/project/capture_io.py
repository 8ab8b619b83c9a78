"""The capture directory (docs/projection.md §1.1): `write_capture` and `load_capture`.

```
DIR/die-0000.msgpack  {"die": 0, "streams": [name, ...], "events": [event, ...]}  one per die
DIR/meta.json         written LAST (tmp + rename): the capture is complete iff it exists
```

An event is `[kind, stream, t0_ns, t1_ns, *fields]` with the fields of `FIELDS[kind]`. Loading
refuses, naming the file and why: a missing meta.json (an incomplete capture), another format,
version or layout version, a missing die file, a sha256 or an event count that differs from
meta.json (a truncated or rewritten file), an unknown kind, a wrong arity or a field of the wrong
type or range (a peer that is no die of the pod, an `after` / `end` join naming an event its
stream does not have). The replay then trusts every event: it checks nothing twice.

`meta.json["calls"]` is the list of call names to report (absent: every name the capture has),
`meta.json["warmup"]` how many calls of each name (the lowest call ids) are warm-up, left out of
the figures (absent: 0).
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack

from runtime.project.errors import ProjectError

FORMAT = "xpod-capture"
VERSION = 1
META = "meta.json"

# kind -> the fields after [kind, stream, t0_ns, t1_ns], each (name, type code):
# die = a die of the pod, n = int >= 0, int = any int, s = str, num = number >= 0, map = a map,
# ints = list of int, dies = list of dies, joins = list of [stream, seq], stream = a stream id
FIELDS: dict[str, tuple[tuple[str, str], ...]] = {
    "put": (("peer", "die"), ("nbytes", "n"), ("area", "s"), ("rows", "n"), ("tokens", "n"),
            ("row_bytes", "n")),
    "get": (("peer", "die"), ("nbytes", "n"), ("area", "s"), ("rows", "n"), ("row_bytes", "n")),
    "pub": (("peer", "die"), ("words", "ints"), ("values", "ints")),
    "acq": (("words", "ints"), ("targets", "ints"), ("writers", "dies"), ("field", "s")),
    "op": (("name", "s"), ("flops", "num"), ("rd_bytes", "n"), ("wr_bytes", "n"), ("dims", "map")),
    "copy": (("nbytes", "n"),),
    "begin": (("name", "s"), ("call", "int")),
    "end": (("name", "s"), ("call", "int"), ("joins", "joins")),
    "after": (("stream", "stream"), ("seq", "n")),
}  # fmt: skip
KINDS = tuple(FIELDS)
COMMON = ("kind", "stream", "t0_ns", "t1_ns")
SAFE_NAME = re.compile(r"[A-Za-z0-9_.-]+")


@dataclass(frozen=True, slots=True)
class Capture:
    """A loaded, validated capture.

    path: the capture directory. meta: meta.json as a dict. streams[d][s]: the name of die d's
    stream s. events[d]: die d's events in file order (each `[kind, stream, t0_ns, t1_ns, ...]`).
    """

    path: Path
    meta: dict
    streams: list[list[str]]
    events: list[list[list]]

    @property
    def num_dies(self) -> int:
        """Dies of the pod (each has a file)."""
        return len(self.events)

    @property
    def num_events(self) -> int:
        """Events of every die."""
        return sum(len(e) for e in self.events)

    def call_names(self) -> list[str] | None:
        """The call names meta.json asks to report (None: every name the capture has)."""
        calls = self.meta.get("calls")
        return None if calls is None else list(calls)

    def warmup(self) -> int:
        """Calls of each name (the lowest call ids) left out of the figures."""
        return int(self.meta.get("warmup", 0))


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """The cyclic garbage collector off for the block (restored after): a capture is millions
    of small lists, none in a cycle, and the collector's passes over them tripled the time of a
    load or a replay (measured: 1.4 s -> 0.5 s to load 527k events)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


# -- writing ---------------------------------------------------------------------------------------


def write_capture(
    path: str | os.PathLike, meta: Mapping[str, Any], dies: Sequence[Mapping]
) -> Path:
    """Write a capture directory: every die file, then meta.json last (tmp + rename).

    meta: meta.json's keys except the computed ones (`format` and `version` default to this
    format's; `num_dies` and `dies` are computed: event counts and sha256 of the written files).
    dies: one map per die, `{"die": d, "streams": [...], "events": [...]}`, dies 0..N-1 in any
    order (meta.json lists them in this order). Returns the directory.
    """
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    (out / META).unlink(missing_ok=True)  # incomplete until the new meta.json lands
    entries = []
    for die_map in dies:
        d = int(die_map["die"])
        body = {"die": d, "streams": list(die_map["streams"]), "events": list(die_map["events"])}
        data = msgpack.packb(body, use_bin_type=True)
        name = f"die-{d:04d}.msgpack"
        _write_atomic(out / name, data)
        sha = hashlib.sha256(data).hexdigest()
        entries.append({"die": d, "file": name, "events": len(body["events"]), "sha256": sha})
    full = {"format": FORMAT, "version": VERSION, **dict(meta)}
    full["num_dies"] = len(entries)
    full["dies"] = entries
    _write_atomic(out / META, (json.dumps(full, indent=1, sort_keys=True) + "\n").encode())
    return out


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


# -- loading ---------------------------------------------------------------------------------------


def load_capture(path: str | os.PathLike, layout_version: int | None = None) -> Capture:
    """Load and validate the capture directory `path` (docs/projection.md §1.1).

    layout_version: the `memory.layout.LAYOUT_VERSION` the capture must have been made with
    (None: not checked). Raises ProjectError naming the file and what is wrong.
    """
    root = Path(path)
    if not root.is_dir():
        raise ProjectError(f"{root}: no such capture directory")
    meta = _load_meta(root, layout_version)
    n = meta["num_dies"]
    streams: list[list[str]] = [[] for _ in range(n)]
    events: list[list[list]] = [[] for _ in range(n)]
    with paused_gc():
        for entry in meta["dies"]:
            d = entry["die"]
            streams[d], events[d] = _load_die(root, entry, n)
    return Capture(root, meta, streams, events)


def _load_meta(root: Path, layout_version: int | None) -> dict:
    where = root / META
    if not where.exists():
        raise ProjectError(
            f"{where}: missing: an incomplete capture (meta.json is written last, once every"
            " die file is whole)"
        )
    try:
        meta = json.loads(where.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ProjectError(f"{where}: unreadable: {e}") from e
    if not isinstance(meta, dict):
        raise ProjectError(f"{where}: not a JSON object")
    if meta.get("format") != FORMAT:
        raise ProjectError(f"{where}: format {meta.get('format')!r} is not {FORMAT!r}")
    if meta.get("version") != VERSION:
        raise ProjectError(
            f"{where}: version {meta.get('version')!r}, this xpod reads version {VERSION}"
        )
    if layout_version is not None and meta.get("layout_version") != layout_version:
        raise ProjectError(
            f"{where}: layout_version {meta.get('layout_version')!r}, this xpod has"
            f" {layout_version}: captured with another region layout"
        )
    _check_dies(where, meta)
    _check_optional(where, meta)
    return meta


def _check_dies(where: Path, meta: dict) -> None:
    n = meta.get("num_dies")
    if type(n) is not int or n < 1:
        raise ProjectError(f"{where}: num_dies {n!r} is not an integer >= 1")
    dies = meta.get("dies")
    if not isinstance(dies, list) or len(dies) != n:
        raise ProjectError(f"{where}: dies must list {n} entries (num_dies)")
    seen = set()
    for i, e in enumerate(dies):
        ok = (
            isinstance(e, dict)
            and type(e.get("die")) is int
            and 0 <= e["die"] < n
            and isinstance(e.get("file"), str)
            and SAFE_NAME.fullmatch(e["file"]) is not None
            and e["file"] not in (".", "..")
            and type(e.get("events")) is int
            and e["events"] >= 0
            and isinstance(e.get("sha256"), str)
            and re.fullmatch(r"[0-9a-f]{64}", e["sha256"]) is not None
        )
        if not ok:
            raise ProjectError(
                f"{where}: dies[{i}] is not {{die: 0..{n - 1}, file: a plain file name,"
                f" events: int >= 0, sha256: 64 hex digits}}: {e!r}"
            )
        if e["die"] in seen:
            raise ProjectError(f"{where}: die {e['die']} is listed twice in dies")
        seen.add(e["die"])


def _check_optional(where: Path, meta: dict) -> None:
    calls = meta.get("calls", [])
    if not isinstance(calls, list) or not all(isinstance(x, str) for x in calls):
        raise ProjectError(f"{where}: calls must be a list of call names: {calls!r}")
    warmup = meta.get("warmup", 0)
    if type(warmup) is not int or warmup < 0:
        raise ProjectError(f"{where}: warmup must be an integer >= 0: {warmup!r}")
    if not isinstance(meta.get("synthesized", False), bool):
        raise ProjectError(f"{where}: synthesized must be true or false")
    if not isinstance(meta.get("workload", {}), dict):
        raise ProjectError(f"{where}: workload must be a map")


def _load_die(root: Path, entry: dict, num_dies: int) -> tuple[list[str], list[list]]:
    d, name = entry["die"], entry["file"]
    where = root / name
    try:
        data = where.read_bytes()
    except FileNotFoundError:
        raise ProjectError(f"{where}: missing (meta.json lists it for die {d})") from None
    except OSError as e:
        raise ProjectError(f"{where}: unreadable: {e}") from e
    sha = hashlib.sha256(data).hexdigest()
    if sha != entry["sha256"]:
        raise ProjectError(
            f"{where}: sha256 {sha[:16]}... differs from meta.json's {entry['sha256'][:16]}...:"
            " a truncated or rewritten file"
        )
    try:
        body = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except (ValueError, TypeError, msgpack.UnpackException) as e:
        raise ProjectError(f"{where}: not a msgpack die file: {e}") from e
    if not isinstance(body, dict) or set(body) != {"die", "streams", "events"}:
        raise ProjectError(f"{where}: not a map {{die, streams, events}}")
    if body["die"] != d:
        raise ProjectError(f"{where}: holds die {body['die']!r}, meta.json lists it for die {d}")
    streams, events = body["streams"], body["events"]
    if not isinstance(streams, list) or not all(isinstance(s, str) for s in streams):
        raise ProjectError(f"{where}: streams must be a list of names")
    if not isinstance(events, list) or len(events) != entry["events"]:
        got = len(events) if isinstance(events, list) else "no"
        raise ProjectError(
            f"{where}: {got} events, meta.json says {entry['events']}: a truncated file"
        )
    check_events(where.name, events, len(streams), num_dies)
    return streams, events


# -- events ----------------------------------------------------------------------------------------


def check_events(where: str, events: list, num_streams: int, num_dies: int) -> None:
    """Raise ProjectError naming `where` and the event index at the first malformed event:
    unknown kind, wrong arity, a field of the wrong type or range, or an `after` / `end` join
    naming an event its stream does not have."""
    fast = _FAST
    counts = [0] * num_streams
    targets = []  # (event index, stream, seq) of after / end joins, checked once counts are known
    for i, ev in enumerate(events):
        if not (
            type(ev) is list
            and len(ev) >= 4
            and type(ev[1]) is int
            and 0 <= ev[1] < num_streams
            and type(ev[2]) is int
            and type(ev[3]) is int
        ):
            raise ProjectError(f"{where}: event {i}: {_common_problem(ev, num_streams)}")
        check = fast.get(ev[0]) if type(ev[0]) is str else None
        if check is None:
            raise ProjectError(
                f"{where}: event {i}: unknown kind {ev[0]!r} (known: {', '.join(FIELDS)})"
            )
        if not check(ev, num_dies, num_streams):
            raise ProjectError(f"{where}: event {i}: {_field_problem(ev, num_dies, num_streams)}")
        counts[ev[1]] += 1
        if ev[0] == "after":
            targets.append((i, ev[4], ev[5]))
        elif ev[0] == "end":
            targets.extend((i, s, q) for s, q in ev[6])
    for i, s, q in targets:
        if q >= counts[s]:
            raise ProjectError(
                f"{where}: event {i}: names event {q} of stream {s}, which has {counts[s]} events"
            )


def _common_problem(ev: object, num_streams: int) -> str:
    if type(ev) is not list or len(ev) < 4:
        return f"not an array [{', '.join(COMMON)}, ...]: {ev!r:.80}"
    if type(ev[1]) is not int or not 0 <= ev[1] < num_streams:
        return f"stream {ev[1]!r} is not a stream id of this die (0..{num_streams - 1})"
    return f"t0_ns / t1_ns must be integers: {ev[2]!r}, {ev[3]!r}"


def _field_problem(ev: list, num_dies: int, num_streams: int) -> str:
    spec = FIELDS[ev[0]]
    layout = f"[{', '.join(COMMON + tuple(name for name, _ in spec))}]"
    if len(ev) != 4 + len(spec):
        return f"{ev[0]} has {len(ev)} items, expected {4 + len(spec)}: {layout}"
    for (name, code), value in zip(spec, ev[4:], strict=True):
        if not _valid(code, value, num_dies, num_streams):
            return f"{ev[0]} field {name} = {value!r:.80} is not {_MEANING[code]}: {layout}"
    lists = "words / values" if ev[0] == "pub" else "words / targets / writers"
    return f"{ev[0]}: the lists {lists} differ in length: {layout}"


_MEANING = {
    "die": "a die of the pod",
    "n": "an integer >= 0",
    "int": "an integer",
    "s": "a string",
    "num": "a number >= 0",
    "map": "a map",
    "ints": "a list of integers",
    "dies": "a list of dies of the pod",
    "joins": "a list of [stream, seq] of this die",
    "stream": "a stream id of this die",
}


def _valid(code: str, v: object, num_dies: int, num_streams: int) -> bool:
    if code == "die":
        return type(v) is int and 0 <= v < num_dies
    if code == "n":
        return type(v) is int and v >= 0
    if code == "int":
        return type(v) is int
    if code == "s":
        return isinstance(v, str)
    if code == "num":
        return type(v) in (int, float) and v >= 0
    if code == "map":
        return isinstance(v, dict)
    if code == "ints":
        return isinstance(v, list) and all(type(x) is int for x in v)
    if code == "dies":
        return isinstance(v, list) and all(type(x) is int and 0 <= x < num_dies for x in v)
    if code == "joins":
        return isinstance(v, list) and all(
            isinstance(j, list) and len(j) == 2 and _valid("stream", j[0], num_dies, num_streams)
            and _valid("n", j[1], num_dies, num_streams)
            for j in v
        )  # fmt: skip
    return type(v) is int and 0 <= v < num_streams  # stream


# Fast checks, one per kind (the common path of a million events): True iff the event is well
# formed; on False `_field_problem` says what is wrong.


def _ints(v: object) -> bool:
    return type(v) is list and all(type(x) is int for x in v)


def _put(ev: list, nd: int, ns: int) -> bool:
    return (
        len(ev) == 10 and type(ev[4]) is int and 0 <= ev[4] < nd and type(ev[5]) is int
        and ev[5] >= 0 and type(ev[6]) is str and type(ev[7]) is int and ev[7] >= 0
        and type(ev[8]) is int and ev[8] >= 0 and type(ev[9]) is int and ev[9] >= 0
    )  # fmt: skip


def _get(ev: list, nd: int, ns: int) -> bool:
    return (
        len(ev) == 9 and type(ev[4]) is int and 0 <= ev[4] < nd and type(ev[5]) is int
        and ev[5] >= 0 and type(ev[6]) is str and type(ev[7]) is int and ev[7] >= 0
        and type(ev[8]) is int and ev[8] >= 0
    )  # fmt: skip


def _pub(ev: list, nd: int, ns: int) -> bool:
    return (
        len(ev) == 7 and type(ev[4]) is int and 0 <= ev[4] < nd and _ints(ev[5]) and _ints(ev[6])
        and len(ev[5]) == len(ev[6])
    )  # fmt: skip


def _acq(ev: list, nd: int, ns: int) -> bool:
    return (
        len(ev) == 8 and _ints(ev[4]) and _ints(ev[5]) and _ints(ev[6]) and type(ev[7]) is str
        and len(ev[4]) == len(ev[5]) == len(ev[6]) and all(0 <= p < nd for p in ev[6])
    )  # fmt: skip


def _op(ev: list, nd: int, ns: int) -> bool:
    return (
        len(ev) == 9 and type(ev[4]) is str and type(ev[5]) in (int, float) and ev[5] >= 0
        and type(ev[6]) is int and ev[6] >= 0 and type(ev[7]) is int and ev[7] >= 0
        and type(ev[8]) is dict
    )  # fmt: skip


def _copy(ev: list, nd: int, ns: int) -> bool:
    return len(ev) == 5 and type(ev[4]) is int and ev[4] >= 0


def _begin(ev: list, nd: int, ns: int) -> bool:
    return len(ev) == 6 and type(ev[4]) is str and type(ev[5]) is int


def _end(ev: list, nd: int, ns: int) -> bool:
    return (
        len(ev) == 7
        and type(ev[4]) is str
        and type(ev[5]) is int
        and _valid("joins", ev[6], nd, ns)
    )


def _after(ev: list, nd: int, ns: int) -> bool:
    return (
        len(ev) == 6
        and type(ev[4]) is int
        and 0 <= ev[4] < ns
        and type(ev[5]) is int
        and (ev[5] >= 0)
    )


_FAST = {"put": _put, "get": _get, "pub": _pub, "acq": _acq, "op": _op, "copy": _copy,
         "begin": _begin, "end": _end, "after": _after}  # fmt: skip

__all__ = ["FIELDS", "FORMAT", "KINDS", "VERSION", "Capture", "check_events", "load_capture",
           "paused_gc", "write_capture"]  # fmt: skip
