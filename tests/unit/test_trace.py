"""comm.trace: the bounded record buffer, steps_of, and the Chrome trace-event export."""

from __future__ import annotations

import json

from comm.trace import RECORD_FIELDS, STEP_NAMES, Trace, steps_of, to_chrome, write_chrome

# (t_ns, dur_ns, op, step, peer, lane, event_id, nbytes)
RECS = {
    0: [
        (1_000, 500, "send", 1, 1, 0, 7, 64),
        (1_500, 200, "send", 2, 1, 0, 7, 64),
        (1_700, 0, "send", 3, 1, 0, 7, 64),
        (1_800, 0, "send", 3, 1, 1, 7, 64),
    ],
    1: [
        (900, 1_000, "recv", 5, 0, 0, 7, 0),
        (2_000, 300, "recv", 6, 0, 0, 7, 64),
        (2_300, 0, "recv", 7, 0, 0, 7, 64),
    ],
    2: [],
}


def test_record_fields():
    assert RECORD_FIELDS == ("t_ns", "dur_ns", "op", "step", "peer", "lane", "event_id", "nbytes")


def test_trace_is_bounded_and_keeps_the_newest():
    tr = Trace(3, capacity=4, enabled=True)
    for i in range(10):
        tr.rec(i, 0, "send", 3, 1, 0, i, 8)
    snap = tr.snapshot()
    assert [r[0] for r in snap] == [6, 7, 8, 9]
    assert snap[0] == (6, 0, "send", 3, 1, 0, 6, 8)
    tr.clear()
    assert tr.snapshot() == []


def test_trace_disabled_by_default():
    assert Trace(0).enabled is False


def test_steps_of_orders_by_time_and_filters():
    recs = RECS[0] + RECS[1]
    assert steps_of(recs, "recv") == [("recv", 5), ("recv", 6), ("recv", 7)]
    assert steps_of(recs, "send", peer=1) == [("send", 1), ("send", 2), ("send", 3), ("send", 3)]
    assert steps_of(recs, "send", peer=5) == []
    assert steps_of(recs)[0] == ("recv", 5)  # earliest start


def test_steps_of_ties_broken_by_end_time():
    recs = [(10, 5, "x", 2, 0, 0, 0, 0), (10, 0, "x", 1, 0, 0, 0, 0)]
    assert steps_of(recs) == [("x", 1), ("x", 2)]


def test_chrome_has_process_name_metadata_per_die():
    doc = to_chrome(RECS)
    meta = [e for e in doc["traceEvents"] if e["ph"] == "M"]
    names = {e["pid"]: e["args"]["name"] for e in meta if e["name"] == "process_name"}
    assert names == {0: "die 0", 1: "die 1", 2: "die 2"}
    threads = {(e["pid"], e["tid"]) for e in meta if e["name"] == "thread_name"}
    assert threads == {(0, 0), (0, 1), (1, 0)}


def test_chrome_x_and_instant_events():
    doc = to_chrome(RECS)
    evs = [e for e in doc["traceEvents"] if e["ph"] != "M"]
    assert len(evs) == sum(len(r) for r in RECS.values())
    for e in evs:
        assert e["ph"] in ("X", "i")
        assert {"name", "cat", "pid", "tid", "ts", "args"} <= set(e)
        assert set(e["args"]) == {"peer", "event_id", "bytes"}
        if e["ph"] == "X":
            assert e["dur"] > 0
        else:
            assert e["s"] == "t" and "dur" not in e
    first = min(evs, key=lambda e: e["ts"])
    assert first["ts"] == 0  # relative to the earliest record, in microseconds
    x = next(e for e in evs if e["pid"] == 0 and e["ph"] == "X" and e["cat"] == "send")
    assert x["ts"] == (1_000 - 900) / 1e3 and x["dur"] == 0.5
    assert x["name"] == f"send {STEP_NAMES[('send', 1)]}"
    inst = [e for e in evs if e["ph"] == "i"]
    assert len(inst) == 3


def test_chrome_unknown_step_name_falls_back_to_number():
    doc = to_chrome({0: [(0, 0, "mystery", 42, 1, 0, 0, 0)]})
    ev = [e for e in doc["traceEvents"] if e["ph"] != "M"][0]
    assert ev["name"] == "mystery 42"


def test_chrome_empty():
    assert to_chrome({})["traceEvents"] == []


def test_write_chrome_is_valid_json(tmp_path):
    path = tmp_path / "t.json"
    n = write_chrome(str(path), RECS)
    doc = json.loads(path.read_text())
    assert n == 7
    assert doc == json.loads(json.dumps(to_chrome(RECS)))


def test_every_protocol_step_has_a_name():
    steps = {
        "send": {1, 2, 3, 4, 8},
        "recv": {5, 6, 7},
        "dma_send": {2, 3},
        "dma_recv": {5, 6, 7},
        "zc_send": {0, 2, 3},
        "zc_recv": {0, 5, 7},
    }
    for op, nums in steps.items():
        for s in nums:
            assert (op, s) in STEP_NAMES
            assert STEP_NAMES[(op, s)].startswith(str(s))
