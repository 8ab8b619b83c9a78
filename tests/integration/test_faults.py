"""Every fault kind injected once (issue 8, "Done when"): SIGKILL and SIGSTOP of a die while the
pod is idle and mid-p2p / mid-dispatch / mid-combine / mid-decode, and SIGKILL / SIGTERM /
SIGINT of the launcher idle and mid-run. Checks the error, the time to report it, and that
nothing is left in /dev/shm or the process table (`bench.faults` measures the same over many
injections: `xpod bench faults --repeat 10`).
"""

from __future__ import annotations

import pytest

from bench import faults

# How fast a fault is reported is `xpod bench faults`' figure (issue 8.5's bar: a kill in 0.3 s),
# not a test's: the bounds here only tell the mechanism from the next one that would report the
# fault, on any machine (half of that one's deadline)
KILL_TIMEOUT_S = 60.0  # a killed die: its peers' deadline, which must not be what reports it
HUNG_TIMEOUT_S = 1.0  # a stopped die is hung after its deadline
HANG_S = 30.0  # a report later than this after it could be known is a hang


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", faults.DIE_KINDS)
def test_die_fault_is_reported_and_leaves_nothing(kind):
    kill = "-kill-" in kind
    shot = faults.inject(kind, KILL_TIMEOUT_S if kill else HUNG_TIMEOUT_S)
    assert shot.leaks == [], shot
    assert shot.die_id == faults.VICTIM, shot
    assert f"die {faults.VICTIM} (pid" in shot.message, shot.message
    if kill:
        assert shot.error == "DieCrashed", shot
        assert "SIGKILL" in shot.message and "closed" in shot.message, shot.message
        assert shot.detect_s < KILL_TIMEOUT_S / 2, shot  # seen dead, not timed out
    else:
        assert shot.error == "DieHung", shot
        assert "stopped" in shot.message and "killed" in shot.message, shot.message
        assert shot.detect_s < HANG_S, shot


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", faults.LAUNCHER_KINDS)
def test_launcher_fault_leaves_nothing(kind):
    shot = faults.inject(kind)
    assert shot.leaks == [], shot
    assert shot.detect_s < HANG_S, shot
