"""RTC KV manager: block bookkeeping of one DP group's paged KV cache (the die holds the rows).

Glossary (DeepServe FlowServe "Relational Tensor Cache", Table 1 -> code):
MatchByPrefixToken -> match_by_prefix, AllocBlocks -> alloc_blocks, AppendBlock -> append_block,
Free -> free. A table maps a request's positions to blocks: position p lives in
table[p // block_size], slot p % block_size.

Every block is in exactly one state:
- used:   refcount > 0 (held by that many tables; > 1 only for a shared, hashed prefix block);
- cached: refcount 0, hashed, evictable; LRU order, least recently freed evicted first;
- free:   refcount 0, no hash.
A block gets a hash (`cache_blocks`) once it is full and its KV is known written: the chained
hash `block_hash(parent_hash, tokens)`, kept in `_index` (hash -> block) with the block's tokens
and parent hash, compared on every match so a hash collision cannot serve wrong KV.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict, deque
from collections.abc import Sequence


class KVFull(RuntimeError):
    """Not enough free or evictable blocks; the call changed nothing."""


def block_hash(parent: int | None, tokens: tuple[int, ...]) -> int:
    """Chained 64-bit hash of one full block: blake2b over (parent hash or none, tokens as <i8)."""
    h = hashlib.blake2b(digest_size=8)
    h.update(b"\x00" if parent is None else b"\x01" + parent.to_bytes(8, "little"))
    h.update(struct.pack(f"<{len(tokens)}q", *tokens))
    return int.from_bytes(h.digest(), "little")


class KVManager:
    """Blocks 0..num_blocks-1 of block_size positions each; tables keyed by request id."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_cache: bool = True):
        for name, v in (("num_blocks", num_blocks), ("block_size", block_size)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_cache = bool(enable_prefix_cache)
        self._ref = [0] * num_blocks
        self._hash: list[int | None] = [None] * num_blocks
        self._parent: list[int | None] = [None] * num_blocks  # parent hash of a hashed block
        self._tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self._index: dict[int, int] = {}  # hash -> the one block carrying it
        self._free: deque[int] = deque(range(num_blocks))
        self._cached: OrderedDict[int, None] = OrderedDict()  # first = least recently freed
        self._tables: dict[int, list[int]] = {}
        self._chain: dict[int, list[int]] = {}  # request -> hashes of its full blocks so far
        self._masked: set[int] = set()  # faulty blocks, out of service for good (`mask`)

    def block_table(self, request_id: int) -> list[int]:
        return list(self._table(request_id))

    def num_free(self) -> int:
        """Blocks an allocation may take: free plus cached (evictable)."""
        return len(self._free) + len(self._cached)

    def can_alloc(self, n_blocks: int) -> bool:
        return self.num_free() >= n_blocks

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks covering positions [0, num_tokens)."""
        return -(-num_tokens // self.block_size)

    def match_by_prefix(self, tokens: list[int], root: int | None = None) -> tuple[list[int], int]:
        """Longest run of cached full blocks equal to tokens' prefix, at most len(tokens)-1 tokens
        (the last token is recomputed for its logits). Returns (block ids, hit tokens); pure.
        `root`: the first block's parent (a namespace root, `sched.pool.ns_root`); None = none."""
        if not self.enable_prefix_cache:
            return [], 0
        bs, blocks, parent = self.block_size, [], root
        for i in range((len(tokens) - 1) // bs):
            chunk = tuple(tokens[i * bs : (i + 1) * bs])
            h = block_hash(parent, chunk)
            b = self._index.get(h)
            if b is None or self._tokens[b] != chunk or self._parent[b] != parent:
                break
            blocks.append(b)
            parent = h
        return blocks, len(blocks) * bs

    def alloc_blocks(
        self, request_id: int, num_tokens: int, prefix_blocks: Sequence[int] = ()
    ) -> list[int]:
        """First table of a request: prefix_blocks (from match_by_prefix, shared), then new blocks
        up to num_tokens positions. Returns the table. KVFull (nothing changed) if short."""
        if request_id in self._tables:
            raise ValueError(f"request_id {request_id} already has a block table")
        prefix = list(prefix_blocks)
        self._check_prefix(prefix, num_tokens)
        need = self.blocks_for(num_tokens) - len(prefix)
        revived = sum(1 for b in prefix if self._ref[b] == 0)  # cached blocks leave the pool
        if need > self.num_free() - revived:
            raise KVFull(f"request {request_id}: needs {need} new blocks, {self.num_free()} free")
        for b in prefix:
            if self._ref[b] == 0:
                del self._cached[b]
            self._ref[b] += 1
        table = prefix + [self._take() for _ in range(need)]
        self._tables[request_id] = table
        return list(table)

    def extend(self, request_id: int, num_tokens: int) -> list[int]:
        """Grow the table to cover num_tokens positions (never shrinks). KVFull if short."""
        table = self._table(request_id)
        need = self.blocks_for(num_tokens) - len(table)
        if need > self.num_free():
            raise KVFull(f"request {request_id}: needs {need} more blocks, {self.num_free()} free")
        table.extend(self._take() for _ in range(max(need, 0)))
        return list(table)

    def append_block(self, request_id: int) -> int:
        """One more block at the end of the table (decode crossing a boundary). KVFull if none."""
        table = self._table(request_id)
        if not self.num_free():
            raise KVFull(f"request {request_id}: no free block")
        table.append(self._take())
        return table[-1]

    def cache_blocks(
        self, request_id: int, tokens: list[int], num_tokens: int, root: int | None = None
    ) -> None:
        """Register the full blocks of the table covering tokens[:num_tokens] (KV written).
        Idempotent; a hashed block keeps its hash; a hash already indexed keeps its block.
        `root`: the first block's parent, as in `match_by_prefix` (the same for every call)."""
        if not self.enable_prefix_cache:
            return
        table, bs = self._table(request_id), self.block_size
        chain = self._chain.setdefault(request_id, [])
        for i in range(len(chain), min(min(num_tokens, len(tokens)) // bs, len(table))):
            parent = chain[-1] if chain else root
            chunk = tuple(tokens[i * bs : (i + 1) * bs])
            h = block_hash(parent, chunk)
            chain.append(h)
            b = table[i]
            if self._hash[b] is None and h not in self._index and b not in self._masked:
                self._hash[b], self._parent[b], self._tokens[b] = h, parent, chunk
                self._index[h] = b

    def chain(self, request_id) -> list[int]:
        """The hashes of a table's full blocks registered so far (`cache_blocks`), in order."""
        return list(self._chain.get(request_id, ()))

    def free(self, request_id: int) -> list[int]:
        """Drop the table; blocks reaching refcount 0 become cached (hashed; freed tail first so
        the tail is evicted first) or free. Returns those blocks. Unknown id: no-op."""
        table = self._tables.pop(request_id, None)
        self._chain.pop(request_id, None)
        released = []
        for b in reversed(table or ()):
            self._ref[b] -= 1
            if self._ref[b] == 0:
                released.append(b)
                if b in self._masked:
                    continue  # out of service for good
                if self._hash[b] is None:
                    self._free.append(b)
                else:
                    self._cached[b] = None
        return released

    def rename(self, request_id, holder) -> list[int]:
        """Move a request's table to another holder key (a PD prefill die's lease on the
        blocks of a finished request: `Scheduler.lease`); freed later with `free(holder)`."""
        if holder in self._tables:
            raise ValueError(f"holder {holder!r} already has a block table")
        table = self._tables[holder] = self._tables.pop(request_id, None) or []
        chain = self._chain.pop(request_id, None)
        if chain is not None:
            self._chain[holder] = chain
        return list(table)

    def mask(self, block: int) -> bool:
        """Take a faulty block out of service for good (a memory fault, 001 §6.3): never
        allocated or prefix-matched again; a table that holds it keeps it until freed (the
        caller recomputes those requests), then it goes nowhere. The pool shrinks by one.
        Returns False if it was masked already."""
        if (
            not isinstance(block, int)
            or isinstance(block, bool)
            or not 0 <= block < self.num_blocks
        ):
            raise ValueError(f"block {block!r} must be in [0, {self.num_blocks})")
        if block in self._masked:
            return False
        self._masked.add(block)
        if self._hash[block] is not None:
            del self._index[self._hash[block]]
            self._hash[block] = self._parent[block] = self._tokens[block] = None
        self._cached.pop(block, None)
        if block in self._free:
            self._free.remove(block)
        return True

    @property
    def masked(self) -> list[int]:
        return sorted(self._masked)

    def holders(self, block: int) -> list[int]:
        """Request ids whose table holds `block`."""
        return [rid for rid, table in self._tables.items() if block in table]

    def usage(self) -> dict:
        total = self.num_blocks - len(self._masked)
        used = total - self.num_free()
        return {"total": total, "used": used, "cached": len(self._cached),
                "free": len(self._free), "usage": used / max(total, 1),
                "masked": len(self._masked)}  # fmt: skip

    def check(self) -> None:
        """Internal invariants (tests): raises AssertionError naming the first broken one."""
        count = [0] * self.num_blocks
        for rid, table in self._tables.items():
            _expect(len(set(table)) == len(table), f"request {rid}: a block twice in its table")
            for b in table:
                count[b] += 1
                _expect(count[b] == 1 or self._hash[b] is not None, f"block {b} shared, unhashed")
        _expect(count == self._ref, "refcounts differ from the tables")
        used = {b for b in range(self.num_blocks) if self._ref[b] > 0}
        cached, free = set(self._cached), set(self._free)
        _expect(len(free) == len(self._free), "a block twice in the free list")
        _expect(not (used & cached or used & free or cached & free), "block states overlap")
        masked = self._masked - used
        _expect(not (masked & (cached | free)), "a masked block is free or cached")
        _expect(len(used | cached | free | masked) == self.num_blocks, "a block in no state")
        _expect(all(self._hash[b] is not None for b in cached), "a cached block has no hash")
        _expect(all(self._hash[b] is None for b in free), "a free block has a hash")
        hashed = {b for b in range(self.num_blocks) if self._hash[b] is not None}
        _expect(hashed == set(self._index.values()), "hashed blocks differ from the index")
        _expect(all(self._hash[b] == h for h, b in self._index.items()), "index hash mismatch")

    def _table(self, request_id: int) -> list[int]:
        table = self._tables.get(request_id)
        if table is None:
            raise ValueError(f"request_id {request_id} has no block table")
        return table

    def _check_prefix(self, prefix: list[int], num_tokens: int) -> None:
        if not isinstance(num_tokens, int) or num_tokens < 0:
            raise ValueError(f"num_tokens must be an int >= 0, got {num_tokens!r}")
        if len(prefix) * self.block_size > num_tokens:
            raise ValueError(f"prefix_blocks cover {len(prefix)} blocks, num_tokens {num_tokens}")
        if len(set(prefix)) != len(prefix):
            raise ValueError(f"prefix_blocks repeat a block: {prefix}")
        for b in prefix:
            if not 0 <= b < self.num_blocks or self._hash[b] is None:
                raise ValueError(f"prefix_blocks: block {b} is not a cached block")

    def _take(self) -> int:
        """A block for a new table entry: a free one, else evict the LRU cached block."""
        if self._free:
            b = self._free.popleft()
        else:
            b, _ = self._cached.popitem(last=False)
            del self._index[self._hash[b]]
            self._hash[b] = self._parent[b] = self._tokens[b] = None
        assert self._ref[b] == 0, f"block {b} taken with refcount {self._ref[b]}"
        self._ref[b] = 1
        return b


def _expect(ok: bool, what: str) -> None:
    if not ok:
        raise AssertionError(f"KVManager invariant: {what}")
