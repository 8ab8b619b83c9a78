"""`xpod project CAPTURE_DIR --profile P [--json F] [--trace F]` (runtime.cli.project): a good
capture prints its projected table and writes both files; a refused one prints one line
`xpod project: error: ...`, exits 2 and writes nothing."""

from __future__ import annotations

import json

import pytest

from memory.layout import LAYOUT_VERSION
from runtime.cli.main import main
from runtime.project import write_capture


def send_recv_capture(path, calls: int = 3, layout_version: int = LAYOUT_VERSION):
    """Die 0 sends 64 KiB to die 1 `calls` times (one lane, one put + tail pub each), die 1
    acknowledges each; `send` and `recv` calls, the first one warm-up."""
    tx, rx = [], []
    for c in range(calls):
        tx += [["begin", 0, 0, 0, "send", c], ["put", 0, 0, 0, 1, 65536, "ring", 0, 0, 0],
               ["pub", 0, 0, 0, 1, [100], [c + 1]], ["acq", 0, 0, 0, [200], [c + 1], [1], "ack"],
               ["end", 0, 0, 0, "send", c, []]]  # fmt: skip
        rx += [["begin", 0, 0, 0, "recv", c], ["acq", 0, 0, 0, [100], [c + 1], [0], "tail"],
               ["copy", 0, 0, 0, 65536], ["pub", 0, 0, 0, 0, [200], [c + 1]],
               ["end", 0, 0, 0, "recv", c, []]]  # fmt: skip
    meta = {"layout_version": layout_version, "workload": {"bench": "p2p", "size": 65536},
            "calls": ["send", "recv"], "warmup": 1}  # fmt: skip
    dies = [{"die": 0, "streams": ["p2p.tx.1.0"], "events": tx},
            {"die": 1, "streams": ["p2p.rx.0.0"], "events": rx}]  # fmt: skip
    return write_capture(path, meta, dies)


def test_a_good_capture_prints_the_table_and_writes_json_and_trace(tmp_path, capsys):
    cap = send_recv_capture(tmp_path / "cap")
    out_json, out_trace = tmp_path / "p.json", tmp_path / "t.json"
    argv = ["project", str(cap), "--profile", "cm384", "--json", str(out_json),
            "--trace", str(out_trace)]  # fmt: skip
    assert main(argv) == 0
    stdout = capsys.readouterr().out
    rows = [line for line in stdout.splitlines() if line.startswith(("send ", "recv "))]
    assert len(rows) == 2 and all(r.endswith("projected (cm384)") for r in rows)
    assert "contention model: one engine per (die, stream)" in stdout
    doc = json.loads(out_json.read_text())
    assert doc["profile"] == "cm384" and len(doc["profile_sha256"]) == 64
    assert doc["capture"] == {"workload": {"bench": "p2p", "size": 65536}, "num_dies": 2,
                              "events": 30, "synthesized": False}  # fmt: skip
    send = doc["projected"]["calls"]["send"]
    assert send["count"] == 2 and send["warmup"] == 1 and len(send["per_call"]) == 3
    assert 0 < send["p50_us"] <= send["p99_us"] <= send["max_us"]
    assert f"{send['p50_us']:.2f}" in rows[0]
    trace = json.loads(out_trace.read_text())
    ev = trace["traceEvents"]
    names = {e["args"]["name"] for e in ev if e["name"] == "process_name"}
    assert names == {"die 0 (projected cm384)", "die 1 (projected cm384)"}
    threads = {(e["pid"], e["args"]["name"]) for e in ev if e["name"] == "thread_name"}
    assert threads == {(0, "p2p.tx.1.0"), (1, "p2p.rx.0.0")}
    puts = [e for e in ev if e["ph"] == "X" and e["args"]["kind"] == "put"]
    assert len(puts) == 3 and puts[0]["args"]["bytes"] == 65536 and puts[0]["args"]["peer"] == 1
    assert all(e["dur"] >= 0 for e in ev if e["ph"] == "X")
    counters = {(e["pid"], e["name"]) for e in ev if e["ph"] == "C"}
    assert (0, "egress GB/s") in counters and (1, "ingress GB/s") in counters
    assert max(e["args"]["GB/s"] for e in ev if e["ph"] == "C") > 0
    assert trace["otherData"]["profile_sha256"] == doc["profile_sha256"]
    assert not list(tmp_path.glob("*.tmp"))


@pytest.mark.parametrize(
    "broken, message",
    [
        ("meta", "meta.json: missing: an incomplete capture"),
        ("layout", f"layout_version 1, this xpod has {LAYOUT_VERSION}"),
        ("profile", "no such profile"),
        ("incomplete", "trace incomplete: die 0 stream 0 seq 3 waits for word 200 >= 1 of die 1"),
    ],
)
def test_a_refused_projection_is_one_line_exit_2_and_writes_nothing(tmp_path, capsys, broken,
                                                                     message):  # fmt: skip
    cap = send_recv_capture(tmp_path / "cap", layout_version=1 if broken == "layout" else
                            LAYOUT_VERSION)  # fmt: skip
    if broken == "meta":
        (cap / "meta.json").unlink()
    if broken == "incomplete":  # die 1 never acknowledges
        tx = [["put", 0, 0, 0, 1, 64, "ring", 0, 0, 0], ["pub", 0, 0, 0, 1, [100], [1]],
              ["copy", 0, 0, 0, 8], ["acq", 0, 0, 0, [200], [1], [1], "ack"]]  # fmt: skip
        rx = [["acq", 0, 0, 0, [100], [1], [0], "tail"]]
        write_capture(cap, {"layout_version": LAYOUT_VERSION},
                      [{"die": 0, "streams": ["main"], "events": tx},
                       {"die": 1, "streams": ["main"], "events": rx}])  # fmt: skip
    out_json = tmp_path / "p.json"
    profile = "tpu9" if broken == "profile" else "cm384"
    status = main(["project", str(cap), "--profile", profile, "--json", str(out_json)])
    err = capsys.readouterr().err
    assert status == 2
    assert err.count("\n") == 1 and err.startswith("xpod project: error: ")
    assert message in err
    assert not out_json.exists() and not list(tmp_path.glob("*.tmp"))


def test_the_capture_directory_is_required(capsys):
    assert main(["project", "--profile", "cm384"]) == 2
    assert capsys.readouterr().err == (
        "xpod project: error: the following arguments are required: CAPTURE_DIR\n"
    )
