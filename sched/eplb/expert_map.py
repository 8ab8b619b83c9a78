"""`ExpertMap`, the validated placement of every MoE layer, and what the pod asks of it: `plan`
(a policy's placement as an ExpertMap), `keep_in_place` (dies keep what they hold) and
`replica_for` (which replica a token uses, by token position)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from sched.eplb.checks import check_i64, check_int, check_weight, frozen_i64
from sched.eplb.policies import (
    greedy_placement,
    log2phy_of,
    rebalance_experts,
)

POLICIES = ("deepseek", "greedy")


# -- the placement object --------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class ExpertMap:
    """A replicated expert placement of every MoE layer.

    Fields (int arrays int64 and read-only):
        phy2log: `[L, P]`, the logical expert in each physical slot; slot `p` is local slot
            `p % slots_per_die` of die `p // slots_per_die`.
        log2phy: `[L, E, max_rep]`, the slots of each logical expert, `logcnt[l, e]` of them
            first, then -1 padding (`max_rep >= logcnt.max()`).
        logcnt: `[L, E]`, replicas per logical expert, every one >= 1.
        num_dies: int, dies holding experts; `P` must be a multiple of it.
        slots_per_die: int, derived: `P // num_dies`.

    The constructor checks that the three arrays agree and that no die holds two replicas of
    one expert (ValueError naming the field otherwise). Build one with `plan`,
    `ExpertMap.identity` or `ExpertMap.from_phy2log`.
    """

    phy2log: np.ndarray
    log2phy: np.ndarray
    logcnt: np.ndarray
    num_dies: int
    slots_per_die: int = field(init=False)

    def __post_init__(self) -> None:
        phy2log = check_i64(self.phy2log, "phy2log", 2)
        log2phy = check_i64(self.log2phy, "log2phy", 3)
        logcnt = check_i64(self.logcnt, "logcnt", 2)
        num_dies = check_int(self.num_dies, "num_dies", 1)
        num_layers, num_phy = phy2log.shape
        if num_layers < 1 or num_phy < 1:
            raise ValueError(f"phy2log: expected a non-empty [layers, P], got {phy2log.shape}")
        if logcnt.shape[0] != num_layers or logcnt.shape[1] < 1:
            raise ValueError(f"logcnt: expected shape ({num_layers}, E >= 1), got {logcnt.shape}")
        num_log = logcnt.shape[1]
        if num_phy % num_dies:
            raise ValueError(
                f"num_dies: {num_phy} physical slots cannot be split evenly over {num_dies} dies"
            )
        if phy2log.min() < 0 or phy2log.max() >= num_log:
            raise ValueError(
                f"phy2log: logical ids must be in [0, {num_log}), got "
                f"[{phy2log.min()}, {phy2log.max()}]"
            )
        counts = np.stack([np.bincount(row, minlength=num_log) for row in phy2log])
        if not np.array_equal(counts, logcnt):
            layer = int(np.flatnonzero((counts != logcnt).any(axis=1))[0])
            raise ValueError(
                f"logcnt[{layer}] = {logcnt[layer].tolist()} but phy2log[{layer}] "
                f"has {counts[layer].tolist()}"
            )
        if logcnt.min() < 1:
            layer, expert = (int(v) for v in np.argwhere(logcnt < 1)[0])
            raise ValueError(f"logcnt[{layer}, {expert}] = 0: every logical expert needs a replica")
        max_rep = int(logcnt.max())
        if log2phy.shape[:2] != (num_layers, num_log) or log2phy.shape[2] < max_rep:
            raise ValueError(
                f"log2phy: expected shape ({num_layers}, {num_log}, >= {max_rep}), "
                f"got {log2phy.shape}"
            )
        used = np.arange(log2phy.shape[2]) < logcnt[:, :, None]
        if (log2phy[~used] != -1).any():
            raise ValueError("log2phy: entries past logcnt must be -1")
        for layer in range(num_layers):
            slots = log2phy[layer][used[layer]]
            if not np.array_equal(np.sort(slots), np.arange(num_phy)):
                raise ValueError(f"log2phy[{layer}]: must list every physical slot exactly once")
            experts = np.nonzero(used[layer])[0]
            if not np.array_equal(phy2log[layer, slots], experts):
                raise ValueError(f"log2phy[{layer}]: disagrees with phy2log[{layer}]")
        per_die = num_phy // num_dies
        key = np.sort(phy2log * num_dies + np.arange(num_phy) // per_die, axis=1)
        dup = key[:, 1:] == key[:, :-1]
        if dup.any():
            layer, i = (int(v) for v in np.argwhere(dup)[0])
            expert, die = divmod(int(key[layer, i]), num_dies)
            raise ValueError(f"phy2log[{layer}]: die {die} holds two replicas of expert {expert}")
        values = dict(phy2log=phy2log, log2phy=log2phy, logcnt=logcnt)
        for name, value in values.items():
            object.__setattr__(self, name, frozen_i64(value))
        object.__setattr__(self, "num_dies", num_dies)
        object.__setattr__(self, "slots_per_die", per_die)

    @property
    def num_layers(self) -> int:
        return int(self.phy2log.shape[0])

    @property
    def num_experts(self) -> int:
        return int(self.logcnt.shape[1])

    @property
    def num_physical(self) -> int:
        return int(self.phy2log.shape[1])

    @classmethod
    def identity(cls, num_layers: int, num_experts: int, num_dies: int) -> ExpertMap:
        """No redundancy: expert `e` in slot `e`, i.e. on die `e // (num_experts / num_dies)`."""
        num_layers = check_int(num_layers, "num_layers", 1)
        num_experts = check_int(num_experts, "num_experts", 1)
        num_dies = check_int(num_dies, "num_dies", 1)
        if num_experts % num_dies:
            raise ValueError(
                f"num_experts: {num_experts} experts cannot be split evenly over {num_dies} dies"
            )
        phy2log = np.tile(np.arange(num_experts, dtype=np.int64), (num_layers, 1))
        return cls(phy2log, phy2log[:, :, None], np.ones_like(phy2log), num_dies)

    @classmethod
    def from_phy2log(cls, phy2log, num_experts: int, num_dies: int) -> ExpertMap:
        """The map of a `phy2log [L, P]`; `log2phy` lists each expert's slots in ascending id."""
        phy2log = check_i64(phy2log, "phy2log", 2)
        num_experts = check_int(num_experts, "num_experts", 1)
        if phy2log.size and (phy2log.min() < 0 or phy2log.max() >= num_experts):
            raise ValueError(f"phy2log: logical ids must be in [0, {num_experts})")
        logcnt = np.stack([np.bincount(row, minlength=num_experts) for row in phy2log])
        phyrank = np.empty_like(phy2log)
        for layer, row in enumerate(phy2log):
            order = np.argsort(row, kind="stable")
            starts = np.concatenate(([0], np.cumsum(logcnt[layer])[:-1]))
            phyrank[layer, order] = np.arange(row.size) - np.repeat(starts, logcnt[layer])
        if logcnt.min() < 1:
            layer, expert = (int(v) for v in np.argwhere(logcnt < 1)[0])
            raise ValueError(f"phy2log[{layer}]: expert {expert} has no replica")
        return cls(phy2log, log2phy_of(phy2log, phyrank, logcnt), logcnt, num_dies)

    def die_of_physical(self) -> np.ndarray:
        """int64 `[P]`: the die of each physical slot."""
        return np.arange(self.num_physical, dtype=np.int64) // self.slots_per_die

    def die_load(self, load) -> np.ndarray:
        """float64 `[L, num_dies]`: each die's load when each logical expert's load `load[L, E]`
        is split evenly over its replicas."""
        load = check_weight(load, "load")
        if load.shape != self.logcnt.shape:
            raise ValueError(f"load: expected shape {self.logcnt.shape}, got {load.shape}")
        per_slot = np.take_along_axis(load / self.logcnt, self.phy2log, -1)
        return per_slot.reshape(self.num_layers, self.num_dies, self.slots_per_die).sum(-1)

    def max_per_die(self, load) -> np.ndarray:
        """float64 `[L]`: the largest die load of each layer (see `die_load`)."""
        return self.die_load(load).max(axis=1)

    def balancedness(self, load) -> np.ndarray:
        """float64 `[L]`: mean / max of the die loads of each layer (vLLM's balancedness: mean
        tokens per rank / max tokens per rank), in (0, 1], 1 = perfect; 1 for an all-zero layer."""
        dl = self.die_load(load)
        top = dl.max(axis=1)
        return np.divide(dl.mean(axis=1), top, out=np.ones_like(top), where=top > 0)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ExpertMap):
            return NotImplemented
        return (
            self.num_dies == other.num_dies
            and np.array_equal(self.phy2log, other.phy2log)
            and np.array_equal(self.log2phy, other.log2phy)
            and np.array_equal(self.logcnt, other.logcnt)
        )

    def __hash__(self) -> int:
        return hash((self.num_dies, self.phy2log.tobytes(), self.log2phy.tobytes()))


# -- entry points ----------------------------------------------------------------------------------


def plan(
    load,
    num_dies: int,
    redundant_per_die: int,
    policy: str = "deepseek",
    num_groups: int = 1,
    num_nodes: int = 1,
) -> ExpertMap:
    """Place `E + num_dies * redundant_per_die` replicas of the `E` experts of each layer.

    Arguments:
        load: int or float `[L, E]`, per-expert load estimate, finite, >= 0; `E` a multiple of
            `num_dies` (so every die gets `E / num_dies + redundant_per_die` slots).
        num_dies: dies holding experts, >= 1.
        redundant_per_die: redundant slots per die, >= 0.
        policy: "deepseek" (`rebalance_experts`) or "greedy" (`greedy_placement`).
        num_groups, num_nodes: "deepseek" only (must stay 1 for "greedy"): expert groups (`E`
            divisible by it) and nodes (`num_dies` divisible by it); hierarchical placement if
            `num_nodes` divides `num_groups`, else global, as upstream.

    Returns:
        An `ExpertMap` with `P = E + num_dies * redundant_per_die` and no die holding two
        replicas of an expert. ValueError if that is impossible (more slots per die than
        experts per node).
    """
    if policy not in POLICIES:
        raise ValueError(f"policy: must be one of {POLICIES}, got {policy!r}")
    load = check_weight(load, "load")
    num_dies = check_int(num_dies, "num_dies", 1)
    redundant_per_die = check_int(redundant_per_die, "redundant_per_die", 0)
    num_groups = check_int(num_groups, "num_groups", 1)
    num_nodes = check_int(num_nodes, "num_nodes", 1)
    num_experts = load.shape[1]
    if num_experts % num_dies:
        raise ValueError(
            f"load: {num_experts} experts cannot be split evenly over num_dies = {num_dies}"
        )
    num_replicas = num_experts + num_dies * redundant_per_die
    if policy == "greedy":
        if num_groups != 1 or num_nodes != 1:
            raise ValueError(
                f"num_groups / num_nodes: only apply to policy 'deepseek', got "
                f"{num_groups} / {num_nodes} with policy 'greedy'"
            )
    else:
        if num_experts % num_groups:
            raise ValueError(
                f"num_groups: {num_experts} experts cannot be split into {num_groups} groups"
            )
        if num_dies % num_nodes:
            raise ValueError(f"num_nodes: {num_dies} dies cannot be split over {num_nodes} nodes")
    nodes_used = num_nodes if num_groups % num_nodes == 0 else 1  # rebalance_experts' choice
    slots_per_die = num_replicas // num_dies
    if slots_per_die > num_experts // nodes_used:
        raise ValueError(
            f"redundant_per_die: {slots_per_die} slots per die but only "
            f"{num_experts // nodes_used} logical experts per node, so some die would hold "
            f"two replicas of one expert"
        )
    if policy == "greedy":
        triple = greedy_placement(load, num_replicas, num_dies)
    else:
        triple = rebalance_experts(load, num_replicas, num_groups, num_nodes, num_dies)
    return ExpertMap(*triple, num_dies)


def keep_in_place(old: ExpertMap, phy2log, dies_per_node: int = 0) -> np.ndarray:
    """`phy2log [L, P]` with, per layer, its dies' slot blocks reordered so that each die keeps
    as many of the experts it holds in `old` as a greedy matching can find (the die loads are
    the same, only which die gets which block changes), and, within a die, each kept expert in
    its old slot. What a rebalance then moves is only what has to move.

    Greedy matching: repeatedly give the (new block, old die) pair with the most experts in
    common to each other, the lowest ids first on a tie; if that keeps fewer than the blocks'
    given order, the given order. With `dies_per_node` > 0 a block only moves between dies of
    one node (consecutive groups of that many dies), so a node keeps the experts it was given."""
    new = check_i64(phy2log, "phy2log", 2)
    if new.shape != old.phy2log.shape:
        raise ValueError(f"phy2log: expected shape {old.phy2log.shape}, got {new.shape}")
    d, s = old.num_dies, old.slots_per_die
    out = np.empty_like(new)
    for layer in range(new.shape[0]):
        before = old.phy2log[layer].reshape(d, s)
        after = new[layer].reshape(d, s)
        common = np.array([[np.intersect1d(a, b).size for b in before] for a in after])
        if dies_per_node:
            node = np.arange(d) // dies_per_node
            common = np.where(node[:, None] == node[None, :], common, -1)
        block_of = np.full(d, -1)  # old die -> new block
        free_new, free_old = set(range(d)), set(range(d))
        for flat in np.argsort(-common, axis=None, kind="stable"):
            a, b = divmod(int(flat), d)
            if a in free_new and b in free_old:
                block_of[b] = a
                free_new.discard(a)
                free_old.discard(b)
        if common[block_of, np.arange(d)].sum() < np.trace(common):
            block_of = np.arange(d)  # greedy is not optimal: never keep less than as given
        for b in range(d):
            block = after[block_of[b]].tolist()
            slots = [-1] * s
            rest = []
            for e in block:
                hit = np.flatnonzero(before[b] == e)
                if hit.size and slots[int(hit[0])] == -1:
                    slots[int(hit[0])] = e
                else:
                    rest.append(e)
            for i in range(s):
                if slots[i] == -1:
                    slots[i] = rest.pop(0)
            out[layer, b * s : (b + 1) * s] = slots
    return out


def row_positions(num_rows: int, die: int, step: int = 0) -> np.ndarray:
    """The positions `replica_for` uses for a die's batch: row `i` of die `d` in step `s` is
    position `i + d + s`.

    A decode step has a token or two per die, all at similar sequence positions, so the
    sequence position would send every token of a step to the same replica; the row index,
    offset by the die (so that the dies' first rows differ) and by the step (so that a request
    that keeps picking one expert does not keep hitting one replica), spreads a hot expert's
    rows over its replicas within a step and over steps. Deterministic: the reference replays it
    from the batches and the step number alone."""
    return np.arange(int(num_rows), dtype=np.int64) + (int(die) + int(step))


def replica_for(expert_map: ExpertMap, layer: int, logical_ids, positions) -> np.ndarray:
    """The physical slot each routed token uses: replica `position % logcnt` of its expert.

    Arguments:
        expert_map: the `ExpertMap`.
        layer: int in `[0, num_layers)`.
        logical_ids: int `[batch, k]`, logical expert per (token, k), -1 = not routed.
        positions: int `[batch]`, each token's position (>= 0), which picks the replica, so the
            tokens of consecutive positions cycle over an expert's replicas deterministically.

    Returns:
        int64 `[batch, k]`: physical slot ids (`log2phy[layer, e, position % logcnt[layer, e]]`),
        -1 where `logical_ids` is -1.
    """
    if not isinstance(expert_map, ExpertMap):
        raise TypeError(f"expert_map: expected an ExpertMap, got {type(expert_map).__name__}")
    layer = check_int(layer, "layer", 0)
    if layer >= expert_map.num_layers:
        raise ValueError(f"layer: must be < {expert_map.num_layers}, got {layer}")
    ids = check_i64(logical_ids, "logical_ids", 2)
    pos = check_i64(positions, "positions", 1)
    if pos.shape != ids.shape[:1]:
        raise ValueError(f"positions: expected shape ({ids.shape[0]},), got {pos.shape}")
    num_log = expert_map.num_experts
    bad = (ids < -1) | (ids >= num_log)
    if bad.any():
        slot, k = (int(v) for v in np.argwhere(bad)[0])
        raise ValueError(
            f"logical_ids[{slot}, {k}] = {ids[slot, k]}: must be -1 or in [0, {num_log})"
        )
    if (pos < 0).any():
        raise ValueError(f"positions: must be >= 0, got {int(pos.min())}")
    routed = ids >= 0
    e = np.where(routed, ids, 0)
    rep = pos[:, None] % expert_map.logcnt[layer, e]
    return np.where(routed, expert_map.log2phy[layer, e, rep], -1).astype(np.int64)
