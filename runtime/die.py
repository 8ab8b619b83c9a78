"""A die: one OS process that owns one HBM region and maps every other die's.

`Die` is what `pod.run(fn, ...)` passes to `fn`: a `comm.Endpoint` (so `comm.send(die, ...)`
works) plus the pod configuration and the app-area allocator. `die_main` is the process entry:
attach, report ready, then run commands from the launcher's private pipe until told to stop or the
launcher goes away.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import pickle
import signal
import sys
import time
import traceback

import numpy as np

import comm
from comm.trace import Trace
from memory.alloc import AppAllocator
from memory.heap import keep_freed_memory
from memory.region import Region, RegionHandle, region_name
from runtime import control as C
from runtime.blas import limit_blas_threads
from runtime.config import PodConfig

log = logging.getLogger(__name__)
PR_SET_PDEATHSIG = 1


class Die(comm.Endpoint):
    """The calling die inside `pod.run` functions.

    Attributes:
        die_id, num_dies: identity in the pod.
        config: the PodConfig the pod was launched with.
        region: this die's Region (`region.layout` decodes every field).
        allocator: the app-area allocator (`die.alloc` / `die.free`).
        trace: this die's protocol trace (`die.trace.enabled = True` to record).
    """

    def __init__(self, die_id: int, config: PodConfig, regions: list[Region], ctl=None):
        abort = (ctl.words, C.W_ABORT, ctl.words[C.W_ABORT]) if ctl is not None else None
        super().__init__(
            die_id,
            regions,
            config.wait_policy(),
            ub_bytes=config.ub_bytes,
            trace=Trace(die_id, config.trace_capacity, config.trace),
            abort=abort,
        )
        self.config = config
        self.region = regions[die_id]
        self.ctl = ctl
        lo = self.layout
        self.allocator = AppAllocator(self.region.app, lo.app_off, f"die {die_id} app area")
        self.user: dict = {}  # scratch space that survives between pod.run calls

    def alloc(self, shape, dtype=np.uint8, align: int = 64) -> np.ndarray:
        """A zeroed array in this die's app area (see `memory.AppAllocator.alloc`)."""
        return self.allocator.alloc(shape, dtype, align)

    def free(self, arr: np.ndarray) -> None:
        self.allocator.free(arr)

    def barrier(self) -> None:
        comm.barrier(self)

    def _arm_abort(self, epoch: int) -> None:
        if self.ctl is not None:
            self.ctx.abort = (self.ctl.words, C.W_ABORT, epoch)

    def __repr__(self) -> str:
        return f"Die({self.die_id}/{self.num_dies})"


def _set_pdeathsig() -> None:
    """Ask the kernel to SIGKILL this die when the launcher dies, so no die outlives its pod."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        log.warning("prctl(PR_SET_PDEATHSIG) unavailable; dies may outlive a killed launcher")


def _pin(die_id: int, config: PodConfig) -> None:
    if config.pinned():
        cpus = sorted(os.sched_getaffinity(0))[: config.cores]
        os.sched_setaffinity(0, {cpus[die_id % len(cpus)]})


def die_main(die_id: int, cfg: dict, pod_id: str, conn, launcher_pid: int) -> None:
    """Entry point of a die process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the launcher's to handle
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _set_pdeathsig()
    if os.getppid() != launcher_pid:  # the launcher died before prctl took effect
        os._exit(3)
    logging.basicConfig(format=f"die {die_id} %(levelname)s %(name)s: %(message)s")
    keep_freed_memory()  # numpy temporaries reuse heap pages instead of faulting (memory.heap)
    limit_blas_threads(1)  # a die's matmuls must not spin up workers on its peers' cores
    try:
        config = PodConfig.from_dict(cfg)
        _pin(die_id, config)
        ctl = C.Control.attach(pod_id)
        ctl.words[C.W_DIE_PID + die_id] = os.getpid()
        layout = config.layout()
        regions = [
            Region.attach(RegionHandle(region_name(pod_id, r), r), layout)
            for r in range(config.num_dies)
        ]
        die = Die(die_id, config, regions, ctl)
    except BaseException as e:  # noqa: BLE001 - reported to the launcher, then exit non-zero
        _send_error(conn, e)
        sys.exit(1)
    conn.send(("ready", die_id, os.getpid()))
    _serve(die, conn)
    die.close()


def _serve(die: Die, conn) -> None:
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return  # the launcher is gone
        if msg[0] == "stop":
            return
        _, fn, args, epoch = msg
        die._arm_abort(epoch)
        cpu0 = time.process_time()
        try:
            result = fn(die, *args)
        except BaseException as e:  # noqa: BLE001 - every error goes back to the launcher
            _send_error(conn, e)
            continue
        cpu_s = time.process_time() - cpu0
        try:
            conn.send(("ok", result, cpu_s))
        except (pickle.PicklingError, TypeError, AttributeError) as e:
            _send_error(conn, TypeError(f"die {die.die_id}: result cannot be pickled: {e}"))


def _send_error(conn, e: BaseException) -> None:
    tb = traceback.format_exc()
    try:
        blob = pickle.dumps(e)
    except (pickle.PicklingError, TypeError, AttributeError):
        blob = pickle.dumps(RuntimeError(f"{type(e).__name__}: {e}"))
    # If the launcher is gone there is nobody to tell.
    with contextlib.suppress(OSError, EOFError):
        conn.send(("err", blob, tb))
