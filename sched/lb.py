"""Decode DP load balancer (xDeepServe §4.3): which DP group gets a new request.

Each in-flight request reserves ceil((prompt + max_tokens) / block_size) blocks of its group
(its worst-case KV) from dispatch until finish. "least_kv" picks the non-full group with the
lowest reserved / num_blocks, ties broken by scanning from the group after the last pick;
"round_robin" picks the next non-full group in turn. A group is full at max_num_seqs in flight.
"""

from __future__ import annotations

POLICIES = ("least_kv", "round_robin")


class LoadBalancer:
    def __init__(self, num_groups: int, max_num_seqs: int, num_blocks: int, block_size: int,
                 policy: str = "least_kv"):  # fmt: skip
        for name, v in (("num_groups", num_groups), ("max_num_seqs", max_num_seqs),
                        ("num_blocks", num_blocks), ("block_size", block_size)):  # fmt: skip
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        self.num_groups, self.max_num_seqs = num_groups, max_num_seqs
        self.num_blocks, self.block_size, self.policy = num_blocks, block_size, policy
        self._reserved = [0] * num_groups
        self._inflight = [0] * num_groups
        self._requests: dict[int, tuple[int, int]] = {}  # request -> (group, reserved blocks)
        self._last = num_groups - 1  # so the first scan starts at group 0

    def pick(self, num_prompt_tokens: int, max_tokens: int) -> int | None:
        """The group for a new request, or None if every group is full. Does not reserve:
        call on_dispatch once the request is sent."""
        order = [(self._last + 1 + i) % self.num_groups for i in range(self.num_groups)]
        open_ = [g for g in order if self._inflight[g] < self.max_num_seqs]
        if not open_:
            return None
        g = open_[0]
        if self.policy == "least_kv":  # min keeps the first in scan order on a tie
            g = min(open_, key=lambda g: self._reserved[g])
        self._last = g
        return g

    def on_dispatch(self, group: int, request_id: int, num_prompt_tokens: int,
                    max_tokens: int) -> None:  # fmt: skip
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

    def on_finish(self, request_id: int) -> None:
        group, blocks = self._requests.pop(request_id, (None, 0))
        if group is not None:
            self._reserved[group] -= blocks
            self._inflight[group] -= 1

    def usage(self) -> list[float]:
        return [r / self.num_blocks for r in self._reserved]

    def inflight(self) -> list[int]:
        return list(self._inflight)
