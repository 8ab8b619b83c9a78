"""The KV pool over emulated hosts under `xpod bench chaos` (the multi-host suite: `make
test-multihost`; the pool's behaviour over hosts is in the main suite's test_pool_hosts.py):
host 1's pool server killed, host 0's stopped, under conversations."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.multihost


@pytest.mark.timeout(150)
def test_bench_chaos_over_hosts_kills_one_hosts_server_and_stops_the_other(tmp_path):
    """Two emulated hosts, one pool server each: host 1's server killed (restarted), host 0's
    stopped, under conversations; every request completes with the baseline's tokens."""
    out = tmp_path / "chaos.json"
    cmd = [sys.executable, "-m", "runtime.cli", "bench", "chaos", "--hosts", "1,1", "--model",
           "tiny", "--kv-pool", "--pool-dram-mib", "1", "--pool-ssd-mib", "16",
           "--dataset", "multi-turn", "--mt-turns", "3", "--max-tokens", "16",
           "--request-rate", "8", "--duration", "6", "--batch-invariant",
           "--inject", "kill:pool=1,at=2s; stop:pool=0,at=4s,for=1.5s",
           "--op-timeout", "2", "--stall-timeout", "3", "--json", str(out)]  # fmt: skip
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=140)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    s = json.loads(out.read_text().splitlines()[-1])
    assert s["hosts"] == "1,1" and s["dies"] == 2, s
    assert s["requests_sent"] == s["requests_completed"] == s["requests_accepted"] > 0, s
    assert s["requests_lost"] == s["token_gaps_server"] == s["streams_differing"] == 0, s
    assert s["faults_injected"] == s["faults_verified"] == 2 and s["leaks"] == [], s
    assert s["pool_kills"] == s["pool_stops"] == s["pool_restarts"] == 1, s
