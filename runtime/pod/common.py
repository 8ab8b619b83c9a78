"""What both launchers share (`runtime.pod.launcher.Pod` on one host, `runtime.pod.mpi_launch.
MpiPod` over hosts): the errors that name a dead or hung die, the abort deadlines, the SIGTERM
guard, the choice of the root error, and the internal functions they run on every die."""

from __future__ import annotations

import signal
import threading

from memory.errors import PeerRefused, PodAborted, PodError

ABORT_GRACE_S = 0.5  # after a die's error, how long the others may finish before being aborted
ABORT_REPLY_S = 1.0  # after the abort, how long a die may take to answer before it is hung


class DieCrashed(PodError):
    """A die process exited (or was found dead at the next `pod.run`); the pod has been closed."""


class DieHung(DieCrashed):
    """A die stopped answering (stopped by a signal, or stuck where it cannot see the abort);
    the launcher killed it and closed the pod."""


class SigtermGuard:
    """SIGTERM and SIGHUP -> SystemExit while any pod of this process is open, so `with` blocks
    tear down (a closed terminal sends SIGHUP; a SIGHUP already ignored, under nohup, stays so).

    One handler for all pods: installed when the first pod opens, the previous handlers
    restored when the last one closes (pods may close in any order).
    """

    SIGNALS = (signal.SIGTERM, signal.SIGHUP)

    def __init__(self) -> None:
        self.pods: set[int] = set()
        self.previous: dict = {}

    def acquire(self, pod: object) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        if not self.pods:
            for sig in self.SIGNALS:
                if signal.getsignal(sig) is not signal.SIG_IGN:
                    self.previous[sig] = signal.signal(sig, _on_sigterm)
        self.pods.add(id(pod))

    def release(self, pod: object) -> None:
        if id(pod) not in self.pods or threading.current_thread() is not threading.main_thread():
            return
        self.pods.discard(id(pod))
        if not self.pods:
            for sig, handler in self.previous.items():
                signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
            self.previous = {}


def _on_sigterm(signum, frame):
    raise SystemExit(128 + signum)


SIGTERM_GUARD = SigtermGuard()


SECONDARY = (PodAborted, PeerRefused)  # consequences of another die's error, never its cause


def root_error(errors: list[tuple[int, BaseException]], overdue: BaseException | None):
    """The error to raise: the first that is not a consequence of another die's error; the
    other dies' errors become one note each."""
    if not errors:
        return overdue
    root = next((e for _, e in errors if not isinstance(e, SECONDARY)), errors[0][1])
    for r, e in errors:
        if e is not root:
            first = str(e).split("\n", 1)[0]
            root.add_note(f"--- die {r} also raised {type(e).__name__}: {first}")
    return root


def resync_die(die, phase: int, counters: list[int] | None):
    from comm.alltoall import a2a_counters, a2a_realign
    from comm.p2p import resync

    if phase == 1:
        die.close()  # stop the DMA engine; a new one starts on demand
        return None
    if phase == 2:
        resync(die)
        return a2a_counters(die)
    a2a_realign(die, counters)
    return None


def set_trace(die, enabled: bool) -> None:
    die.trace.enabled = enabled


def get_trace(die, clear: bool) -> list[tuple]:
    recs = die.trace.snapshot()
    if clear:
        die.trace.clear()
    return recs


class PodApi:
    """What `Pod` and `MpiPod` offer alike on top of their own `run` / `close`: the context
    manager, the dies' traces, the segment names."""

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def set_trace(self, enabled: bool) -> None:
        self.run(set_trace, enabled)

    def trace_records(self, clear: bool = False) -> dict[int, list[tuple]]:
        """Every die's trace records, by die id."""
        return dict(enumerate(self.run(get_trace, clear)))

    def write_trace(self, path: str, clear: bool = False) -> int:
        """Write every die's trace as Chrome trace JSON (Perfetto); returns the event count."""
        from comm.trace import write_chrome

        return write_chrome(path, self.trace_records(clear))

    def segment_names(self) -> list[str]:
        """Every segment of the pod (a multi-host pod's: on whichever host each lives)."""
        from memory.region import region_name
        from runtime.pod.control import ctl_name

        names = [region_name(self.pod_id, r) for r in range(self.config.num_dies)]
        return names + [ctl_name(self.pod_id)]


__all__ = [
    "ABORT_GRACE_S", "ABORT_REPLY_S", "SECONDARY", "SIGTERM_GUARD", "DieCrashed", "DieHung",
    "PodApi", "SigtermGuard", "get_trace", "resync_die", "root_error", "set_trace",
]  # fmt: skip
