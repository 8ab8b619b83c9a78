"""What a capture pod holds in memory while it runs: a sampler thread in the launcher.

Every `interval_s` it reads, for each die process, its proportional set size (PSS: private
pages plus its share of the shared segments it touched) and unique set size (USS: pages only it
holds), and the bytes used in /dev/shm (the regions' touched pages). psutil reads
/proc/PID/smaps_rollup; a die that exits between two samples is skipped. The peaks are over the
samples, so a spike shorter than the interval can be missed: the figures are resident memory
at the sampling points, stated as such.
"""

from __future__ import annotations

import shutil
import threading
from dataclasses import dataclass, field

import psutil

MiB = 1 << 20


@dataclass
class MemWatch:
    """Samples die processes' memory every `interval_s` from `start()` until `stop()`."""

    pids: list[int]
    shm_base: int | None = None  # /dev/shm bytes used before the pod launched (default: at start)
    interval_s: float = 1.0
    samples: int = 0
    peak_pss_total: int = 0  # bytes: the largest sum of the dies' PSS at one sample
    peak_uss_die: int = 0  # bytes: the largest USS of one die at any sample
    peak_shm_used: int = 0  # bytes used in /dev/shm, largest sample
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> MemWatch:
        self._shm0 = shm_used() if self.shm_base is None else self.shm_base
        self._procs = [psutil.Process(p) for p in self.pids]
        self._thread = threading.Thread(target=self._run, name="xpod-memwatch", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while True:
            self.sample()
            if self._stop.wait(self.interval_s):
                return

    def sample(self) -> None:
        """One sample of every die (and /dev/shm)."""
        total = 0
        for p in self._procs:
            try:
                info = p.memory_full_info()
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
            total += info.pss
            self.peak_uss_die = max(self.peak_uss_die, info.uss)
        self.peak_pss_total = max(self.peak_pss_total, total)
        self.peak_shm_used = max(self.peak_shm_used, shm_used() - self._shm0)
        self.samples += 1

    def stop(self) -> dict:
        """Stop sampling; the figures in MiB (per die: the peak total over the dies)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        n = max(1, len(self.pids))
        return {
            "mem_samples": self.samples,
            "peak_pss_mib_per_die": round(self.peak_pss_total / n / MiB, 1),
            "peak_pss_mib_total": round(self.peak_pss_total / MiB, 1),
            "peak_uss_mib_max_die": round(self.peak_uss_die / MiB, 1),
            "peak_shm_mib": round(self.peak_shm_used / MiB, 1),  # the pod's touched segments
        }


def shm_used() -> int:
    """Bytes used in /dev/shm (0 if it cannot be read)."""
    try:
        return shutil.disk_usage("/dev/shm").used
    except OSError:
        return 0


__all__ = ["MemWatch", "shm_used"]
