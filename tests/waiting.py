"""Waits of the integration tests that hold on any machine's speed.

A test waits on a state that, once reached, stays until the test moves on: a counter that only
grows, a finished request, a process the test stopped (SIGSTOP) so that what it holds cannot end.
It never polls for a short window (a request that is "running" for 0.1 s on a fast machine) and
never bounds a machine's speed: the timeouts here are deadlines for a hang, not for slowness.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

from runtime.engine.faults import proc_state

T = TypeVar("T")
HANG_S = 30.0  # a wait this long is a hang on any machine, not a slow one


def wait_for(cond: Callable[[], T], timeout_s: float = HANG_S, what: str = "") -> T:
    """Poll `cond` until it returns a true value (returned); AssertionError after `timeout_s`.
    `cond` must test a state that stays once reached (the module docstring)."""
    deadline = time.monotonic() + timeout_s
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(0.01)


@contextlib.contextmanager
def stopped(*pids: int) -> Iterator[None]:
    """SIGSTOP every pid for the block (SIGCONT after it, whatever happens): what they hold
    (a request on a die, messages in a master's inbox) cannot move on until the block ends."""
    done = []
    try:
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
            done.append(pid)
        for pid in pids:  # delivered: not one more instruction runs in the block
            wait_for(lambda pid=pid: proc_state(pid) in ("T", "t"), what=f"pid {pid} to stop")
        yield
    finally:
        for pid in done:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
