"""Pod-wide KV pool index (issue 33 "Keys and index", "Tiers and eviction"; KVPOOL.md §4.4).

Pure bookkeeping in the engine's shell process, like `sched.kv.KVManager`: no processes, sockets
or memory. The pool servers own the bytes; this index says which server slot or SSD file holds
which block, and queues the orders the servers run (in order, per server) to make room.

Keys are the die-local cache's chained `sched.kv.block_hash`; a namespace folds in as the first
block's parent, `ns_root(ns)` (None: today's hashes). Each entry keeps its parent and tokens,
compared on every lookup, so a hash collision cannot serve wrong KV.

An entry is "writing" (a DRAM slot granted by `put_start`, its bytes not yet there: never
returned by `lookup`) or "complete" (`put_end`). A complete entry lives in a DRAM slot, an SSD
file (`on_ssd`), or both. No entry is ever an orphan: its parent is an entry or its ns root.

Eviction (deterministic): DRAM victims are leaves (no child entry holding a DRAM slot), never
pinned by a lease, writing or promoting; least recently used first, recency being the order of
touches (a lookup touches its chain tail first, so a prefix ends more recent than its suffixes;
a grant touches the new entry). A victim already on SSD drops its slot (`drop` order); else, on
a server with an SSD tier, it is demoted (`demote` order; the SSD tier makes room by deleting
SSD-only leaves with no child at all, LRU, `delete` orders); else it leaves the index, which
needs no child at all. Orders: ("demote", s, h, slot), ("drop", s, h, slot), ("delete", s, h),
("promote", s, h, slot); a server runs them in order, so a demote copies a slot before a later
promote or put reuses it. A put or a promotion reclaimed by its timeout frees its slot: a late
write into it is caught by the crc checked at load.

Time is the injectable clock `now`; leases and timeouts expire lazily at every public call.
"""

from __future__ import annotations

import heapq
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import replace

from sched.kv import block_hash
from sched.pool_evict import Eviction
from sched.pool_types import (
    COMPLETE,
    COUNTERS,
    WRITING,
    AlreadyStored,
    Block,
    Dropped,
    Entry,
    Granted,
    Hit,
    HitBlock,
    PoolIndexError,
    PutState,
    Writing,
    chain,
    chain_tail,
    expect,
    ns_root,
    validate_index,
)


class PoolIndex(Eviction):
    """The pool's index over `servers` (server id -> DRAM slots) and their SSD tiers."""

    def __init__(
        self,
        block_size: int,
        servers: dict[int, int],
        ssd_blocks: dict[int, int] | None = None,
        admit: str = "always",
        lease_s: float = 10.0,
        put_timeout_s: float = 30.0,
        quotas: dict[str, int] | None = None,
        now: Callable[[], float] = time.monotonic,
    ):
        validate_index(block_size, servers, ssd_blocks, admit, lease_s, put_timeout_s, quotas)
        self.block_size = block_size
        self.servers = dict(sorted(servers.items()))
        self.ssd_blocks = {s: int((ssd_blocks or {}).get(s) or 0) for s in self.servers}
        self.admit, self.lease_s, self.put_timeout_s = admit, lease_s, put_timeout_s
        self.quotas = dict(quotas or {})
        self._now = now
        self._e: dict[int, Entry] = {}
        self._kids: dict[int | None, set[int]] = {}  # parent hash -> child entries' hashes
        self._dram_kids: dict[int | None, int] = {}  # parent hash -> children holding a slot
        self._free = {s: list(range(n)) for s, n in self.servers.items()}  # min-heaps
        self._ssd_used = dict.fromkeys(self.servers, 0)
        self._ns_used: dict[str | None, int] = {}
        self._heap: dict[tuple[str, int], list[tuple[int, int]]] = {
            (tier, s): [] for tier in ("dram", "ssd") for s in self.servers
        }  # (tick, h), lazily deleted: valid while the entry is there with that tick
        self._pushes = 0
        self._tick = 0
        self._leases: OrderedDict[int, tuple[float, list[tuple[Entry, int]]]] = OrderedDict()
        self._next_lease = 1
        self._writing: OrderedDict[int, Entry] = OrderedDict()
        self._promoting: OrderedDict[int, Entry] = OrderedDict()
        self._ghost: OrderedDict[int, int] = OrderedDict()  # hash -> lookups missing it (<= 2)
        self.ghost_capacity = 4 * sum(self.servers.values())
        self._orders: list[tuple] = []
        self._down: set[int] = set()
        self._c = dict.fromkeys(COUNTERS, 0)

    # ---- read path ------------------------------------------------------------------------

    def lookup(
        self,
        tokens: Sequence[int],
        ns: str | None = None,
        max_blocks: int | None = None,
        count: bool = True,
        promote: bool = True,
    ) -> Hit:
        """The longest complete chain of tokens' full blocks, at most (len - 1) // block_size
        (the last token is recomputed), pinned under a lease. SSD-only entries get a DRAM slot
        here (`promote_slot`, a `promote` order queued); the hit stops where none is free.
        `promote` False: the hit stops at the first block not loadable from DRAM now (SSD only
        or being promoted). `count` False: a second lookup of a prompt already looked up (a PD
        decode die's): no counters, recency, hit counts or admission ghosts change."""
        now = self._expire()
        bs, c = self.block_size, self._c
        n = max(0, (len(tokens) - 1) // bs)
        if max_blocks is not None:
            n = min(n, max(0, max_blocks))
        parent, found = ns_root(ns), []
        for i in range(n):
            chunk = tuple(tokens[i * bs : (i + 1) * bs])
            h = block_hash(parent, chunk)
            e = self._e.get(h)
            if e is None or e.state != COMPLETE or e.server in self._down:
                break
            if e.tokens != chunk or e.parent != parent or e.ns != ns:
                break
            if not promote and (e.dram_slot is None or e.promoting):
                break
            found.append(e)
            parent = h
        for e in found:
            e.pins += 1  # no promotion below may evict a block of this hit
        blocks = []
        for e in found:
            promote = e.dram_slot if e.promoting else None
            if e.dram_slot is None:
                got = self._alloc(e.ns, None, only=e.server)
                if isinstance(got, str):
                    break
                self._set_slot(e, *got)
                e.promoting, e.since = True, now
                self._promoting[e.h] = e
                self._orders.append(("promote", e.server, e.h, e.dram_slot))
                c["promotions"] += 1
                promote = e.dram_slot
            slot = None if promote is not None else e.dram_slot
            blocks.append(HitBlock(e.h, e.server, slot, e.crc, e.on_ssd, promote))
        for e in found[len(blocks) :]:
            e.pins -= 1
        found = found[: len(blocks)]
        if not count:
            return self._lease(found, blocks, now)
        for e in reversed(found):
            self._touch(e, now)
            e.hits += 1
        c["lookups"] += 1
        c["query_blocks"] += n
        c["hit_blocks"] += len(found)
        c["hits" if found else "misses"] += 1
        if self.admit == "second_hit" and len(found) < len(tokens) // bs:
            parent = found[-1].h if found else ns_root(ns)
            for h, _, _ in chain_tail(tokens, bs, len(found), parent):
                self._ghost[h] = min(2, self._ghost.get(h, 0) + 1)
                self._ghost.move_to_end(h)
            while len(self._ghost) > self.ghost_capacity:
                self._ghost.popitem(last=False)
        return self._lease(found, blocks, now)

    def _lease(self, found: list[Entry], blocks: list[HitBlock], now: float) -> Hit:
        if not found:
            return Hit(0, [], 0)
        lease = self._next_lease
        self._next_lease += 1
        self._leases[lease] = (now + self.lease_s, [(e, e.epoch) for e in found])
        return Hit(lease, blocks, len(found) * self.block_size)

    def release(self, lease: int) -> None:
        """Unpin a lookup's entries. Unknown or expired lease: no-op."""
        self._expire()
        self._unpin(self._leases.pop(lease, None))

    def promoted(self, h: int, slot: int, ok: bool = True) -> bool:
        """A promotion into slot finished: the slot is loadable; or failed (ok=False): the slot
        is freed, the entry stays on SSD. False (nothing done) if that promotion is not pending."""
        self._expire()
        e = self._e.get(h)
        if e is None or not e.promoting or e.dram_slot != slot:
            return False
        if ok:
            e.promoting = False
            del self._promoting[h]
        else:
            self._clear_slot(e)
        return True

    # ---- write path -----------------------------------------------------------------------

    def put_start(
        self,
        blocks: list[Block],
        ns: str | None = None,
        server: int | None = None,
        strict: bool = False,
    ) -> list[PutState]:
        """One state per block, in order: Granted(server, slot) (the entry is "writing" until
        put_end / put_abort), AlreadyStored, Writing (another put has it), or Dropped(reason).
        `server`: the preferred one (else the one with the most free slots); `strict`: that
        one only, evicting its own LRU (a pod over hosts: only the storing die's host's server
        reaches its blocks), Dropped("full") when it has nothing to evict or is down."""
        now = self._expire()
        blocks = self._validate_blocks(blocks)
        if server is not None and server not in self.servers:
            raise ValueError(f"unknown server {server!r}")
        root, out, c = ns_root(ns), [], self._c
        for h, parent, tokens in blocks:
            e = self._e.get(h)
            if e is not None:
                if (e.parent, e.tokens, e.ns) != (parent, tokens, ns):
                    out.append(Dropped("collision"))
                    c["collisions"] += 1
                else:
                    out.append(Writing() if e.state == WRITING else AlreadyStored())
                continue
            p = self._e.get(parent) if parent is not None else None
            if parent != root and (p is None or p.ns != ns):
                out.append(Dropped("orphan"))
                c["orphan_dropped"] += 1
                continue
            if self.admit == "second_hit" and self._ghost.get(h, 0) < 2:
                out.append(Dropped("admission"))
                c["admissions_dropped"] += 1
                continue
            if p is not None:
                p.pins += 1  # the parent is a leaf until this child exists: keep it
            if strict and server in self._down:
                got = "full"
            else:
                got = self._alloc(ns, None, only=server) if strict else self._alloc(ns, server)
            if p is not None:
                p.pins -= 1
            if isinstance(got, str):
                out.append(Dropped(got))
                c[f"{got}_dropped"] += 1
                continue
            self._ghost.pop(h, None)
            e = Entry(h, ns, parent, tokens, 0, WRITING, got[0], None, since=now)
            self._add(e)
            self._set_slot(e, *got)
            self._touch(e, now)
            self._writing[h] = e
            out.append(Granted(*got))
        return out

    def put_end(self, h: int, crc: int) -> bool:
        """The server stored the block: the entry is complete. False if h is not writing."""
        self._expire()
        e = self._e.get(h)
        if e is None or e.state != WRITING:
            return False
        e.state, e.crc = COMPLETE, int(crc)
        del self._writing[h]
        return True

    def put_abort(self, h: int) -> int:
        """A put failed: the writing entry leaves with its descendants. Returns entries removed."""
        self._expire()
        e = self._e.get(h)
        return self._remove_tree(e) if e is not None and e.state == WRITING else 0

    def drop(self, h: int) -> int:
        """Remove an entry with its descendants (its bytes are bad: a crc mismatch at a load,
        a failed demotion or promotion). Returns the entries removed (0: not there)."""
        self._expire()
        e = self._e.get(h)
        if e is None:
            return 0
        self._promoting.pop(h, None)
        self._writing.pop(h, None)
        self._c["bad_drops"] += 1
        return self._remove_tree(e)

    def take_orders(self) -> list[tuple]:
        """The queued server orders, in order (and forget them)."""
        self._expire()
        out, self._orders = self._orders, []
        return out

    # ---- servers --------------------------------------------------------------------------

    def is_down(self, s: int) -> bool:
        """Server s died and has not sent its inventory since (its entries are not served)."""
        return s in self._down

    def server_dead(self, s: int, ssd_survives: bool = True) -> dict:
        """Server s is gone (until `server_inventory`): its writing entries are aborted, its
        DRAM slots forgotten; entries only in its DRAM leave with their descendants; its SSD
        entries stay (pins dropped, not served while it is down) if ssd_survives, else leave."""
        self._expire()
        if s not in self.servers:
            raise ValueError(f"unknown server {s!r}")
        self._down.add(s)
        self._orders = [o for o in self._orders if o[1] != s]
        before, kept = len(self._e), 0
        for e in [e for e in self._writing.values() if e.server == s]:
            if self._e.get(e.h) is e:  # else left with an ancestor
                self._remove_tree(e)
        for e in [e for e in self._e.values() if e.server == s]:
            if self._e.get(e.h) is not e:
                continue
            if e.on_ssd and ssd_survives:
                if e.dram_slot is not None:
                    self._clear_slot(e)
                e.pins, e.epoch, kept = 0, e.epoch + 1, kept + 1
            else:
                self._remove_tree(e)
        return {"removed": before - len(self._e), "kept_on_ssd": kept}

    def server_inventory(self, s: int, entries: list[tuple]) -> dict:
        """Server s (re)started with these SSD files, (h, ns, parent, tokens, crc) each: it is up
        again. Reported entries whose parent is neither known nor their ns root are skipped
        (counted, `delete` ordered), as are invalid, duplicate and over-capacity ones; indexed
        SSD entries of s not reported are lost."""
        now = self._expire()
        if s not in self.servers:
            raise ValueError(f"unknown server {s!r}")
        self._down.discard(s)
        r = dict.fromkeys(("added", "kept", "orphans_skipped", "invalid", "duplicates",
                           "over_capacity", "lost"), 0)  # fmt: skip
        todo: dict[int, tuple] = {}
        for h, ns, parent, tokens, crc in entries:
            tokens = tuple(int(t) for t in tokens)
            if len(tokens) != self.block_size or block_hash(parent, tokens) != h:
                r["invalid"] += 1
                self._orders.append(("delete", s, h))
            else:
                todo[h] = (ns, parent, tokens, int(crc))
        for e in [e for e in self._e.values() if e.server == s and e.on_ssd]:
            if self._e.get(e.h) is not e:
                continue
            if (e.ns, e.parent, e.tokens, e.crc) == todo.get(e.h):
                r["kept"] += 1
                del todo[e.h]
                continue
            if e.promoting:
                self._clear_slot(e)  # from a file that is gone
            if e.dram_slot is None:
                r["lost"] += self._remove_tree(e)
            else:
                e.on_ssd, r["lost"] = False, r["lost"] + 1
                self._ssd_used[s] -= 1
        progress = True
        while progress:
            progress = False
            for h, (ns, parent, tokens, crc) in list(todo.items()):
                if h in self._e:
                    r["duplicates"] += 1
                elif parent != ns_root(ns) and (parent not in self._e or self._e[parent].ns != ns):
                    continue
                elif self._ssd_used[s] >= self.ssd_blocks[s]:
                    r["over_capacity"] += 1
                else:
                    e = Entry(h, ns, parent, tokens, crc, COMPLETE, s, None, on_ssd=True)
                    self._add(e)
                    self._ssd_used[s] += 1
                    self._touch(e, now)
                    r["added"] += 1
                    del todo[h]
                    progress = True
                    continue
                del todo[h]
                self._orders.append(("delete", s, h))
        r["orphans_skipped"] = len(todo)
        self._orders.extend(("delete", s, h) for h in todo)
        return r

    # ---- inspection -----------------------------------------------------------------------

    def entry(self, h: int) -> Entry | None:
        """A copy of the entry for h, or None."""
        self._expire()
        e = self._e.get(h)
        return None if e is None else replace(e)

    def __len__(self) -> int:
        self._expire()
        return len(self._e)

    def __contains__(self, h: int) -> bool:
        self._expire()
        return h in self._e

    def stats(self) -> dict:
        self._expire()
        es = self._e.values()
        roots = {e.ns: ns_root(e.ns) for e in es}
        return {
            "entries": len(self._e),
            "dram_used": {s: n - len(self._free[s]) for s, n in self.servers.items()},
            "ssd_used": dict(self._ssd_used),
            "pinned": sum(1 for e in es if e.pins),
            "writing": len(self._writing),
            "promoting": len(self._promoting),
            "leases": len(self._leases),
            "ghost": len(self._ghost),
            "orphans": sum(1 for e in es if e.parent not in self._e and e.parent != roots[e.ns]),
            "down": sorted(self._down),
            **self._c,
        }

    def check(self) -> None:
        """Every invariant; raises PoolIndexError naming the first broken one."""
        es = self._e
        pins: dict[int, int] = {}
        for _, items in self._leases.values():
            for e, ep in items:
                if es.get(e.h) is e and e.epoch == ep:
                    pins[e.h] = pins.get(e.h, 0) + 1
        kids: dict[int | None, set[int]] = {}
        dram_kids: dict[int | None, int] = {}
        used = {s: set() for s in self.servers}
        ssd = dict.fromkeys(self.servers, 0)
        ns_used: dict[str | None, int] = {}
        for h, e in es.items():
            expect(e.h == h and e.state in (WRITING, COMPLETE), f"entry {h:x}: key or state")
            expect(len(e.tokens) == self.block_size, f"entry {h:x}: {len(e.tokens)} tokens")
            expect(e.server in self.servers, f"entry {h:x}: unknown server {e.server}")
            expect(e.parent in es or e.parent == ns_root(e.ns), f"entry {h:x} is an orphan")
            expect(e.parent not in es or es[e.parent].ns == e.ns, f"entry {h:x}: parent's ns")
            expect(e.pins == pins.get(h, 0), f"entry {h:x}: pins {e.pins} != leases")
            kids.setdefault(e.parent, set()).add(h)
            if e.state == WRITING:
                expect(e.dram_slot is not None, f"writing entry {h:x} has no slot")
                expect(self._writing.get(h) is e, f"writing entry {h:x} not tracked")
                expect(not e.on_ssd and not e.pins, f"writing entry {h:x} on SSD or pinned")
            expect(e.dram_slot is not None or e.on_ssd, f"entry {h:x} in no tier")
            expect(e.promoting == (self._promoting.get(h) is e), f"entry {h:x}: promoting")
            expect(not e.promoting or (e.on_ssd and e.dram_slot is not None), f"promote {h:x}")
            if e.dram_slot is not None:
                expect(e.server not in self._down, f"entry {h:x}: a slot on a down server")
                expect(0 <= e.dram_slot < self.servers[e.server], f"entry {h:x}: slot range")
                expect(e.dram_slot not in used[e.server], f"slot {e.dram_slot} held twice")
                used[e.server].add(e.dram_slot)
                dram_kids[e.parent] = dram_kids.get(e.parent, 0) + 1
                ns_used[e.ns] = ns_used.get(e.ns, 0) + 1
            ssd[e.server] += e.on_ssd
        for s, n in self.servers.items():
            free = self._free[s]
            expect(len(set(free)) == len(free), f"server {s}: a free slot twice")
            expect(set(free) | used[s] == set(range(n)), f"server {s}: a slot lost")
            expect(not set(free) & used[s], f"server {s}: a used slot is free")
            expect(ssd[s] == self._ssd_used[s], f"server {s}: SSD count {self._ssd_used[s]}")
            expect(ssd[s] <= self.ssd_blocks[s], f"server {s}: SSD over capacity")
        expect(kids == self._kids, "child sets differ from the entries")
        expect(dram_kids == {k: v for k, v in self._dram_kids.items() if v}, "DRAM child counts")
        expect(ns_used == {k: v for k, v in self._ns_used.items() if v}, "ns DRAM counts")
        for ns, n in ns_used.items():
            expect(n <= self.quotas.get(ns, n), f"ns {ns!r}: {n} DRAM blocks over its quota")
        expect(all(w.state == WRITING and es.get(h) is w for h, w in self._writing.items()),
                "a tracked put is not a writing entry")  # fmt: skip
        expect(len(self._ghost) <= self.ghost_capacity, "ghost set over capacity")
        for (tier, s), heap in self._heap.items():
            items = set(heap)
            for e in es.values():
                if e.server == s and self._in_tier(e, tier):
                    expect((e.tick, e.h) in items, f"entry {e.h:x} not in the {tier} LRU of {s}")

    # ---- internals ------------------------------------------------------------------------

    def _expire(self) -> float:
        now = self._now()
        while self._leases:
            lease, (deadline, _) = next(iter(self._leases.items()))
            if deadline > now:
                break
            self._unpin(self._leases.pop(lease))
            self._c["leases_expired"] += 1
        while self._writing:
            e = next(iter(self._writing.values()))
            if e.since + self.put_timeout_s > now:
                break
            self._remove_tree(e)
            self._c["puts_reclaimed"] += 1
        while self._promoting:
            e = next(iter(self._promoting.values()))
            if e.since + self.put_timeout_s > now:
                break
            self._clear_slot(e)
            self._c["promotions_reclaimed"] += 1
        return now

    def _unpin(self, lease: tuple[float, list[tuple[Entry, int]]] | None) -> None:
        for e, epoch in lease[1] if lease else ():
            if self._e.get(e.h) is e and e.epoch == epoch:
                e.pins -= 1

    def _touch(self, e: Entry, now: float) -> None:
        self._tick += 1
        e.tick, e.last_use = self._tick, now
        self._push(e)

    def _push(self, e: Entry) -> None:
        if e.dram_slot is None and not e.on_ssd:
            return
        tier = "dram" if e.dram_slot is not None else "ssd"
        heapq.heappush(self._heap[tier, e.server], (e.tick, e.h))
        self._pushes += 1
        if self._pushes > 2 * len(self._e) + 256:  # drop the stale items
            self._pushes = 0
            for key in self._heap:
                self._heap[key] = []
            for x in self._e.values():
                self._push(x)

    def _add(self, e: Entry) -> None:
        self._e[e.h] = e
        self._kids.setdefault(e.parent, set()).add(e.h)

    def _set_slot(self, e: Entry, s: int, slot: int) -> None:
        e.server, e.dram_slot = s, slot
        self._ns_used[e.ns] = self._ns_used.get(e.ns, 0) + 1
        self._dram_kids[e.parent] = self._dram_kids.get(e.parent, 0) + 1
        self._push(e)

    def _clear_slot(self, e: Entry) -> None:
        heapq.heappush(self._free[e.server], e.dram_slot)
        self._ns_used[e.ns] -= 1
        self._dram_kids[e.parent] -= 1
        e.dram_slot = None
        if e.promoting:
            e.promoting = False
            self._promoting.pop(e.h, None)  # (drop forgot it first)
        self._push(e)

    def _remove_tree(self, top: Entry) -> int:
        """Remove top and its descendants (children first); `delete` SSD copies, sorted."""
        tree, i = [top], 0
        while i < len(tree):
            tree.extend(self._e[k] for k in sorted(self._kids.get(tree[i].h, ())))
            i += 1
        for e in reversed(tree):
            self._remove(e)
        dels = sorted((e.h, e.server) for e in tree if e.on_ssd and e.server not in self._down)
        self._orders.extend(("delete", s, h) for h, s in dels)
        return len(tree)

    def _remove(self, e: Entry) -> None:
        if self._kids.get(e.h):
            raise PoolIndexError(f"entry {e.h:x} removed with children")
        if e.dram_slot is not None:
            self._clear_slot(e)
        self._ssd_used[e.server] -= e.on_ssd
        del self._e[e.h]
        self._kids[e.parent].discard(e.h)
        if not self._kids[e.parent]:
            del self._kids[e.parent]
        if self._writing.get(e.h) is e:
            del self._writing[e.h]
        e.epoch += 1

    def _validate_blocks(self, blocks: list[Block]) -> list[Block]:
        out = []
        for b in blocks:
            h, parent, tokens = b
            tokens = tuple(int(t) for t in tokens)
            if len(tokens) != self.block_size:
                raise ValueError(f"block {h:x}: {len(tokens)} tokens, block_size {self.block_size}")
            if block_hash(parent, tokens) != h:
                raise ValueError(f"block {h:x}: not block_hash(parent, tokens)")
            out.append((h, parent, tokens))
        return out


__all__ = ["COMPLETE", "WRITING", "AlreadyStored", "Dropped", "Entry", "Granted", "Hit",
           "HitBlock", "PoolIndex", "PoolIndexError", "Writing", "chain", "ns_root"]  # fmt: skip
