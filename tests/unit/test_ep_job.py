"""The MPI peer's EP job (bench/ep_job.py) over an in-process all-to-all between threads: the
same dispatch output and combine output as comm.reference, for both combine dtypes and both
quantizations, and a corrupted exchange is caught by its check."""

from __future__ import annotations

import dataclasses
import threading

import numpy as np
import pytest

from bench.alltoall import Point
from bench.ep_job import EPJob


class Exchange:
    """alltoall / alltoallv between `n` threads (one per rank) through shared slots."""

    def __init__(self, n: int):
        self.n = n
        self.barrier = threading.Barrier(n)
        self.slots: list = [None] * n
        self.corrupt = False

    def _swap(self, rank: int, blocks: list) -> list:
        self.slots[rank] = blocks
        self.barrier.wait()
        got = [self.slots[src][rank] for src in range(self.n)]
        self.barrier.wait()
        return got

    def alltoall(self, rank: int):
        return lambda counts: np.array(self._swap(rank, list(counts)), np.int64)

    def alltoallv(self, rank: int):
        def run(send, send_b, recv_b):
            cuts = np.concatenate(([0], np.cumsum(send_b)))
            got = self._swap(rank, [send[cuts[p] : cuts[p + 1]].copy() for p in range(self.n)])
            out = np.concatenate(got) if got else np.zeros(0, np.uint8)
            assert len(out) == int(np.sum(recv_b))
            if self.corrupt and rank == 1 and len(out):
                out[len(out) // 2] ^= 0x40  # one flipped bit in the middle of the rows
            return out

        return run


def run_ranks(pt: Point, quant: str, corrupt: bool = False) -> list:
    ex = Exchange(pt.dies)
    ex.corrupt = corrupt
    errors: list = [None] * pt.dies

    def rank_main(r: int) -> None:
        job = EPJob(dataclasses.asdict(pt), quant, r, pt.dies)
        try:
            for _ in range(2):  # two steps, as a timed loop does
                job.dispatch(ex.alltoall(r), ex.alltoallv(r))
                job.combine(ex.alltoallv(r))
            job.check("threads")
        except Exception as e:  # noqa: BLE001 - reported per rank
            errors[r] = e

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(pt.dies)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return errors


@pytest.mark.parametrize("quant", ["int8", "none"])
@pytest.mark.parametrize("combine_dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("dies, batch", [(2, 5), (4, 16), (3, 0)])
def test_ep_job_equals_the_reference(dies, batch, quant, combine_dtype):
    pt = Point(dies=dies, batch=batch, hidden=40, topk=3, num_experts=6 * dies, seed=4,
               combine_dtype=combine_dtype)  # fmt: skip
    assert run_ranks(pt, quant) == [None] * dies


def test_ep_job_check_catches_a_corrupted_exchange():
    pt = Point(dies=3, batch=8, hidden=40, topk=3, num_experts=9, seed=1)
    errors = run_ranks(pt, "none", corrupt=True)
    assert isinstance(errors[1], RuntimeError) and "differs" in str(errors[1]), errors
