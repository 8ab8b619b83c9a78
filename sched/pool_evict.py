"""The KV pool index's eviction (`sched.pool`'s module docstring): DRAM victims leaf-first and
least recently used, demoted to the SSD tier or dropped, the SSD tier's own LRU. A mixin of
`PoolIndex`: it works on the index's entries, free slots, heaps and order queue."""

from __future__ import annotations

import heapq
from collections.abc import Callable

from sched.pool_types import COMPLETE, Entry, PoolIndexError


class Eviction:
    """`PoolIndex`'s slot allocation and eviction (its state is the index's)."""

    def _alloc(self, ns: str | None, hint: int | None, only: int | None = None):
        """A free DRAM slot (server, slot), evicting if needed; else "quota" or "full"."""
        up = [s for s in self.servers if s not in self._down]
        quota = self.quotas.get(ns)  # (the key None: the default namespace's)
        if quota is not None and self._ns_used.get(ns, 0) >= quota and \
                not self._evict(up, ns, by_ns=True):  # fmt: skip
            return "quota"
        if only is not None:
            if not self._free[only] and not self._evict([only], None):
                return "full"
            s = only
        elif hint is not None and hint in up and self._free[hint]:
            s = hint
        else:
            if not up or (not any(self._free[s] for s in up) and not self._evict(up, None)):
                return "full"
            s = max(up, key=lambda s: (len(self._free[s]), -s))
        return s, heapq.heappop(self._free[s])

    def _evict(self, servers: list[int], ns: str | None = None, by_ns: bool = False) -> bool:
        """Evict the least recently used DRAM victim of servers (of namespace ns if by_ns)."""
        found = [v for v in (self._victim(s, ns, by_ns) for s in servers) if v is not None]
        if not found:
            return False
        e = min(found, key=lambda v: v.tick)
        if self._dram_kids.get(e.h):
            raise PoolIndexError(f"victim {e.h:x} has a child in DRAM (leaf-first)")
        s, slot = e.server, e.dram_slot
        if e.on_ssd:
            self._clear_slot(e)
            self._orders.append(("drop", s, e.h, slot))
            self._c["drops"] += 1
        elif self.ssd_blocks[s] and (self._ssd_used[s] < self.ssd_blocks[s] or self._ssd_evict(s)):
            e.on_ssd = True  # the SSD victim (if any) is deleted before this copy
            self._ssd_used[s] += 1
            self._clear_slot(e)
            self._orders.append(("demote", s, e.h, slot))
            self._c["demotions"] += 1
        else:
            self._remove(e)
            self._c["removals"] += 1
        self._c["evictions"] += 1
        return True

    def _victim(self, s: int, ns: str | None = None, by_ns: bool = False) -> Entry | None:
        """The least recently used evictable DRAM entry of s (of namespace ns if by_ns)."""
        room: list[bool] = []  # computed once, if needed: can s's SSD tier take a demotion?

        def ok(e: Entry) -> bool:
            if e.state != COMPLETE or e.promoting or e.pins or self._dram_kids.get(e.h):
                return False
            if by_ns and e.ns != ns:
                return False
            if e.on_ssd or not self._kids.get(e.h):
                return True  # a drop, or a demotion / removal
            if not room:
                cap = self.ssd_blocks[s]
                room.append(
                    cap > 0 and (self._ssd_used[s] < cap or self._ssd_victim(s) is not None)
                )
            return room[0]

        return self._first("dram", s, ok)

    def _ssd_victim(self, s: int) -> Entry | None:
        """The least recently used SSD-only entry of s with no child at all, unpinned."""
        return self._first("ssd", s, lambda e: not e.pins and not self._kids.get(e.h))

    def _ssd_evict(self, s: int) -> bool:
        e = self._ssd_victim(s)
        if e is None:
            return False
        self._remove(e)
        self._orders.append(("delete", s, e.h))
        self._c["ssd_deletes"] += 1
        return True

    def _first(self, tier: str, s: int, ok: Callable[[Entry], bool]) -> Entry | None:
        """The least recently used entry of a tier on s passing ok; stale heap items dropped."""
        heap, seen, aside, found = self._heap[tier, s], set(), [], None
        while heap and found is None:
            tick, h = heapq.heappop(heap)
            e = self._e.get(h)
            if e is None or e.tick != tick or e.server != s or h in seen:
                continue
            if not self._in_tier(e, tier):
                continue
            seen.add(h)
            aside.append((tick, h))
            if ok(e):
                found = e
        for item in aside:
            heapq.heappush(heap, item)
        return found

    @staticmethod
    def _in_tier(e: Entry, tier: str) -> bool:
        """In the DRAM LRU (holds a slot) or the SSD LRU (on SSD only)."""
        return e.dram_slot is not None if tier == "dram" else e.dram_slot is None and e.on_ssd


__all__ = ["Eviction"]
