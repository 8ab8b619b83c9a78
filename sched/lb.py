"""Decode DP load balancer (xDeepServe §4.3): which DP group gets a new request.

Each in-flight request reserves ceil((prompt + max_tokens) / block_size) blocks of its group
(its worst-case KV) from dispatch until finish. "least_kv" picks the non-full group with the
lowest reserved / num_blocks, ties broken by scanning from the group after the last pick;
"round_robin" picks the next non-full group in turn. A group is full at max_num_seqs in flight.

"prefix" (KV-centric, the baseline the pod-wide KV pool's load-only routing is compared with:
KVPOOL.md §4.7, Mooncake's / Dynamo's KV-aware routing): the balancer keeps, per group, the
chained hashes (`sched.kv.block_hash`, the die-local prefix cache's keys) of the full prompt
blocks of the requests it dispatched there in the last `prefix_window_s` (Dynamo's
ApproxKvIndexer: what the group probably still caches, no event from it needed), and picks the
non-full group minimising `reserved_blocks - prefix_weight x matched_blocks`, matched_blocks
being how many of the prompt's leading blocks that group was sent; ties as least_kv. The caller
passes the prompt's hashes (`prefix_hashes`) to `pick` and `on_dispatch`.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

from sched.kv import block_hash
from sched.pool_types import ns_root

POLICIES = ("least_kv", "round_robin", "prefix")
PREFIX_WINDOW_S = 120.0  # how long a dispatched prompt's blocks count as cached in its group
PREFIX_MAX_BLOCKS = 1 << 16  # hashes kept per group at most (the oldest go first)


class LoadBalancer:
    def __init__(self, num_groups: int, max_num_seqs: int, num_blocks: int, block_size: int,
                 policy: str = "least_kv", prefix_weight: float = 1.0,
                 prefix_window_s: float = PREFIX_WINDOW_S,
                 clock: Callable[[], float] = time.monotonic):  # fmt: skip
        for name, v in (("num_groups", num_groups), ("max_num_seqs", max_num_seqs),
                        ("num_blocks", num_blocks), ("block_size", block_size)):  # fmt: skip
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        for name, w in (("prefix_weight", prefix_weight), ("prefix_window_s", prefix_window_s)):
            if isinstance(w, bool) or not isinstance(w, int | float) or w < 0:
                raise ValueError(f"{name} must be a number >= 0, got {w!r}")
        self.num_groups, self.max_num_seqs = num_groups, max_num_seqs
        self.num_blocks, self.block_size, self.policy = num_blocks, block_size, policy
        self._reserved = [0] * num_groups
        self._inflight = [0] * num_groups
        self._requests: dict[int, tuple[int, int]] = {}  # request -> (group, reserved blocks)
        self._last = num_groups - 1  # so the first scan starts at group 0
        self.prefix_weight, self.prefix_window_s, self.clock = (
            float(prefix_weight), float(prefix_window_s), clock)  # fmt: skip
        # per group: block hash -> when a prompt holding it was last dispatched there (oldest
        # first: expired from the front)
        self._seen: list[OrderedDict[int, float]] = [OrderedDict() for _ in range(num_groups)]

    def prefix_hashes(self, tokens: Sequence[int], ns: str | None = None) -> list[int]:
        """The chained hashes of the full blocks of a prompt in namespace ns (its cache salt:
        the chain starts at `ns_root(ns)`, as the die's cache does), for `pick` and
        `on_dispatch` ([] unless the policy is "prefix": nobody else needs them)."""
        if self.policy != "prefix":
            return []
        out, parent, bs = [], ns_root(ns), self.block_size
        for i in range(len(tokens) // bs):
            parent = block_hash(parent, tuple(tokens[i * bs : (i + 1) * bs]))
            out.append(parent)
        return out

    def pick(self, num_prompt_tokens: int, max_tokens: int,
             hashes: Sequence[int] = ()) -> int | None:  # fmt: skip
        """The group for a new request, or None if every group is full. Does not reserve:
        call on_dispatch once the request is sent. `hashes`: the prompt's (`prefix_hashes`)."""
        order = [(self._last + 1 + i) % self.num_groups for i in range(self.num_groups)]
        open_ = [g for g in order if self._inflight[g] < self.max_num_seqs]
        if not open_:
            return None
        g = open_[0]
        if self.policy == "least_kv":  # min keeps the first in scan order on a tie
            g = min(open_, key=lambda g: self._reserved[g])
        elif self.policy == "prefix":
            self._expire()
            w = self.prefix_weight
            g = min(open_, key=lambda g: self._reserved[g] - w * self.matched(g, hashes))
        self._last = g
        return g

    def matched(self, group: int, hashes: Sequence[int]) -> int:
        """How many leading blocks of a prompt (its `hashes`) `group` was sent lately."""
        seen, n = self._seen[group], 0
        for h in hashes:
            if h not in seen:
                break
            n += 1
        return n

    def _expire(self) -> None:
        old = self.clock() - self.prefix_window_s
        for seen in self._seen:
            while seen and next(iter(seen.values())) < old:
                seen.popitem(last=False)

    def on_dispatch(self, group: int, request_id: int, num_prompt_tokens: int,
                    max_tokens: int, hashes: Sequence[int] = ()) -> None:  # fmt: skip
        if not isinstance(group, int) or not 0 <= group < self.num_groups:
            raise ValueError(f"group must be in [0, {self.num_groups}), got {group!r}")
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id} is already dispatched")
        if num_prompt_tokens < 0 or max_tokens < 0:
            raise ValueError(f"num_prompt_tokens {num_prompt_tokens} / max_tokens {max_tokens}")
        blocks = -(-(num_prompt_tokens + max_tokens) // self.block_size)
        self._requests[request_id] = (group, blocks)
        self._reserved[group] += blocks
        self._inflight[group] += 1
        if hashes:
            seen, now = self._seen[group], self.clock()
            for h in hashes:
                seen[h] = now
                seen.move_to_end(h)
            while len(seen) > PREFIX_MAX_BLOCKS:
                seen.popitem(last=False)

    def on_finish(self, request_id: int) -> None:
        group, blocks = self._requests.pop(request_id, (None, 0))
        if group is not None:
            self._reserved[group] -= blocks
            self._inflight[group] -= 1

    def usage(self) -> list[float]:
        return [r / self.num_blocks for r in self._reserved]

    def inflight(self) -> list[int]:
        return list(self._inflight)
