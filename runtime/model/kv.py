"""Where a die keeps its latent KV rows: the `KVStore` protocol, `DictKV` (growing arrays in
process memory: `xpod decode` and the single-process reference) and `PagedKV` (blocks in the
die's app area placed by the master's block tables: the serving engine)."""

from __future__ import annotations

from typing import Protocol

import numpy as np

F32 = np.float32


class KVStore(Protocol):
    """Where a die keeps its latent KV rows: per (request, layer), rows in position order."""

    def append(self, req: int, layer: int, rows: np.ndarray) -> None:
        """Append float32 `[n, kv_lora_rank + qk_rope_dim]` rows after the request's rows."""

    def get(self, req: int, layer: int) -> np.ndarray:
        """Every row so far: contiguous float32 `[T, kv_lora_rank + qk_rope_dim]`."""


class DictKV:
    """A `KVStore` in process memory: one growing float32 array per (request, layer).

    Capacity doubles when full (amortized O(1) append). `get` returns a read-only view of the rows
    so far, valid until the next `append` to the same (request, layer).
    """

    def __init__(self, width: int, initial_rows: int = 16):
        self.width = int(width)
        self.initial_rows = max(1, int(initial_rows))
        self._bufs: dict[tuple[int, int], np.ndarray] = {}
        self._lens: dict[tuple[int, int], int] = {}

    def append(self, req: int, layer: int, rows: np.ndarray) -> None:
        if rows.ndim != 2 or rows.shape[1] != self.width:
            raise ValueError(f"rows: expected shape [n, {self.width}], got {rows.shape}")
        key = (int(req), int(layer))
        n = self._lens.get(key, 0)
        buf = self._bufs.get(key)
        need = n + rows.shape[0]
        if buf is None or buf.shape[0] < need:
            cap = max(need, self.initial_rows, 0 if buf is None else 2 * buf.shape[0])
            grown = np.empty((cap, self.width), dtype=F32)
            if buf is not None:
                grown[:n] = buf[:n]
            self._bufs[key] = buf = grown
        buf[n:need] = rows
        self._lens[key] = need

    def get(self, req: int, layer: int) -> np.ndarray:
        key = (int(req), int(layer))
        if key not in self._bufs:
            return np.zeros((0, self.width), dtype=F32)
        view = self._bufs[key][: self._lens[key]]
        view.flags.writeable = False
        return view

    def truncate(self, req: int, layer: int, n: int) -> None:
        """Keep the first `n` rows of (req, layer): rejected speculative rows are dropped so
        the next append lands at their position (a paged store overwrites them in place)."""
        key = (int(req), int(layer))
        if key in self._lens:
            self._lens[key] = min(self._lens[key], int(n))

    def num_rows(self, req: int, layer: int = 0) -> int:
        """Rows cached for `req` at `layer` (its next position)."""
        return self._lens.get((int(req), int(layer)), 0)

    def free(self, req: int) -> None:
        """Drop every layer of request `req`."""
        for key in [k for k in self._bufs if k[0] == int(req)]:
            del self._bufs[key], self._lens[key]


# -- paged: the serving engine ----------------------------------------------------------------
# A die's paged latent KV cache: blocks in its app area, written where the master's block
# tables say (the executor side of the RTC KV manager, `sched.kv.KVManager` being the master side).
#
# ```
#  pool  float32 [n_layers, n_blocks, block_size, kv_cache_dim]      (die.alloc: the app area)
#  request r at step s: (start, n, table)   rows of positions [start, start + n) are written into
#                       block table[p // block_size], offset p % block_size; attention reads
#                       positions [0, start + n) through the same table
# ```
# The die never allocates: every step tells it, per request, where its rows go (`begin_step`).
# A block shared by several requests (a cached prefix) is written once, by the request that
# computed it, and only read by the others: a request's rows start at its prefix-hit length,
# which is a whole number of blocks, so its writes never touch a shared block.
#
# `get` gathers a request's rows into one contiguous array, exactly the values a dict of growing
# arrays would hold (the single-process reference uses this class too, with the same tables, so
# served logits can be compared with a replay bit for bit).


class PagedKV:
    """A `KVStore` whose placement is decided outside (block tables per step).

    Arguments:
        pool: float32 [n_layers, n_blocks, block_size, kv_dim] (zeros; the die's app area).
    """

    def __init__(self, pool: np.ndarray):
        self.pool = pool
        self.block_size = pool.shape[2]
        self.width = pool.shape[3]
        self.steps: dict[int, tuple[int, int, np.ndarray, int]] = {}  # start, n, table, run

    @classmethod
    def zeros(cls, n_layers: int, n_blocks: int, block_size: int, width: int) -> PagedKV:
        return cls(np.zeros((n_layers, n_blocks, block_size, width), np.float32))

    def begin_step(self, rows: list[tuple[int, int, int, list[int]]]) -> None:
        """This step's requests: (request id, start position, tokens, block table) each."""
        self.steps = {}
        nb = self.pool.shape[1]
        for req, start, n, table in rows:
            t = np.asarray(table, np.int64)
            need = -(-(start + n) // self.block_size)
            if len(t) < need or (len(t) and (t.min() < 0 or t.max() >= nb)):
                raise ValueError(
                    f"kv: request {req} positions [0, {start + n}) need {need} blocks in"
                    f" [0, {nb}), its table has {t.tolist()}"
                )
            used = t[:need]
            # blocks in one run of ids (a request allocated at once, as decode does): `get`
            # returns a view of the pool instead of gathering a copy every layer
            run = int(used[0]) if need and used[-1] - used[0] == need - 1 and (
                need == 1 or (np.diff(used) == 1).all()) else -1  # fmt: skip
            self.steps[int(req)] = (int(start), int(n), t, run)

    def append(self, req: int, layer: int, rows: np.ndarray) -> None:
        start, n, table, _ = self.steps[int(req)]
        if rows.shape[0] != n:
            raise ValueError(f"kv: request {req} writes {rows.shape[0]} rows, the step said {n}")
        bs, at = self.block_size, start
        while at < start + n:
            blk, off = divmod(at, bs)
            take = min(bs - off, start + n - at)
            self.pool[layer, table[blk], off : off + take] = rows[at - start : at - start + take]
            at += take

    def get(self, req: int, layer: int) -> np.ndarray:
        start, n, table, run = self.steps[int(req)]
        total = start + n
        nb = -(-total // self.block_size)
        if run >= 0:  # a view of the pool (read-only: attention only reads it)
            view = self.pool[layer, run : run + nb].reshape(-1, self.width)[:total]
            view.flags.writeable = False
            return view
        return self.pool[layer, table[:nb]].reshape(-1, self.width)[:total]
