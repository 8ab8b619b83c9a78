"""Expert-parallel load balancer (EPLB): which die holds which replica of which expert
(`policies`: the placement policies; `expert_map`: the placement and its uses; `checks`).

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

from sched.eplb.expert_map import (
    POLICIES,
    ExpertMap,
    keep_in_place,
    plan,
    replica_for,
    row_positions,
)
from sched.eplb.policies import (
    balanced_packing,
    greedy_placement,
    rebalance_experts,
    rebalance_experts_hierarchical,
    replicate_experts,
)

__all__ = [
    "POLICIES",
    "ExpertMap",
    "balanced_packing",
    "greedy_placement",
    "keep_in_place",
    "plan",
    "rebalance_experts",
    "rebalance_experts_hierarchical",
    "replica_for",
    "replicate_experts",
    "row_positions",
]
