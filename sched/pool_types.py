"""The KV pool index's data (`sched.pool`): keys (`ns_root`, `chain`), entries, a lookup's hit,
a put's states, and the checks of its arguments and invariants."""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from sched.kv import block_hash

WRITING, COMPLETE = "writing", "complete"
Block = tuple[int, "int | None", tuple[int, ...]]  # (hash, parent, tokens)


class PoolIndexError(AssertionError):
    """A broken PoolIndex invariant (`check`) or an impossible internal state."""


@functools.lru_cache(maxsize=4096)
def ns_root(ns: str | None) -> int | None:
    """The first block's parent in namespace ns: blake2b-64(b"xpod-ns" + ns) (little endian);
    None for the default namespace, which keeps every `block_hash` computed today. (Memoized:
    the scheduler asks it for every request at every step.)"""
    if ns is None:
        return None
    if not isinstance(ns, str):
        raise TypeError(f"ns must be a str or None, got {ns!r}")
    digest = hashlib.blake2b(b"xpod-ns" + ns.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def chain(tokens: Sequence[int], block_size: int, ns: str | None = None) -> list[Block]:
    """(hash, parent, tokens) of every full block of tokens, chained from ns_root(ns)."""
    return chain_tail(tokens, block_size, 0, ns_root(ns))


@dataclass
class Entry:
    h: int
    ns: str | None
    parent: int | None
    tokens: tuple[int, ...]
    crc: int
    state: str  # WRITING | COMPLETE
    server: int
    dram_slot: int | None
    on_ssd: bool = False
    pins: int = 0  # live leases holding it
    hits: int = 0
    last_use: float = 0.0
    promoting: bool = False  # SSD -> dram_slot copy ordered, not yet `promoted`
    since: float = 0.0  # start of the put (writing) or of the promotion
    tick: int = 0  # recency: the index's touch counter at its last touch
    epoch: int = 0  # bumped when its pins are dropped (server_dead) or it leaves the index


@dataclass(frozen=True)
class HitBlock:
    h: int
    server: int
    slot: int | None  # DRAM slot to load from; None: not there yet (see promote_slot)
    crc: int
    on_ssd: bool
    promote_slot: int | None = None  # a promotion into this slot is ordered (or pending)


@dataclass(frozen=True)
class Hit:
    lease: int  # 0: nothing pinned
    blocks: list[HitBlock]
    tokens: int


@dataclass(frozen=True)
class Granted:
    server: int
    slot: int


@dataclass(frozen=True)
class AlreadyStored:
    pass


@dataclass(frozen=True)
class Writing:
    pass


@dataclass(frozen=True)
class Dropped:
    reason: str  # admission | orphan | quota | full | collision


PutState = Granted | AlreadyStored | Writing | Dropped
COUNTERS = ("lookups", "hits", "misses", "query_blocks", "hit_blocks", "evictions", "demotions",
             "drops", "removals", "ssd_deletes", "promotions", "admissions_dropped",
             "quota_dropped", "full_dropped", "orphan_dropped", "collisions", "leases_expired",
             "puts_reclaimed", "promotions_reclaimed", "bad_drops")  # fmt: skip


def chain_tail(tokens: Sequence[int], bs: int, start: int, parent: int | None) -> list[Block]:
    out: list[Block] = []
    for i in range(start, len(tokens) // bs):
        chunk = tuple(int(t) for t in tokens[i * bs : (i + 1) * bs])
        h = block_hash(parent, chunk)
        out.append((h, parent, chunk))
        parent = h
    return out


def validate_index(block_size, servers, ssd_blocks, admit, lease_s, put_timeout_s, quotas) -> None:
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
    if not servers or any(not isinstance(n, int) or n < 0 for n in servers.values()):
        raise ValueError(f"servers must map server ids to DRAM slots >= 0, got {servers!r}")
    if any(s not in servers or (n or 0) < 0 for s, n in (ssd_blocks or {}).items()):
        raise ValueError(f"ssd_blocks must map known servers to blocks >= 0, got {ssd_blocks!r}")
    if admit not in ("always", "second_hit"):
        raise ValueError(f"admit must be 'always' or 'second_hit', got {admit!r}")
    if not lease_s > 0 or not put_timeout_s > 0:
        raise ValueError(f"lease_s and put_timeout_s must be > 0, got {lease_s}, {put_timeout_s}")
    if any(not isinstance(n, int) or n < 0 for n in (quotas or {}).values()):
        raise ValueError(f"quotas must be ints >= 0, got {quotas!r}")


def expect(ok: bool, what: str) -> None:
    if not ok:
        raise PoolIndexError(f"PoolIndex invariant: {what}")


__all__ = ["COMPLETE", "COUNTERS", "WRITING", "AlreadyStored", "Block", "Dropped", "Entry",
           "Granted", "Hit", "HitBlock", "PoolIndexError", "PutState", "Writing", "chain",
           "chain_tail", "expect", "ns_root", "validate_index"]  # fmt: skip
