"""Every fault kind injected once (issue 8, "Done when"): SIGKILL and SIGSTOP of a die while the
pod is idle and mid-p2p / mid-dispatch / mid-combine / mid-decode, and SIGKILL / SIGTERM /
SIGINT of the launcher idle and mid-run. Checks the error, the time to report it, and that
nothing is left in /dev/shm or the process table (`bench.faults` measures the same over many
injections: `xpod bench faults --repeat 10`).
"""

from __future__ import annotations

import pytest

from bench import faults

KILL_REPORT_S = 0.3  # issue 8.5: DieCrashed < 0.3 s after the kill
HUNG_REPORT_S = 1.0  # a stopped die: killed and reported within this after its deadline
TIMEOUT_S = 1.0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", faults.DIE_KINDS)
def test_die_fault_is_reported_fast_and_leaves_nothing(kind):
    shot = faults.inject(kind, TIMEOUT_S)
    assert shot.leaks == [], shot
    assert shot.die_id == faults.VICTIM, shot
    assert f"die {faults.VICTIM} (pid" in shot.message, shot.message
    if "-kill-" in kind:
        assert shot.error == "DieCrashed", shot
        assert "SIGKILL" in shot.message and "closed" in shot.message, shot.message
        assert shot.detect_s < KILL_REPORT_S, shot
    else:
        assert shot.error == "DieHung", shot
        assert "stopped" in shot.message and "killed" in shot.message, shot.message
        assert shot.detect_s < HUNG_REPORT_S, shot


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", faults.LAUNCHER_KINDS)
def test_launcher_fault_leaves_nothing(kind):
    shot = faults.inject(kind)
    assert shot.leaks == [], shot
    assert shot.detect_s < (1.0 if "-kill-" in kind else 3.0), shot
