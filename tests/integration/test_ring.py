"""A token passed around a ring of dies: pods with many more dies than cores must progress."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

import comm

LAPS = 20
# Tiny regions: one lane, two small slots; 32 dies then need ~0.4 MiB of shm each.
RING_CFG = dict(lanes=1, ring_slots=2, slot_bytes=1024, app_bytes=64 * 1024, timeout_s=60.0,
                ready_timeout_s=120.0)  # fmt: skip


def pass_token(die, laps, variant):
    """Die 0 starts each lap; every die adds its id and passes the token on."""
    n, me = die.num_dies, die.die_id
    nxt, prv = (me + 1) % n, (me - 1) % n
    tok = die.alloc(2, np.int64)  # from the app area, so zero-copy can receive into it too
    seen = []
    for lap in range(laps):
        if me == 0:
            tok[:] = (lap * 1_000_000, 0)
            comm.send(die, tok, nxt, lap, variant=variant)
            comm.recv(die, tok, prv, lap, variant=variant)
        else:
            comm.recv(die, tok, prv, lap, variant=variant)
            tok[0] += me
            tok[1] += 1
            comm.send(die, tok, nxt, lap, variant=variant)
        seen.append(tok.tolist())
    die.free(tok)
    die.barrier()  # every die of the pod, then return together
    return seen


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "num_dies, variant, extra",
    [
        (8, "mte", {}),
        (8, "zero-copy", {}),
        (16, "mte", {}),
        (16, "dma", {}),
        (16, "zero-copy", {"pin": "on"}),  # 8 dies pinned to each of the 2 cores
        (32, "mte", {}),
    ],
    ids=["8-mte", "8-zero-copy", "16-mte", "16-dma", "16-zero-copy-pinned", "32-mte"],
)
def test_token_ring(pod_factory, num_dies, variant, extra):
    t0 = time.monotonic()
    pod = pod_factory(num_dies=num_dies, **{**RING_CFG, **extra})
    launched = time.monotonic()
    res = pod.run(pass_token, LAPS, variant)
    took = time.monotonic() - launched
    print(f"{num_dies} dies on {len(os.sched_getaffinity(0))} cores, {variant}: launch"
          f" {launched - t0:.2f} s, {LAPS} laps {took:.3f} s")  # fmt: skip
    total = sum(range(num_dies))
    for lap in range(LAPS):
        assert res[0][lap] == [lap * 1_000_000 + total, num_dies - 1]
    for me in range(1, num_dies):
        assert res[me][LAPS - 1] == [(LAPS - 1) * 1_000_000 + sum(range(me + 1)), me]
