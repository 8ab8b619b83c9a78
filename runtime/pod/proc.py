"""What every xpod process does to itself at start: follow its parent, one BLAS thread, a
core of its own, SCHED_BATCH. Dies (`runtime.pod.die`), masters and output processes
(`runtime.engine`), the HTTP shell and the single-process references all take it from here.

One BLAS thread: numpy's OpenBLAS starts one worker thread per core and its workers spin for a
while after each call. A die is one emulated NPU core-group on a machine whose cores are shared
by every die, so those workers only steal the cores the other dies need (on 2 cores they doubled
a die's CPU per decode step). `limit_blas_threads(1)` is called by every die at start and by the
single-process reference runs, which are defined to use one core. It finds the OpenBLAS library
already mapped into the process (numpy's wheels bundle `libscipy_openblas64_`, distributions link
`libopenblas`) and calls its `*_set_num_threads`; for any other BLAS it does nothing and says so.
Results do not depend on the thread count here (the reference's logits are byte-identical with 1
and 2 threads).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal

log = logging.getLogger(__name__)
PR_SET_PDEATHSIG = 1  # prctl(2) option

_SETTERS = ("scipy_openblas_set_num_threads64_", "openblas_set_num_threads64_",
            "openblas_set_num_threads")  # fmt: skip
_GETTERS = ("scipy_openblas_get_num_threads64_", "openblas_get_num_threads64_",
            "openblas_get_num_threads")  # fmt: skip


def _openblas_libs() -> list[str]:
    import numpy  # noqa: F401 - loads the BLAS numpy links

    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "openblas" in line.lower()}
    except OSError:
        return []
    return sorted(p for p in paths if p.startswith("/"))


def _call(names: tuple[str, ...], *args: int) -> int | None:
    for path in _openblas_libs():
        lib = ctypes.CDLL(path)
        for name in names:
            fn = getattr(lib, name, None)
            if fn is not None:
                return int(fn(*args) or 0) if args else int(fn())
    return None


def limit_blas_threads(n: int = 1) -> bool:
    """Set OpenBLAS's thread count in this process; False when no OpenBLAS is loaded."""
    return _call(_SETTERS, int(n)) is not None


def blas_threads() -> int | None:
    """OpenBLAS's current thread count, or None when no OpenBLAS is loaded."""
    return _call(_GETTERS)


def parent_death_signal(sig: int = signal.SIGTERM) -> bool:
    """Ask the kernel to send this process `sig` when its parent (thread) exits, so no die,
    master or output process outlives the process that started it. False, with a warning,
    where prctl is unavailable. The caller checks `os.getppid()` afterwards: a parent that died
    before the call is not signalled."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):
        log.warning("prctl(PR_SET_PDEATHSIG) unavailable: this process may outlive its parent")
        return False
    return True


def follow_parent(parent_pid: int) -> bool:
    """The start of every child process of xpod (die, master, output process): Ctrl-C and a
    closed terminal (SIGINT, SIGHUP: sent to the whole process group) are the parent's to
    handle, and the parent's exit sends this process SIGTERM. False if the parent is already
    gone (it died before the request took effect): the caller cleans up and exits.

    A child forked while the parent's event loop handles its signals (a serving engine's
    restart) would inherit that loop's wakeup fd: its signals would only write a byte to the
    parent's pipe. The fd is cleared here; a child that does not install its own SIGTERM
    handler must restore the default (`default_sigterm`), or its parent-death signal does
    nothing (found as two masters a SIGKILLed server left behind)."""
    with contextlib.suppress(ValueError):  # not the main thread: nothing was inherited
        signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    parent_death_signal(signal.SIGTERM)
    return os.getppid() == parent_pid


def default_sigterm() -> None:
    """SIGTERM kills this process (a child whose parent-death signal must end it)."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def pin_to_core(index: int, cores: int) -> int:
    """Pin this process to the `index`-th (mod `cores`) of the first `cores` CPUs it may use;
    returns that CPU."""
    cpus = sorted(os.sched_getaffinity(0))[:cores]
    cpu = cpus[index % len(cpus)]
    os.sched_setaffinity(0, {cpu})
    return cpu


def batch_scheduling(all_threads: bool = False) -> int:
    """SCHED_BATCH for this process (its calling thread, or every thread with `all_threads`);
    returns how many threads were set (0 where the policy is unavailable).

    A helper process (master, output process, the HTTP shell) sleeps most of the time; under the
    default policy its wake-up preempts the die that rang it mid-step, and the whole lockstep pod
    waits for that die (~0.8 ms per step of 11 on a 4-die pod, measured with cProfile). As a batch
    task it runs when a die yields or waits, which the dies of a lockstep step do all the time.
    Threads made later inherit the policy of the thread that makes them; processes forked before
    keep theirs.
    """
    tids = [int(t) for t in os.listdir("/proc/self/task")] if all_threads else [0]
    n = 0
    for tid in tids:
        with contextlib.suppress(OSError, AttributeError, ValueError):
            os.sched_setscheduler(tid, os.SCHED_BATCH, os.sched_param(0))
            n += 1
    return n
