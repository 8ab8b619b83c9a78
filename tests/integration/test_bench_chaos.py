"""`xpod bench chaos` end to end, as a soak: two servers (a fault-free baseline, then the same
arrivals under a fault of every kind), 10 % of the clients leaving mid-stream; the run must
account for every stream (none lost, no token duplicated or skipped), verify every fault,
recover from every one but the delay, and leave nothing behind."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
KINDS = "kill-die,err-die,stop-die,drop-die,kill-master,kvfault-die,stop-master,delay-die"


@pytest.mark.timeout(400)
def test_chaos_soak_accounts_for_every_stream(tmp_path):
    out = tmp_path / "chaos.json"
    cmd = [sys.executable, "-m", "runtime.cli", "bench", "chaos", "--dies", "2", "--model",
           "tiny", "--duration", "20", "--fault-every", "2.2", "--kinds", KINDS,
           "--request-rate", "8", "--max-tokens", "48", "--abort-fraction", "0.1",
           "--op-timeout", "0.9", "--stall-timeout", "1.5",  # margin for a busy CI host
           "--json", str(out)]  # fmt: skip
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=380)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    s = json.loads(out.read_text().splitlines()[-1])
    assert s["requests"] >= 120 and s["client_aborts"] > 0
    assert s["faults_injected"] == s["faults_verified"] == 9  # 20 s / 2.2 s: each kind once+
    assert s["faults_detected"] == s["faults_recovered"] == 8  # all but the delay
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
