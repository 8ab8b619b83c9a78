"""A die: one OS process that owns one HBM region and maps every other die's.

`Die` is what `pod.run(fn, ...)` passes to `fn`: a `comm.Endpoint` (so `comm.send(die, ...)`
works) plus the pod configuration and the app-area allocator. `die_main` is the process entry:
attach, report ready, then run commands from the launcher's private pipe until told to stop or the
launcher goes away.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import shutil
import signal
import sys
import time
import traceback

import numpy as np

import comm
from comm.trace import Trace
from memory.alloc import AppAllocator
from memory.errors import ShmError
from memory.heap import keep_freed_memory
from memory.region import Region, RegionHandle, region_name, unlink_segment
from runtime.pod import control as C
from runtime.pod.config import PodConfig
from runtime.pod.proc import follow_parent, limit_blas_threads, pin_to_core

log = logging.getLogger(__name__)
SIGTERM_SETTLE_S = 1.0  # a SIGTERM while the launcher still lives after this is someone's stop


class Die(comm.Endpoint):
    """The calling die inside `pod.run` functions.

    Attributes:
        die_id, num_dies: identity in the pod.
        config: the PodConfig the pod was launched with.
        region: this die's Region (`region.layout` decodes every field).
        allocator: the app-area allocator (`die.alloc` / `die.free`).
        trace: this die's protocol trace (`die.trace.enabled = True` to record).
    """

    def __init__(
        self, die_id: int, config: PodConfig, regions: list, ctl=None, fabric=None
    ) -> None:
        abort = (ctl.words, C.W_ABORT, ctl.words[C.W_ABORT]) if ctl is not None else None
        super().__init__(
            die_id,
            regions,
            config.wait_policy(),
            ub_bytes=config.ub_bytes,
            trace=Trace(die_id, config.trace_capacity, config.trace),
            abort=abort,
            fabric=fabric,
        )
        self.config = config
        self.region = self.regions[die_id]
        self.ctl = ctl
        self.commands = 0  # messages received from the launcher (runs, stops)
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


def _install_sigterm(pod_id: str, die_id: int, num_dies: int, launcher_pid: int) -> None:
    """SIGTERM from a live launcher (its teardown's last resort): die, as SIGTERM says. SIGTERM
    after the launcher died (PR_SET_PDEATHSIG, or anyone's): clean up for it, then exit."""

    def on_sigterm(signum, frame) -> None:
        # PR_SET_PDEATHSIG fires when the launcher's *thread* exits: while a killed launcher's
        # other threads are still exiting, this die is reparented to one of them and getppid()
        # still names the launcher. Give the launcher a moment to be gone for good.
        deadline = time.monotonic() + SIGTERM_SETTLE_S
        while _launcher_lives(launcher_pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        if _launcher_lives(launcher_pid):
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        orphan_cleanup(pod_id, die_id, num_dies)
        os._exit(0)

    signal.signal(signal.SIGTERM, on_sigterm)


def _launcher_lives(launcher_pid: int) -> bool:
    return os.getppid() == launcher_pid and _alive(launcher_pid)


def orphan_cleanup(pod_id: str, die_id: int, num_dies: int) -> list[str]:
    """The launcher is gone without tearing down: unlink what it cannot. Returns what was
    unlinked here.

    This die's own region first; then the regions of dies that never started or are dead
    (they cannot do it themselves); then, if no region of the pod is left, the control segment:
    every die unlinks its own region before it looks, so the last one to look sees none left
    and removes the control segment (two dies removing it at once is harmless). Only ever
    called once the launcher is dead, so it never races a live launcher's teardown. A die that
    is stopped or stuck keeps its region (and so the control segment): `xpod clean` removes
    those once the die is gone.
    """
    removed = []
    if unlink_segment(region_name(pod_id, die_id)):
        removed.append(region_name(pod_id, die_id))
    try:
        ctl = C.Control.attach(pod_id)
    except ShmError:
        return removed  # the last die out already removed it
    try:
        for r in range(num_dies):
            pid = ctl.words[C.W_DIE_PID + r]
            gone = r != die_id and (pid <= 0 or not _alive(pid))
            if gone and unlink_segment(region_name(pod_id, r)):
                removed.append(region_name(pod_id, r))
    finally:
        ctl.close()
    left = [n for n in C.list_pods().get(pod_id, []) if not n.endswith((".ctl", ".run"))]
    if not left:
        run_dir = os.path.join("/dev/shm", C.run_dir_name(pod_id))
        if os.path.isdir(run_dir):
            shutil.rmtree(run_dir, ignore_errors=True)
            removed.append(run_dir)
        if unlink_segment(C.ctl_name(pod_id)):
            removed.append(C.ctl_name(pod_id))
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def pin_die(die_id: int, config: PodConfig) -> None:
    """A die's first start-up step: its own core when the pod is pinned (`PodConfig.pinned`),
    or the core `PodConfig.die_cpus` names (a PD pod: prefill dies on 0, decode dies on 1)."""
    if config.die_cpus:
        pin_to_core(config.die_cpus[die_id], config.cores)
    elif config.pinned():
        pin_to_core(die_id, config.cores)


def die_main(die_id: int, cfg: dict, pod_id: str, conn, launcher_pid: int) -> None:
    """Entry point of a die process."""
    # Ctrl-C is the launcher's to handle: it tears the pod down; a die ends with it (SIGTERM
    # when the launcher exits), cleaning up what a SIGKILLed launcher could not.
    _install_sigterm(pod_id, die_id, cfg["num_dies"], launcher_pid)
    if not follow_parent(launcher_pid):  # the launcher died before prctl took effect
        orphan_cleanup(pod_id, die_id, cfg["num_dies"])
        os._exit(3)
    logging.basicConfig(format=f"die {die_id} %(levelname)s %(name)s: %(message)s")
    keep_freed_memory()  # numpy temporaries reuse heap pages instead of faulting (memory.heap)
    limit_blas_threads(1)  # a die's matmuls must not spin up workers on its peers' cores
    try:
        config = PodConfig.from_dict(cfg)
        pin_die(die_id, config)
        ctl = C.Control.attach(pod_id)
        ctl.words[C.W_DIE_PID + die_id] = os.getpid()
        layout = config.layout()
        regions = [
            Region.attach(RegionHandle(region_name(pod_id, r), r), layout)
            for r in range(config.num_dies)
        ]
        die = Die(die_id, config, regions, ctl, _fabric(die_id, config, regions))
    except BaseException as e:  # noqa: BLE001 - reported to the launcher, then exit non-zero
        _send_error(conn, e)
        sys.exit(1)
    conn.send(("ready", die_id, os.getpid()))
    _serve(die, conn)
    die.close()
    if os.getppid() != launcher_pid:  # the pipe closed because the launcher died
        orphan_cleanup(pod_id, die_id, config.num_dies)


def _fabric(die_id: int, config: PodConfig, regions: list):
    """The die's fabric in a forked pod: every region mapped; with `fabric="mirror"` the dies
    of other (emulated) hosts become poisoned mirrors (`comm.fabric.MirrorFabric`); a capture
    pod records every event (`comm.capture.CaptureFabric`)."""
    if config.capture:
        from comm.capture import Capture, CaptureFabric

        return CaptureFabric(die_id, regions, Capture(die_id, regions[die_id].layout))
    if config.fabric_kind == "mirror":
        from comm.fabric import MirrorFabric

        return MirrorFabric(die_id, regions, config.hosts)
    return None


def _serve(die: Die, conn) -> None:
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return  # the launcher is gone
        die.commands += 1
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
