"""The peers' processes: one forked child per side (or rank), each result back through a queue,
every child killed on a failure, an early exit or the deadline."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import time
import traceback
from collections.abc import Callable

JOIN_GRACE_S = 5.0


def run_group(
    transport: str, side_main: Callable, side_args: list[tuple], pin: bool, timeout_s: float
) -> list:
    """Fork one child per entry of `side_args` (side s runs `side_main(s, *side_args[s])`);
    return their results by side; kill every child on failure or timeout. `pin` pins side s to
    the s-th allowed core (callers pass it only when there are at least as many cores)."""
    ctx = mp.get_context("fork")
    results_q = ctx.Queue()
    procs = [
        ctx.Process(
            target=_child_main,
            args=(side, side_main, side_args[side], pin, results_q),
            name=f"xpod-peer-{transport}-{side}",
            daemon=True,
        )
        for side in range(len(side_args))
    ]
    try:
        for p in procs:
            p.start()
        results = _collect(transport, procs, results_q, timeout_s)
        for p in procs:
            p.join(JOIN_GRACE_S)
            if p.exitcode != 0:
                raise RuntimeError(f"{transport}: {p.name} exited with {p.exitcode}")
        return [results[side] for side in range(len(procs))]
    finally:
        for p in procs:
            if p.pid is not None and p.exitcode is None:
                p.kill()
                p.join(JOIN_GRACE_S)
        results_q.close()
        results_q.join_thread()


def _collect(transport: str, procs: list, results_q, timeout_s: float) -> dict:
    """Wait for one result from each side; raise as soon as a side fails, dies or time is up."""
    deadline = time.monotonic() + timeout_s
    results: dict[int, object] = {}
    while len(results) < len(procs):
        try:
            side, status, payload = results_q.get(timeout=0.2)
        except queue.Empty:
            dead = [p for s, p in enumerate(procs) if s not in results and p.exitcode is not None]
            if dead:
                try:  # a side that exits after its put: its result is already in the pipe
                    side, status, payload = results_q.get(timeout=1.0)
                except queue.Empty:
                    raise RuntimeError(
                        f"{transport}: {dead[0].name} exited with {dead[0].exitcode} "
                        "before sending its result"
                    ) from None
            elif time.monotonic() > deadline:
                raise RuntimeError(
                    f"{transport}: no result after {timeout_s} s; still running: "
                    f"{', '.join(p.name for p in procs if p.exitcode is None)}"
                ) from None
            else:
                continue
        if status != "ok":
            last = payload.strip().splitlines()[-1]
            raise RuntimeError(f"{transport}: side {side} failed: {last}\n{payload}")
        results[side] = payload
    return results


def _child_main(side: int, side_main: Callable, args: tuple, pin: bool, results_q) -> None:
    """Body of a forked child: pin, run one side, send ("ok", rows) or ("error", traceback)."""
    try:
        if pin:
            pin_to_core(side)
        results_q.put((side, "ok", side_main(side, *args)))
    except BaseException:
        results_q.put((side, "error", traceback.format_exc()))
        raise


def pin_to_core(side: int) -> None:
    """Pin this process to the `side`-th allowed core, when it may use two or more."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) >= 2:
        os.sched_setaffinity(0, {cpus[side]})
