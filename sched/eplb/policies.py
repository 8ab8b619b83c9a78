"""The placement policies, pure numpy on a per-layer load estimate `weight[L, E]`: a port of
deepseek-ai/EPLB's `rebalance_experts` ("deepseek") and xDeepServe's greedy placement
("greedy", 001 §4.5). What differs from upstream, and why: the `sched.eplb` docstring."""

from __future__ import annotations

import numpy as np

from sched.eplb.checks import check_i64, check_int, check_weight


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
    weight = check_weight(weight)
    num_packs = check_int(num_packs, "num_packs", 1)
    num_rows, n = weight.shape
    if n % num_packs:
        raise ValueError(f"num_packs: {n} items cannot be split evenly into {num_packs} packs")
    per_pack = n // num_packs
    if labels is not None:
        labels = check_i64(labels, "labels", 2)
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
    weight = check_weight(weight)
    num_rows, num_log = weight.shape
    num_phy = check_int(num_phy, "num_phy", num_log)
    if max_replicas is not None:
        max_replicas = check_int(max_replicas, "max_replicas", 1)
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
    weight = check_weight(weight)
    num_layers, num_log = weight.shape
    num_phy = check_int(num_physical_experts, "num_physical_experts", 1)
    num_groups = check_int(num_groups, "num_groups", 1)
    num_nodes = check_int(num_nodes, "num_nodes", 1)
    num_gpus = check_int(num_gpus, "num_gpus", 1)
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


def log2phy_of(phy2log: np.ndarray, phyrank: np.ndarray, logcnt: np.ndarray) -> np.ndarray:
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
    weight = check_weight(weight)
    num_groups = check_int(num_groups, "num_groups", 1)
    num_nodes = check_int(num_nodes, "num_nodes", 1)
    if num_groups % num_nodes == 0:
        phy2log, phyrank, logcnt = rebalance_experts_hierarchical(
            weight, num_replicas, num_groups, num_nodes, num_gpus
        )
    else:
        phy2log, phyrank, logcnt = rebalance_experts_hierarchical(
            weight, num_replicas, 1, 1, num_gpus
        )
    return phy2log, log2phy_of(phy2log, phyrank, logcnt), logcnt


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
    weight = check_weight(weight)
    num_layers, num_log = weight.shape
    num_dies = check_int(num_dies, "num_dies", 1)
    num_phy = check_int(num_replicas, "num_replicas", 1)
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
    return phy2log, log2phy_of(phy2log, phyrank, logcnt), logcnt
