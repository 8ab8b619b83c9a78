"""Expert-parallel load balancer (EPLB): which die holds which replica of which expert.

Glossary (as in `comm.routing`): a *logical* expert is one of the model's `E` experts of a layer;
a *physical* expert (slot) is one of the `P = E + R` expert weights the dies hold, `R` of them
redundant replicas of heavy experts. Slots are numbered pod-wide: physical slot `p` lives on die
`p // slots_per_die` as its local slot `p % slots_per_die`; every die has `slots_per_die` slots.

Two placement policies, both pure numpy on a per-layer load estimate `weight[L, E]` (tokens per
logical expert, e.g. a moving average of the routed counts):

- `rebalance_experts` ("deepseek"): a port of deepseek-ai/EPLB `eplb.py` (the algorithm and the
  outputs of its `rebalance_experts`, without torch). Hierarchical when `num_nodes` divides
  `num_groups`: pack the expert groups onto nodes (`balanced_packing`), replicate the heaviest
  experts within each node (`replicate_experts`), pack the node's replicas onto its dies
  (`balanced_packing` again); otherwise the same with one group and one node (the global policy).
- `greedy_placement` ("greedy", xDeepServe 001 §4.5): give each of the `R` redundant slots, one at
  a time, to the expert with the highest load per replica; then place the replicas heaviest first,
  each onto the least-loaded die that has a free slot and does not already hold that expert.

Both return upstream's triple `(phy2log [L, P], log2phy [L, E, max_rep] padded with -1,
logcnt [L, E])`, all int64; `plan` picks a policy and wraps the triple in a validated `ExpertMap`,
and `replica_for` picks the replica a token uses (by token position, deterministic).

What differs from upstream (deepseek-ai/EPLB at d52c72d), and why:

1. **No two replicas of one expert on one die** (upstream issue #22, PR #28: upstream can pack two
   replicas of a hot expert onto one GPU, which doubles that GPU's share instead of splitting it).
   Two changes, both active by default (`distinct=True`):
   a. `replicate_experts(..., max_replicas=m)` never gives an expert more than `m` replicas, `m` =
      the number of dies it can be spread over (dies per node); among the experts below the cap
      it still picks the highest load per replica, first index on a tie.
   b. `balanced_packing(..., labels=...)`: an item (a replica) goes to the least-loaded pack with
      room *that does not hold its label* (its logical expert). If every pack with room holds it
      (possible near the end of the packing), a repair moves one item of a full pack that lacks
      the label into a pack with room that lacks that item's label, and puts the new item in its
      place; the move is the one that minimizes the larger of the two resulting pack loads. Such
      a move always exists when no label has more items than there are packs (see
      `balanced_packing`), which (a) guarantees.
   Both changes only act where upstream would have made a duplicate: (a) excludes an expert only
   once it has a replica per die, and (b) departs from upstream's choice only when that choice
   holds the label. So **whenever upstream's placement has no duplicate on a die, ours is
   identical to it** (a property test checks this against the `distinct=False` path, which is
   the faithful upstream algorithm). The README's worked example has no duplicate, so its golden
   `phy2log` is unchanged.
   The constraint needs `slots_per_die <= experts per node` (each die holds distinct experts of
   its node); otherwise `ValueError`.
2. **Ties**: upstream sorts with torch's `sort(descending=True)`, whose order among equal values is
   not guaranteed (stable=False). We use a stable descending sort, so equal loads keep ascending
   index order (e.g. the replicas of one expert, which have equal loads, stay in creation
   order). `argmax` and `min` pick the first index on a tie, as torch's `max` and Python's `min`.
   The golden worked example is reproduced with this rule.
3. **Precision**: loads are float64 here (upstream converts to float32); only a near-tie that
   float32 rounds to a tie can come out differently.
4. **Errors**: upstream `assert`s; we raise `ValueError` / `TypeError` naming the bad argument,
   and also refuse negative or non-finite loads.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

__all__ = [
    "POLICIES",
    "ExpertMap",
    "balanced_packing",
    "greedy_placement",
    "plan",
    "rebalance_experts",
    "rebalance_experts_hierarchical",
    "replica_for",
    "replicate_experts",
    "keep_in_place",
    "row_positions",
]

POLICIES = ("deepseek", "greedy")


# -- validation helpers ----------------------------------------------------------------------------


def _check_int(value, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name}: must be >= {minimum}, got {value}")
    return int(value)


def _check_weight(weight, name: str = "weight") -> np.ndarray:
    """`weight` as a float64 `[L, E]` copy; loads must be finite and >= 0."""
    arr = np.asarray(weight)
    if arr.dtype.kind not in "iuf":
        raise TypeError(f"{name}: expected an int or float array, got dtype {arr.dtype}")
    if arr.ndim != 2 or arr.shape[0] < 1 or arr.shape[1] < 1:
        raise ValueError(
            f"{name}: expected a non-empty 2-D array [layers, experts], got shape {arr.shape}"
        )
    arr = arr.astype(np.float64)
    bad = ~np.isfinite(arr) | (arr < 0)
    if bad.any():
        where = tuple(int(v) for v in np.argwhere(bad)[0])
        raise ValueError(f"{name}{list(where)} = {arr[where]}: loads must be finite and >= 0")
    return arr


def _check_i64(values, name: str, ndim: int) -> np.ndarray:
    arr = np.asarray(values)
    if arr.dtype.kind not in "iu" and not (arr.size == 0 and arr.dtype.kind == "f"):
        raise TypeError(f"{name}: expected an integer array, got dtype {arr.dtype}")
    if arr.ndim != ndim:
        raise ValueError(f"{name}: expected a {ndim}-D array, got shape {arr.shape}")
    return arr.astype(np.int64)


def _frozen(arr: np.ndarray) -> np.ndarray:
    arr = np.array(arr, dtype=np.int64, copy=True)
    arr.flags.writeable = False
    return arr


def _inverse(perm: np.ndarray) -> np.ndarray:
    """Row-wise inverse of a permutation `[X, n]`."""
    inv = np.empty_like(perm)
    np.put_along_axis(inv, perm, np.broadcast_to(np.arange(perm.shape[1]), perm.shape), axis=1)
    return inv


def _stable_desc(weight: np.ndarray) -> np.ndarray:
    """Row-wise indices sorting `weight [X, n]` descending; equal values keep ascending index."""
    return np.argsort(-weight, axis=-1, kind="stable")


# -- the upstream building blocks ------------------------------------------------------------------


def balanced_packing(weight, num_packs: int, labels=None) -> tuple[np.ndarray, np.ndarray]:
    """Pack the `n` items of each row into `num_packs` packs of exactly `n / num_packs` items each,
    keeping the pack weights balanced (upstream `balanced_packing`, LPT greedy).

    Items go heaviest first (stable descending sort) into the least-loaded pack that has room
    (first pack on a tie). With `labels`, a pack never holds two items of one label: an item goes
    to the least-loaded pack with room that lacks its label, and if there is none, one item `j` of
    a full pack `p` lacking the label moves to a pack `q` with room (so holding the label) that
    lacks `j`'s label, and the new item takes `j`'s place (rank) in `p`; of all such moves the one
    with the smallest `max(load(p), load(q))` after it, first on a tie. Such a move exists: a pack
    lacking the label exists while the label has fewer items placed than packs, it is full (else
    the item would fit there), and `q` has at most `size - 2` labels besides this one while `p`
    has `size` distinct ones, none this label.

    Arguments:
        weight: float `[X, n]`, the weight of each item; `n` must be a multiple of `num_packs`.
        num_packs: int >= 1.
        labels: optional int `[X, n]`; no label may occur more than `num_packs` times in a row.

    Returns:
        pack_index: int64 `[X, n]`, the pack of each item.
        rank_in_pack: int64 `[X, n]`, the item's position in its pack, in arrival order.
    """
    weight = _check_weight(weight)
    num_packs = _check_int(num_packs, "num_packs", 1)
    num_rows, n = weight.shape
    if n % num_packs:
        raise ValueError(f"num_packs: {n} items cannot be split evenly into {num_packs} packs")
    per_pack = n // num_packs
    if labels is not None:
        labels = _check_i64(labels, "labels", 2)
        if labels.shape != weight.shape:
            raise ValueError(f"labels: expected shape {weight.shape}, got {labels.shape}")
        for row in range(num_rows):
            _, counts = np.unique(labels[row], return_counts=True)
            if counts.max() > num_packs:
                raise ValueError(
                    f"labels[{row}]: a label occurs {counts.max()} times, more than num_packs = "
                    f"{num_packs}, so some pack would hold it twice"
                )
    if per_pack == 1:
        pack_index = np.broadcast_to(np.arange(n, dtype=np.int64), (num_rows, n)).copy()
        return pack_index, np.zeros((num_rows, n), dtype=np.int64)
    order = _stable_desc(weight)
    pack_index = np.full((num_rows, n), -1, dtype=np.int64)
    rank_in_pack = np.full((num_rows, n), -1, dtype=np.int64)
    for row in range(num_rows):
        w = weight[row].tolist()
        lab = None if labels is None else labels[row].tolist()
        pack_of, rank = pack_index[row], rank_in_pack[row]
        loads = [0.0] * num_packs
        members: list[list[int]] = [[] for _ in range(num_packs)]
        held: list[set[int]] = [set() for _ in range(num_packs)]
        for item in order[row].tolist():
            open_ = [p for p in range(num_packs) if len(members[p]) < per_pack]
            if lab is not None:
                free = [p for p in open_ if lab[item] not in held[p]]
                if not free:
                    _swap_in(item, w, lab, open_, loads, members, held, pack_of, rank)
                    continue
                open_ = free
            p = min(open_, key=loads.__getitem__)
            pack_of[item], rank[item] = p, len(members[p])
            members[p].append(item)
            loads[p] += w[item]
            if lab is not None:
                held[p].add(lab[item])
    return pack_index, rank_in_pack


def _swap_in(item, w, lab, open_, loads, members, held, pack_of, rank) -> None:
    """The repair of `balanced_packing`: every pack with room holds `lab[item]`."""
    best = None
    for q in open_:
        for p, mem in enumerate(members):
            if lab[item] in held[p]:
                continue  # p lacks the label, hence is full
            for j in mem:
                if lab[j] in held[q]:
                    continue
                score = max(loads[p] - w[j] + w[item], loads[q] + w[j])
                if best is None or score < best[0]:
                    best = (score, q, p, j)
    assert best is not None, "balanced_packing: a label has more items than packs"
    _, q, p, j = best
    members[p][rank[j]] = item
    pack_of[item], rank[item] = p, rank[j]
    pack_of[j], rank[j] = q, len(members[q])
    members[q].append(j)
    loads[p] += w[item] - w[j]
    loads[q] += w[j]
    held[p].discard(lab[j])
    held[p].add(lab[item])
    held[q].add(lab[j])


def replicate_experts(
    weight, num_phy: int, max_replicas: int | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Replicate the `num_log` experts of each row to `num_phy` replicas, minimizing the largest
    load per replica (upstream `replicate_experts`): physical `i < num_log` is expert `i`; each
    further physical goes to the expert with the highest `weight / logcnt`, the first on a tie,
    among those with fewer than `max_replicas` replicas (all of them if `max_replicas` is None).

    Returns:
        phy2log: int64 `[X, num_phy]`, logical expert of each physical expert.
        rank: int64 `[X, num_phy]`, the replica rank (0 for the original, then creation order).
        logcnt: int64 `[X, num_log]`, number of replicas of each logical expert.
    """
    weight = _check_weight(weight)
    num_rows, num_log = weight.shape
    num_phy = _check_int(num_phy, "num_phy", num_log)
    if max_replicas is not None:
        max_replicas = _check_int(max_replicas, "max_replicas", 1)
        if max_replicas * num_log < num_phy:
            raise ValueError(
                f"max_replicas: {num_log} experts with at most {max_replicas} "
                f"replicas each cannot fill {num_phy} slots"
            )
    phy2log = np.tile(np.arange(num_phy, dtype=np.int64), (num_rows, 1))
    rank = np.zeros((num_rows, num_phy), dtype=np.int64)
    logcnt = np.ones((num_rows, num_log), dtype=np.int64)
    rows = np.arange(num_rows)
    for i in range(num_log, num_phy):
        per_replica = weight / logcnt
        if max_replicas is not None:
            per_replica[logcnt >= max_replicas] = -np.inf
        chosen = per_replica.argmax(axis=-1)
        phy2log[:, i] = chosen
        rank[:, i] = logcnt[rows, chosen]
        logcnt[rows, chosen] += 1
    return phy2log, rank, logcnt


def _check_distinct_feasible(experts_per_node: int, slots_per_die: int) -> None:
    if slots_per_die > experts_per_node:
        raise ValueError(
            f"num_replicas: {slots_per_die} slots per die but only {experts_per_node} logical "
            f"experts per node, so some die would hold two replicas of one expert"
        )


def rebalance_experts_hierarchical(
    weight,
    num_physical_experts: int,
    num_groups: int,
    num_nodes: int,
    num_gpus: int,
    *,
    distinct: bool = True,
):
    """Upstream's hierarchical policy: groups -> nodes, replicate within nodes, replicas -> dies.

    Arguments:
        weight: `[L, E]` loads (checked); `E` divisible by `num_groups`.
        num_physical_experts: `P >= E`, a multiple of `num_gpus`.
        num_groups: expert groups (DeepSeek-V3's group-limited routing), a multiple of
            `num_nodes`.
        num_nodes: server nodes; `num_gpus` must be a multiple of it.
        num_gpus: dies.
        distinct: keep replicas of one expert on distinct dies (our fix, see the module
            docstring); False runs upstream's algorithm unchanged, duplicates included.

    Returns:
        phy2log: int64 `[L, P]`; phyrank: int64 `[L, P]` replica rank of each physical expert;
        logcnt: int64 `[L, E]`.
    """
    weight = _check_weight(weight)
    num_layers, num_log = weight.shape
    num_phy = _check_int(num_physical_experts, "num_physical_experts", 1)
    num_groups = _check_int(num_groups, "num_groups", 1)
    num_nodes = _check_int(num_nodes, "num_nodes", 1)
    num_gpus = _check_int(num_gpus, "num_gpus", 1)
    if num_log % num_groups:
        raise ValueError(f"num_groups: {num_log} experts cannot be split into {num_groups} groups")
    if num_groups % num_nodes:
        raise ValueError(f"num_nodes: {num_groups} groups cannot be split over {num_nodes} nodes")
    if num_gpus % num_nodes:
        raise ValueError(f"num_gpus: {num_gpus} dies cannot be split over {num_nodes} nodes")
    if num_phy % num_gpus:
        raise ValueError(
            f"num_replicas: {num_phy} physical experts is not a multiple of num_gpus = {num_gpus}"
        )
    if num_phy < num_log:
        raise ValueError(f"num_replicas: {num_phy} slots is fewer than the {num_log} experts")
    group_size = num_log // num_groups
    groups_per_node = num_groups // num_nodes
    per_gpu = num_phy // num_gpus
    gpus_per_node = num_gpus // num_nodes
    log_per_node = num_log // num_nodes
    if distinct:
        _check_distinct_feasible(log_per_node, per_gpu)

    # Step 1: pack groups onto nodes; mlog = node-major ("meta-logical") expert order.
    tokens_per_group = weight.reshape(num_layers, num_groups, group_size).sum(-1)
    group_pack, group_rank = balanced_packing(tokens_per_group, num_nodes)
    log2mlog = (
        ((group_pack * groups_per_node + group_rank) * group_size)[:, :, None]
        + np.arange(group_size)
    ).reshape(num_layers, num_log)
    mlog2log = _inverse(log2mlog)

    # Step 2: replicate within nodes, rows [L * num_nodes, E / num_nodes].
    tokens_per_mlog = np.take_along_axis(weight, mlog2log, -1).reshape(-1, log_per_node)
    phy2mlog, phyrank, mlogcnt = replicate_experts(
        tokens_per_mlog, num_phy // num_nodes, gpus_per_node if distinct else None
    )

    # Step 3: pack each node's replicas onto its dies.
    tokens_per_phy = np.take_along_axis(tokens_per_mlog / mlogcnt, phy2mlog, -1)
    pack_index, rank_in_pack = balanced_packing(
        tokens_per_phy, gpus_per_node, phy2mlog if distinct else None
    )
    pphy2phy = _inverse(pack_index * per_gpu + rank_in_pack)
    pphy2mlog = np.take_along_axis(phy2mlog, pphy2phy, -1)
    node_base = np.arange(0, num_log, log_per_node)[None, :, None]
    pphy2mlog = (pphy2mlog.reshape(num_layers, num_nodes, -1) + node_base).reshape(num_layers, -1)
    pphy2log = np.take_along_axis(mlog2log, pphy2mlog, -1)
    pphyrank = np.take_along_axis(phyrank, pphy2phy, -1).reshape(num_layers, -1)
    logcnt = np.take_along_axis(mlogcnt.reshape(num_layers, -1), log2mlog, -1)
    return pphy2log, pphyrank, logcnt


def _log2phy(phy2log: np.ndarray, phyrank: np.ndarray, logcnt: np.ndarray) -> np.ndarray:
    """`[L, E, max(logcnt)]`: `log2phy[l, e, r]` = the physical slot of replica rank `r`, or -1."""
    num_layers, num_log = logcnt.shape
    out = np.full((num_layers, num_log, int(logcnt.max())), -1, dtype=np.int64)
    layers = np.arange(num_layers)[:, None]
    out[layers, phy2log, phyrank] = np.arange(phy2log.shape[1])
    return out


def rebalance_experts(
    weight, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The "deepseek" policy: upstream's entry point, with our no-duplicate fix (module docstring).

    Hierarchical if `num_groups % num_nodes == 0`, else global (one group, one node), as upstream.

    Arguments:
        weight: int or float `[L, E]`, load of each logical expert of each layer, finite, >= 0.
        num_replicas: `P`, physical experts per layer, a multiple of `num_gpus`, `>= E`.
        num_groups: expert groups (`E` divisible by it on the hierarchical path).
        num_nodes: server nodes (`num_gpus` divisible by it on the hierarchical path).
        num_gpus: dies; each gets `P / num_gpus` slots.

    Returns:
        phy2log: int64 `[L, P]`, the logical expert of each physical slot.
        log2phy: int64 `[L, E, max_rep]`, the physical slots of each expert by replica rank,
            padded with -1 (`max_rep` = the largest `logcnt` over all layers).
        logcnt: int64 `[L, E]`, replicas per logical expert (>= 1).
    """
    weight = _check_weight(weight)
    num_groups = _check_int(num_groups, "num_groups", 1)
    num_nodes = _check_int(num_nodes, "num_nodes", 1)
    if num_groups % num_nodes == 0:
        phy2log, phyrank, logcnt = rebalance_experts_hierarchical(
            weight, num_replicas, num_groups, num_nodes, num_gpus
        )
    else:
        phy2log, phyrank, logcnt = rebalance_experts_hierarchical(
            weight, num_replicas, 1, 1, num_gpus
        )
    return phy2log, _log2phy(phy2log, phyrank, logcnt), logcnt


def greedy_placement(
    weight, num_replicas: int, num_dies: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The "greedy" policy (xDeepServe 001 §4.5), per layer:

    1. every expert gets one replica; each of the `num_replicas - E` redundant slots, one at a
       time, goes to the expert with the highest load per replica (first expert on a tie) among
       those with fewer than `num_dies` replicas;
    2. the replicas, each carrying `load / replicas`, are placed heaviest first (ties: expert id,
       then replica), each onto the least-loaded die (lowest id on a tie) that has a free slot and
       does not hold that expert, with the repair of `balanced_packing` when none qualifies. A
       die's local slots are filled in arrival order.

    This is the global policy of the deepseek port with the per-replica order expert-major: with
    pairwise distinct per-replica loads both give the same `phy2log`. `log2phy` lists each
    expert's slots in ascending physical id.

    Arguments:
        weight: int or float `[L, E]`, finite, >= 0.
        num_replicas: `P >= E`, a multiple of `num_dies`, with `P / num_dies <= E`.
        num_dies: int >= 1.

    Returns:
        `(phy2log [L, P], log2phy [L, E, max_rep] padded with -1, logcnt [L, E])`, int64.
    """
    weight = _check_weight(weight)
    num_layers, num_log = weight.shape
    num_dies = _check_int(num_dies, "num_dies", 1)
    num_phy = _check_int(num_replicas, "num_replicas", 1)
    if num_phy % num_dies:
        raise ValueError(
            f"num_replicas: {num_phy} slots is not a multiple of num_dies = {num_dies}"
        )
    if num_phy < num_log:
        raise ValueError(f"num_replicas: {num_phy} slots is fewer than the {num_log} experts")
    per_die = num_phy // num_dies
    _check_distinct_feasible(num_log, per_die)
    _, _, logcnt = replicate_experts(weight, num_phy, num_dies)
    # expert-major replica list: expert e's replicas are consecutive, each with load w[e] / c[e]
    item_expert = np.stack([np.repeat(np.arange(num_log), c) for c in logcnt])
    item_load = np.take_along_axis(weight / logcnt, item_expert, -1)
    pack_index, rank_in_pack = balanced_packing(item_load, num_dies, item_expert)
    phy = pack_index * per_die + rank_in_pack
    phy2log = np.empty((num_layers, num_phy), dtype=np.int64)
    np.put_along_axis(phy2log, phy, item_expert, -1)
    phyrank = np.empty_like(phy2log)  # replica r of an expert = its r-th slot by physical id
    for layer in range(num_layers):
        order = np.argsort(phy2log[layer], kind="stable")
        starts = np.concatenate(([0], np.cumsum(logcnt[layer])[:-1]))
        phyrank[layer, order] = np.arange(num_phy) - np.repeat(starts, logcnt[layer])
    return phy2log, _log2phy(phy2log, phyrank, logcnt), logcnt


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
        phy2log = _check_i64(self.phy2log, "phy2log", 2)
        log2phy = _check_i64(self.log2phy, "log2phy", 3)
        logcnt = _check_i64(self.logcnt, "logcnt", 2)
        num_dies = _check_int(self.num_dies, "num_dies", 1)
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
            object.__setattr__(self, name, _frozen(value))
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
        num_layers = _check_int(num_layers, "num_layers", 1)
        num_experts = _check_int(num_experts, "num_experts", 1)
        num_dies = _check_int(num_dies, "num_dies", 1)
        if num_experts % num_dies:
            raise ValueError(
                f"num_experts: {num_experts} experts cannot be split evenly over {num_dies} dies"
            )
        phy2log = np.tile(np.arange(num_experts, dtype=np.int64), (num_layers, 1))
        return cls(phy2log, phy2log[:, :, None], np.ones_like(phy2log), num_dies)

    @classmethod
    def from_phy2log(cls, phy2log, num_experts: int, num_dies: int) -> ExpertMap:
        """The map of a `phy2log [L, P]`; `log2phy` lists each expert's slots in ascending id."""
        phy2log = _check_i64(phy2log, "phy2log", 2)
        num_experts = _check_int(num_experts, "num_experts", 1)
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
        return cls(phy2log, _log2phy(phy2log, phyrank, logcnt), logcnt, num_dies)

    def die_of_physical(self) -> np.ndarray:
        """int64 `[P]`: the die of each physical slot."""
        return np.arange(self.num_physical, dtype=np.int64) // self.slots_per_die

    def die_load(self, load) -> np.ndarray:
        """float64 `[L, num_dies]`: each die's load when each logical expert's load `load[L, E]`
        is split evenly over its replicas."""
        load = _check_weight(load, "load")
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
    load = _check_weight(load, "load")
    num_dies = _check_int(num_dies, "num_dies", 1)
    redundant_per_die = _check_int(redundant_per_die, "redundant_per_die", 0)
    num_groups = _check_int(num_groups, "num_groups", 1)
    num_nodes = _check_int(num_nodes, "num_nodes", 1)
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
    new = _check_i64(phy2log, "phy2log", 2)
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
    layer = _check_int(layer, "layer", 0)
    if layer >= expert_map.num_layers:
        raise ValueError(f"layer: must be < {expert_map.num_layers}, got {layer}")
    ids = _check_i64(logical_ids, "logical_ids", 2)
    pos = _check_i64(positions, "positions", 1)
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
