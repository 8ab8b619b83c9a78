"""The capture directory (runtime.project.capture_io, docs/projection.md §1.1): written whole
with meta.json last, read back as written, and every way it can be incomplete, truncated or
malformed refused with the file and the reason."""

from __future__ import annotations

import hashlib
import json
import re

import msgpack
import pytest

from runtime.project import ProjectError, load_capture, write_capture

META = {"layout_version": 7, "workload": {"bench": "t"}, "calls": ["send"], "warmup": 1}


def die0(events=None):
    ev = events if events is not None else [
        ["begin", 0, 1, 2, "send", 5],
        ["put", 1, 3, 4, 1, 4096, "ring", 0, 0, 0],
        ["pub", 1, 5, 5, 1, [10], [1]],
        ["after", 1, 6, 6, 0, 0],
        ["end", 0, 7, 7, "send", 5, [[1, 2]]],
    ]  # fmt: skip
    return {"die": 0, "streams": ["main", "p2p.tx.1.0"], "events": ev}


def die1():
    ev = [["acq", 0, 1, 9, [10], [1], [0], "desc.tail_ptr"], ["copy", 0, 9, 12, 4096],
          ["op", 0, 12, 20, "quantize", 0, 100, 50, {"unit": "aiv", "rows": 4}],
          ["get", 0, 20, 30, 0, 512, "meta", 0, 0]]  # fmt: skip
    return {"die": 1, "streams": ["p2p.rx.0.0"], "events": ev}


@pytest.fixture
def cap_dir(tmp_path):
    return write_capture(tmp_path / "cap", META, [die1(), die0()])  # listed out of order


def test_round_trip(cap_dir):
    meta = json.loads((cap_dir / "meta.json").read_text())
    assert meta["format"] == "xpod-capture" and meta["version"] == 1 and meta["num_dies"] == 2
    assert [e["die"] for e in meta["dies"]] == [1, 0]
    cap = load_capture(cap_dir, layout_version=7)
    assert cap.num_dies == 2 and cap.num_events == 9
    assert cap.streams == [["main", "p2p.tx.1.0"], ["p2p.rx.0.0"]]
    assert cap.events[0] == die0()["events"] and cap.events[1] == die1()["events"]
    assert cap.call_names() == ["send"] and cap.warmup() == 1
    assert not list(cap_dir.glob("*.tmp"))


def test_layout_version_is_checked_only_when_asked(cap_dir):
    load_capture(cap_dir)  # None: not checked
    with pytest.raises(ProjectError, match=r"meta.json: layout_version 7, this xpod has 8"):
        load_capture(cap_dir, layout_version=8)


def test_no_meta_json_is_an_incomplete_capture(cap_dir):
    (cap_dir / "meta.json").unlink()
    with pytest.raises(ProjectError, match=r"cap/meta.json: missing: an incomplete capture"):
        load_capture(cap_dir)


def test_no_such_directory(tmp_path):
    with pytest.raises(ProjectError, match="no such capture directory"):
        load_capture(tmp_path / "nope")


def _edit_meta(cap_dir, **changes):
    meta = json.loads((cap_dir / "meta.json").read_text())
    meta.update(changes)
    (cap_dir / "meta.json").write_text(json.dumps(meta))
    return meta


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"format": "chakra"}, "format 'chakra' is not 'xpod-capture'"),
        ({"version": 2}, "version 2, this xpod reads version 1"),
        ({"num_dies": 3}, "dies must list 3 entries"),
        ({"calls": "send"}, "calls must be a list of call names: 'send'"),
        ({"warmup": -1}, "warmup must be an integer >= 0: -1"),
        ({"synthesized": "no"}, "synthesized must be true or false"),
    ],
)
def test_meta_refusals(cap_dir, changes, message):
    _edit_meta(cap_dir, **changes)
    with pytest.raises(ProjectError, match=re.escape(f"meta.json: {message}")):
        load_capture(cap_dir)


def test_a_missing_die_file(cap_dir):
    (cap_dir / "die-0001.msgpack").unlink()
    with pytest.raises(ProjectError, match=r"die-0001.msgpack: missing \(meta.json lists it for"):
        load_capture(cap_dir)


def test_a_truncated_die_file_fails_its_sha256(cap_dir):
    path = cap_dir / "die-0000.msgpack"
    path.write_bytes(path.read_bytes()[:-7])
    with pytest.raises(ProjectError, match=r"die-0000.msgpack: sha256 .* differs from meta.json"):
        load_capture(cap_dir)


def test_a_wrong_sha256_in_the_meta(cap_dir):
    meta = json.loads((cap_dir / "meta.json").read_text())
    meta["dies"][0]["sha256"] = "0" * 64
    (cap_dir / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ProjectError, match=r"die-0001.msgpack: sha256 .* a truncated or rewritten"):
        load_capture(cap_dir)


def test_an_event_count_that_differs_from_the_meta(cap_dir):
    meta = json.loads((cap_dir / "meta.json").read_text())
    meta["dies"][1]["events"] = 6
    (cap_dir / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ProjectError, match=r"die-0000.msgpack: 5 events, meta.json says 6"):
        load_capture(cap_dir)


def _rewrite(cap_dir, die: int, data: bytes) -> None:
    """Replace die `die`'s file with `data` and fix its sha256 in meta.json (listed in order)."""
    (cap_dir / f"die-{die:04d}.msgpack").write_bytes(data)
    meta = json.loads((cap_dir / "meta.json").read_text())
    meta["dies"][die]["sha256"] = hashlib.sha256(data).hexdigest()
    (cap_dir / "meta.json").write_text(json.dumps(meta))


def test_a_file_that_is_not_msgpack(tmp_path):
    cap_dir = write_capture(tmp_path / "c", {"layout_version": 7}, [die0(), die1()])
    _rewrite(cap_dir, 0, b"\xc1\xc1\xc1")
    with pytest.raises(ProjectError, match="die-0000.msgpack: not a msgpack die file"):
        load_capture(cap_dir)


@pytest.mark.parametrize(
    "event, message",
    [
        (["send", 0, 0, 0], "unknown kind 'send'"),
        (["put", 0, 0, 0, 1, 4096, "ring", 0, 0], "put has 9 items, expected 10"),
        (["put", 0, 0, 0, 2, 4096, "ring", 0, 0, 0], "field peer = 2 is not a die of the pod"),
        (["put", 0, 0, 0, 1, -1, "ring", 0, 0, 0], "field nbytes = -1 is not an integer >= 0"),
        (["pub", 0, 0, 0, 1, [1, 2], [1]], "the lists words / values differ in length"),
        (["acq", 0, 0, 0, [1], [1], [5], "f"], "field writers = \\[5\\] is not a list of dies"),
        (["copy", 3, 0, 0, 10], "stream 3 is not a stream id of this die"),
        (["after", 0, 0, 0, 1, 0], "field stream = 1 is not a stream id"),
        (["after", 0, 0, 0, 0, 4], "names event 4 of stream 0, which has 1 events"),
        (["end", 0, 0, 0, "send", 1, [[0]]], "field joins = \\[\\[0\\]\\] is not a list of"),
        (["op", 0, 0, 0, "x", 1, 1, 1, []], "field dims = \\[\\] is not a map"),
        ("put", "not an array"),
    ],
)
def test_malformed_events_are_refused_with_file_and_index(tmp_path, event, message):
    d0 = {"die": 0, "streams": ["main"], "events": [event]}
    cap_dir = write_capture(tmp_path / "c", {"layout_version": 7}, [d0, die1()])
    with pytest.raises(ProjectError, match=f"die-0000.msgpack: event 0: .*{message}"):
        load_capture(cap_dir)


def test_a_die_file_holding_another_die(tmp_path):
    cap_dir = write_capture(tmp_path / "c", {}, [die0(), die1()])
    body = msgpack.unpackb((cap_dir / "die-0001.msgpack").read_bytes())
    _rewrite(cap_dir, 1, msgpack.packb({**body, "die": 0}))
    with pytest.raises(ProjectError, match="die-0001.msgpack: holds die 0, meta.json lists it"):
        load_capture(cap_dir)
