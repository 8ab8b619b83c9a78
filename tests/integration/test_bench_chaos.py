"""`xpod bench chaos` end to end, as a soak: two servers (a fault-free baseline, then the same
arrivals under a fault of every recovered kind), 10 % of the clients leaving mid-stream; the run
must account for every stream (none lost, no token duplicated or skipped), verify every fault,
recover from every one, and leave nothing behind.

The delay kind (writes late, under the op deadline: no recovery) is left out of the soak: its
control is test_reliability's test_control_a_delay_under_the_op_deadline_changes_nothing.
Faults fire every 2 s from the engine's launch, kinds in turn (bench.chaos.fault_plan): the
slowest recovery (a stop, seen by the heartbeat after the 1.5 s stall timeout) takes ~1.6 s on
one core; what follows a stop is a die-side fault (armed through the die's fault_arm word, so
re-armed in a relaunched pod) or the end. err-die goes first: it fires at the first step with
load, however long the server took to start; kill-die, second, then lands under load."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
KINDS = "err-die,kill-die,stop-die,drop-die,kill-master,kvfault-die,stop-master"


@pytest.mark.timeout(400)
def test_chaos_soak_accounts_for_every_stream(tmp_path):
    out = tmp_path / "chaos.json"
    cmd = [sys.executable, "-m", "runtime.cli", "bench", "chaos", "--dies", "2", "--model",
           "tiny", "--duration", "14.5", "--fault-every", "2", "--kinds", KINDS,
           "--request-rate", "8", "--max-tokens", "48", "--abort-fraction", "0.1",
           "--op-timeout", "0.9", "--stall-timeout", "1.5",  # margin for a busy CI host
           "--json", str(out)]  # fmt: skip
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=380)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    s = json.loads(out.read_text().splitlines()[-1])
    assert s["requests"] >= 100 and s["client_aborts"] > 0  # the seeded arrivals: 107
    # at 2, 4, ..., 14 s (< 14.5 s): each of the 7 kinds once, each seen and recovered
    assert s["faults_injected"] == s["faults_verified"] == 7 and s["faults_not_fired"] == 0
    assert s["faults_detected"] == s["faults_recovered"] == 7
    assert sorted(s["by_kind"]) == sorted(KINDS.split(","))
    assert s["requests_accepted"] == s["requests"] and s["requests_lost"] == 0
    assert s["tokens_duplicated"] == s["tokens_skipped"] == 0 == s["token_gaps_server"]
    assert s["false_recoveries"] == 0 and s["leaks"] == []
    kinds = s["by_kind"]
    # a rollback seen as the link error itself, never by a deadline (how fast: the bench's
    # rollback_stall_max_s figure)
    errs = [f for f in s["faults"] if f["kind"] == "err-die"]
    assert errs and all(f["detected"] == "link" and f["tier"] == "rollback" for f in errs), errs
    assert kinds["err-die"]["stall_max_s"] is not None
    assert kinds["kill-die"]["restart_max_s"] is not None
    for key in ("throughput_ratio", "detect_kill_p50_s", "restart_p50_s", "restart_max_s",
                "rollback_stall_max_steps"):  # fmt: skip
        assert key in s
