"""The topology of a disaggregated pod (docs/protocols.md §8.2, 001 §5.2): which dies attend,
which host the routed experts, how the attention dies form DP domains, each domain's micro-batches,
each attention die's trampoline, and the operation numbers A2E / E2A use.

Operation numbers. The expert dies serve the domains in turns, each domain's micro-batches in
order, so per MoE layer they run D x m A2E calls while an attention die runs m: per-die counters
that advance by one per call would desync. Instead every call has a pod-wide number

    g = B + d * m + mb + 1        B: the base of the current cycle, a multiple of D * m

which the expert dies reach by counting their calls (one per (domain, micro-batch) position) and an
attention die of domain d computes from its own last number (`Split.next_op`). The numbers only
grow, so every polled word (flags, completion words) keeps the protocols' rule that a stale value
never satisfies a fresh wait, and the two halves of the areas go by g's parity as before.
"""

from __future__ import annotations

from dataclasses import dataclass

from memory.errors import ConfigError

MAX_DOMAINS = 16
MAX_MICROBATCHES = 2  # the areas have two halves; micro-batches of one die use disjoint slots


@dataclass(frozen=True)
class Split:
    """Attention dies and expert dies of one pod, the DP domains and micro-batches.

    Attributes:
        att_dies: the attention dies (DP groups), in domain order.
        exp_dies: the expert dies (the routed experts are placed over them), ascending.
        domains: the attention dies of each DP domain (a partition of `att_dies`).
        microbatches: m, each attention die's batch is split into m micro-batches per layer.
    """

    att_dies: tuple[int, ...]
    exp_dies: tuple[int, ...]
    domains: tuple[tuple[int, ...], ...]
    microbatches: int = 1

    @classmethod
    def make(cls, num_dies: int, n_att: int, domains: int = 1, microbatches: int = 1) -> Split:
        """Dies 0..n_att-1 attend (domain d: a contiguous run of them, sizes differing by at
        most one), the rest host experts; checked (`check`)."""
        if not isinstance(n_att, int) or isinstance(n_att, bool) or not 1 <= n_att < num_dies:
            raise ConfigError(
                f"attention dies {n_att!r}: need 1 <= attention dies < {num_dies} (the pod's"
                " dies; at least one expert die)"
            )
        if not isinstance(domains, int) or not 1 <= domains <= min(n_att, MAX_DOMAINS):
            raise ConfigError(
                f"domains {domains!r}: a DP domain is a set of attention dies, so 1 <= domains"
                f" <= attention dies ({n_att}) and <= {MAX_DOMAINS}"
            )
        sizes = [n_att // domains + (d < n_att % domains) for d in range(domains)]
        doms, lo = [], 0
        for s in sizes:
            doms.append(tuple(range(lo, lo + s)))
            lo += s
        split = cls(tuple(range(n_att)), tuple(range(n_att, num_dies)), tuple(doms), microbatches)
        split.check(num_dies)
        return split

    def check(self, num_dies: int) -> None:
        """ConfigError unless the dies are a partition of the pod with room for a trampoline
        per attention die (each attention die gets its own: a trampoline's inbound area has
        one writer)."""
        att, exp = list(self.att_dies), list(self.exp_dies)
        flat = [a for dom in self.domains for a in dom]
        if sorted(att + exp) != list(range(num_dies)) or sorted(flat) != sorted(att):
            raise ConfigError(
                f"split: attention dies {att} and expert dies {exp} must partition the pod's"
                f" {num_dies} dies, and the domains {list(self.domains)} the attention dies"
            )
        if not self.domains or any(not dom for dom in self.domains):
            raise ConfigError(f"split: every domain needs an attention die: {self.domains}")
        if len(self.domains) > MAX_DOMAINS:
            raise ConfigError(f"split: at most {MAX_DOMAINS} domains, got {len(self.domains)}")
        if len(att) > len(exp):
            raise ConfigError(
                f"split: {len(att)} attention dies need as many trampolines among the"
                f" {len(exp)} expert dies (each attention die forwards through its own)"
            )
        if self.microbatches not in range(1, MAX_MICROBATCHES + 1):
            raise ConfigError(
                f"microbatches {self.microbatches!r}: 1 or {MAX_MICROBATCHES} (the A2E areas"
                " have two halves)"
            )

    @property
    def num_domains(self) -> int:
        return len(self.domains)

    @property
    def cycle(self) -> int:
        """A2E calls of the expert dies per MoE layer: D x m."""
        return len(self.domains) * self.microbatches

    def domain_of(self, die: int) -> int:
        for d, dom in enumerate(self.domains):
            if die in dom:
                return d
        raise ValueError(f"die {die} is not an attention die of {self.att_dies}")

    def trampoline(self, att: int) -> int:
        """The expert die that forwards att's A2E packets and E2A rows: attention die i (in
        domain order) -> expert die i; domain d's trampolines are a rotating slice."""
        return self.exp_dies[self.att_dies.index(att) % len(self.exp_dies)]

    def partners(self, die: int) -> list[int]:
        """The attention dies this expert die is the trampoline of (at most one, `check`)."""
        return [a for a in self.att_dies if self.trampoline(a) == die]

    def position(self, domain: int, microbatch: int) -> int:
        return domain * self.microbatches + microbatch

    def next_op(self, last: int, domain: int, microbatch: int, expert: bool) -> int:
        """The operation number of a call at (domain, microbatch), given the number of this
        die's previous call `last` (or its resynced counter). An expert die calls every
        position in turn; an attention die only its domain's, so its micro-batch 0 starts the
        next cycle (its previous number lies in (B - D x m, B])."""
        pos = self.position(domain, microbatch)
        if pos == 0 or (microbatch == 0 and not expert):
            return self.round_up(last) + pos + 1
        return last + 1

    def round_up(self, op: int) -> int:
        """The base of the next cycle at or after op (every die agrees after a resync)."""
        return -(-op // self.cycle) * self.cycle


def as_split(split: Split | int, num_dies: int) -> Split:
    """A Split, or n_att (dies 0..n_att-1 attend, one domain, one micro-batch)."""
    if isinstance(split, Split):
        split.check(num_dies)
        return split
    if not isinstance(split, int) or isinstance(split, bool):
        raise TypeError(f"split must be a Split or the number of attention dies, got {split!r}")
    n_exp = num_dies - split
    if not 1 <= split <= n_exp:
        raise ValueError(f"n_att {split!r}: need 1 <= n_att <= n_exp ({n_exp} expert dies)")
    return Split.make(num_dies, split)
