"""Expert placement and the dispatch layout of every all-to-all protocol (docs/protocols.md §5).

Glossary (paper -> code): expert id -> `expert` (logical, 0..num_experts-1), rank/NPU holding
experts -> `die` (pod-wide die id), expert slot on that die -> `local_expert`, key offset -> `k`.

A `Placement` says where each logical expert lives: `(die_of[e], local_of[e])`.
`get_dispatch_layout` (DeepEP's name) turns one source die's `topk_idx[batch, k]` into the list
of messages it sends: one message per routed `(batch_slot, k)` pair, so a token whose k experts
include two on the same die is sent twice (the buffer formula of 000 §4.2.1 ③ assumes this).

Canonical send order of the messages of one source (every protocol and test relies on it):

    sorted by (position of the destination die in placement.dies, local expert index,
               batch slot, k index), all ascending

so the messages for destination `placement.dies[p]` are the contiguous range
`dest_offsets[p]:dest_offsets[p + 1]`, already grouped by local expert.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

__all__ = [
    "DedupLayout",
    "DispatchLayout",
    "Placement",
    "check_topk_idx",
    "get_dedup_layout",
    "get_dispatch_layout",
]


def _frozen_i64(values, name: str) -> np.ndarray:
    """A read-only int64 copy of an integer array-like; TypeError naming `name` otherwise."""
    arr = np.array(values, copy=True)
    if arr.size and arr.dtype.kind not in "iu":
        raise TypeError(f"{name}: expected an integer array, got dtype {arr.dtype}")
    arr = arr.astype(np.int64)
    arr.flags.writeable = False
    return arr


def _check_int(value, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name}: must be >= {minimum}, got {value}")
    return int(value)


def _check_dies(dies) -> tuple[int, ...]:
    if isinstance(dies, int | np.integer) or not isinstance(dies, Sequence | np.ndarray):
        raise TypeError(f"dies: expected a sequence of die ids, got {type(dies).__name__}")
    out = tuple(_check_int(d, f"dies[{i}]", 0) for i, d in enumerate(dies))
    if not out:
        raise ValueError("dies: at least one die must host experts, got an empty sequence")
    if len(set(out)) != len(out):
        raise ValueError(f"dies: die ids must be distinct, got {out}")
    return out


@dataclass(frozen=True, eq=False)
class Placement:
    """Where each logical expert lives: expert `e` is local expert `local_of[e]` of die `die_of[e]`.

    Fields:
        num_experts: int, number of logical experts (>= 1).
        dies: tuple[int, ...], the die ids that host experts, in the order that defines a die's
            *position* (`num_tokens_per_die[p]` counts messages for `dies[p]`). E.g. `(0, 1, 2, 3)`,
            or `(2, 3, 4, 5)` for the expert dies of a disaggregated pod.
        die_of: int64 `[num_experts]`, read-only, die id of each expert (a member of `dies`).
        local_of: int64 `[num_experts]`, read-only, the expert's index on its die; on every die the
            local indices of its experts are exactly `0..num_local(die)-1`.
        pos_of: int64 `[num_experts]`, read-only, derived: position of `die_of[e]` in `dies`.

    Build it with `Placement.default` or `Placement.from_table`; the constructor validates.
    Two placements are equal when all fields are equal.
    """

    num_experts: int
    dies: tuple[int, ...]
    die_of: np.ndarray
    local_of: np.ndarray
    pos_of: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        num_experts = _check_int(self.num_experts, "num_experts", 1)
        dies = _check_dies(self.dies)
        die_of = _frozen_i64(self.die_of, "die_of")
        local_of = _frozen_i64(self.local_of, "local_of")
        for name, arr in (("die_of", die_of), ("local_of", local_of)):
            if arr.shape != (num_experts,):
                raise ValueError(f"{name}: expected shape ({num_experts},), got {arr.shape}")
        pos = {d: p for p, d in enumerate(dies)}
        bad = [int(d) for d in die_of if int(d) not in pos]
        if bad:
            raise ValueError(f"die_of: die {bad[0]} is not one of dies {dies}")
        pos_of = _frozen_i64([pos[int(d)] for d in die_of], "pos_of")
        for d in dies:
            got = np.sort(local_of[die_of == d])
            if not np.array_equal(got, np.arange(got.size)):
                raise ValueError(
                    f"local_of: the experts of die {d} must have local indices 0..{got.size - 1}, "
                    f"got {got.tolist()}"
                )
        # frozen: store the normalized, read-only values through object.__setattr__
        normalized = dict(num_experts=num_experts, dies=dies, die_of=die_of, local_of=local_of)
        for name, value in (*normalized.items(), ("pos_of", pos_of)):
            object.__setattr__(self, name, value)

    @classmethod
    def default(cls, num_experts: int, dies: Sequence[int]) -> Placement:
        """Block placement: expert `e` is local expert `e % per_die` of die `dies[e // per_die]`.

        Arguments:
            num_experts: int, number of logical experts; must be divisible by `len(dies)`.
            dies: sequence of distinct die ids hosting experts.

        Returns:
            placement: a `Placement` with `per_die = num_experts // len(dies)` experts per die.
        """
        num_experts = _check_int(num_experts, "num_experts", 1)
        dies = _check_dies(dies)
        if num_experts % len(dies):
            raise ValueError(
                f"num_experts: {num_experts} experts cannot be split evenly over "
                f"{len(dies)} dies {dies}"
            )
        per_die = num_experts // len(dies)
        experts = np.arange(num_experts, dtype=np.int64)
        die_of = np.asarray(dies, dtype=np.int64)[experts // per_die]
        return cls(num_experts, dies, die_of, experts % per_die)

    @classmethod
    def from_table(cls, table, dies: Sequence[int]) -> Placement:
        """Placement from an explicit expert -> die table (the hook for load balancing).

        Arguments:
            table: int array-like `[num_experts]`, `table[e]` = die id hosting expert `e`; every
                entry must be one of `dies`. A die of `dies` may host no expert.
            dies: sequence of distinct die ids hosting experts (defines die positions).

        Returns:
            placement: a `Placement` where the local index of `e` is its rank among the experts of
                its die in ascending expert id.
        """
        dies = _check_dies(dies)
        die_of = _frozen_i64(table, "table")
        if die_of.ndim != 1 or die_of.size == 0:
            raise ValueError(f"table: expected a non-empty 1-D array, got shape {die_of.shape}")
        local_of = np.zeros(die_of.size, dtype=np.int64)
        for d in dies:
            mine = np.nonzero(die_of == d)[0]
            local_of[mine] = np.arange(mine.size)
        return cls(int(die_of.size), dies, die_of, local_of)

    def die_pos(self, die: int) -> int:
        """Position of die id `die` in `dies`; ValueError if the die hosts no experts here."""
        try:
            return self.dies.index(int(die))
        except ValueError:
            raise ValueError(f"die: {die} is not one of the expert dies {self.dies}") from None

    def experts_on(self, die: int) -> np.ndarray:
        """int64 `[num_local(die)]`: logical expert ids hosted by `die`, in local-index order."""
        self.die_pos(die)
        mine = np.nonzero(self.die_of == die)[0]
        out = mine[np.argsort(self.local_of[mine], kind="stable")].astype(np.int64)
        out.flags.writeable = False
        return out

    def num_local(self, die: int) -> int:
        """Number of experts hosted by `die`."""
        self.die_pos(die)
        return int(np.count_nonzero(self.die_of == die))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Placement):
            return NotImplemented
        return (
            self.num_experts == other.num_experts
            and self.dies == other.dies
            and np.array_equal(self.die_of, other.die_of)
            and np.array_equal(self.local_of, other.local_of)
        )

    def __hash__(self) -> int:
        return hash((self.num_experts, self.dies, self.die_of.tobytes(), self.local_of.tobytes()))


@dataclass(frozen=True, eq=False)
class DispatchLayout:
    """The messages one source die sends in a dispatch, in the canonical send order.

    Every array is int64 and read-only; `n_msgs` = number of `(batch_slot, k)` with `topk_idx >= 0`.

    Fields:
        num_tokens_per_die: `[len(placement.dies)]`, messages per destination, indexed by the
            destination's position in `placement.dies` (a token is counted once per routed k).
        num_tokens_per_expert: `[num_experts]`, messages per logical expert.
        msg_slot: `[n_msgs]`, batch slot (row of `x`) of each message.
        msg_k: `[n_msgs]`, k index (column of `topk_idx`) of each message.
        msg_dest: `[n_msgs]`, destination die id.
        msg_local_expert: `[n_msgs]`, local expert index on the destination die.
        dest_offsets: `[len(placement.dies) + 1]`, prefix sums of `num_tokens_per_die`; the
            messages for `placement.dies[p]` are `dest_offsets[p]:dest_offsets[p + 1]`.
    """

    num_tokens_per_die: np.ndarray
    num_tokens_per_expert: np.ndarray
    msg_slot: np.ndarray
    msg_k: np.ndarray
    msg_dest: np.ndarray
    msg_local_expert: np.ndarray
    dest_offsets: np.ndarray

    @property
    def num_msgs(self) -> int:
        return int(self.msg_slot.size)


def check_topk_idx(topk_idx, num_experts: int, name: str = "topk_idx") -> np.ndarray:
    """Validate a routing table; returns it as int64 `[batch, k]` (a view or copy, not frozen).

    Raises TypeError for a non-integer dtype, ValueError for a wrong rank, an id outside
    `{-1} ∪ [0, num_experts)` or an expert named twice in one token's row (a gate's top-k never
    repeats an expert, and every receive area is sized for distinct experts per token; the
    message names the first bad value and its `[slot, k]`).
    """
    arr = np.asarray(topk_idx)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{name}: expected an integer array, got dtype {arr.dtype}")
    if arr.ndim != 2:
        raise ValueError(f"{name}: expected shape [batch, k], got shape {arr.shape}")
    arr = arr.astype(np.int64, copy=False)
    out_of_range = (arr < -1) | (arr >= num_experts)
    if out_of_range.any():  # argwhere only on failure: it costs ~20x the check
        bad = np.argwhere(out_of_range)
        slot, k = (int(v) for v in bad[0])
        raise ValueError(
            f"{name}[{slot}, {k}] = {arr[slot, k]}: expert ids must be -1 (unrouted) or in "
            f"[0, {num_experts}) ({len(bad)} bad entries)"
        )
    if arr.shape[1] > 1:
        _check_distinct(arr, name)
    return arr


def _check_distinct(arr: np.ndarray, name: str) -> None:
    """ValueError if a row names one expert twice (-1 entries may repeat)."""
    s = np.sort(arr, axis=1)
    dup = (s[:, 1:] == s[:, :-1]) & (s[:, 1:] >= 0)
    if dup.any():  # locate the first repeat only on failure
        slot = int(np.flatnonzero(dup.any(axis=1))[0])
        row = arr[slot]
        expert = int(s[slot, 1:][dup[slot]][0])
        ks = np.flatnonzero(row == expert).tolist()
        raise ValueError(
            f"{name}[{slot}] names expert {expert} twice (k = {ks}): a token's routed experts"
            f" must be distinct ({int(dup.any(axis=1).sum())} tokens with repeats)"
        )


def get_dispatch_layout(topk_idx, placement: Placement) -> DispatchLayout:
    """Messages, counts and offsets of one source die's dispatch (docs/protocols.md §5).

    Arguments:
        topk_idx: int array `[batch, k]`, logical expert id per (token, k); -1 = not routed. Any
            integer dtype; every other id must be in `[0, placement.num_experts)`.
        placement: the `Placement` that maps experts to (die, local expert).

    Returns:
        layout: a `DispatchLayout`; its message arrays follow the canonical send order
            (destination position, local expert, batch slot, k), all ascending.
    """
    if not isinstance(placement, Placement):
        raise TypeError(f"placement: expected a Placement, got {type(placement).__name__}")
    topk = check_topk_idx(topk_idx, placement.num_experts)
    slot, k = np.nonzero(topk >= 0)
    expert = topk[slot, k]
    pos = placement.pos_of[expert]
    local = placement.local_of[expert]
    order = np.lexsort((k, slot, local, pos))  # last key is the primary one
    per_die = np.bincount(pos, minlength=len(placement.dies))
    fields = dict(
        num_tokens_per_die=per_die,
        num_tokens_per_expert=np.bincount(expert, minlength=placement.num_experts),
        msg_slot=slot[order],
        msg_k=k[order],
        msg_dest=placement.die_of[expert][order],
        msg_local_expert=local[order],
        dest_offsets=np.concatenate(([0], np.cumsum(per_die))),
    )
    for name, arr in fields.items():
        fields[name] = arr = np.ascontiguousarray(arr, dtype=np.int64)
        arr.flags.writeable = False
    return DispatchLayout(**fields)


@dataclass(frozen=True, eq=False)
class DedupLayout:
    """The rows one source die sends in a dedup dispatch (DeepEP's layout, docs/protocols.md
    §6.3): one row per (token, destination die), whatever the number of that die's experts the
    token routes to, carrying the list of them. Int arrays int64, all read-only.

    Rows are ordered by (destination position in `placement.dies`, batch slot); a row's entries
    by ascending k.

    Fields:
        row_slot: `[n_rows]` batch slot of each row.
        row_kfirst: `[n_rows]` the smallest k of the row's entries (where its combine row lands).
        dest_offsets: `[len(placement.dies) + 1]` rows of `placement.dies[p]` are
            `dest_offsets[p]:dest_offsets[p + 1]`.
        ent_start: `[n_rows + 1]` entries of row i are `ent_start[i]:ent_start[i + 1]`.
        ent_k, ent_local: `[n_entries]` each entry's k index and local expert on the row's die.
        ent_w: float32 `[n_entries]` each entry's weight, `topk_weights[slot, k]`.
        idx_first: `[batch, k]` `topk_idx` where k is the first k of its die for that token,
            -1 elsewhere: the (slot, k) entries a dedup combine returns rows for.
        num_tokens_per_expert: `[num_experts]` entries, i.e. routed (token, k) pairs, per
            logical expert: `DispatchLayout.num_tokens_per_expert`, what a fused flag's
            per-expert counts carry with dedup too.
    """

    row_slot: np.ndarray
    row_kfirst: np.ndarray
    dest_offsets: np.ndarray
    ent_start: np.ndarray
    ent_k: np.ndarray
    ent_local: np.ndarray
    ent_w: np.ndarray
    idx_first: np.ndarray
    num_tokens_per_expert: np.ndarray

    @property
    def num_rows(self) -> int:
        return int(self.row_slot.size)


def get_dedup_layout(topk_idx, topk_weights, placement: Placement) -> DedupLayout:
    """One source die's dedup dispatch rows (see `DedupLayout`).

    Arguments:
        topk_idx: int `[batch, k]` as for `get_dispatch_layout` (validated the same way).
        topk_weights: float `[batch, k]`, converted to float32.
        placement: the `Placement` mapping experts to (die, local expert).
    """
    if not isinstance(placement, Placement):
        raise TypeError(f"placement: expected a Placement, got {type(placement).__name__}")
    topk = check_topk_idx(topk_idx, placement.num_experts)
    w = np.asarray(topk_weights, np.float32)
    if w.shape != topk.shape:
        raise ValueError(f"topk_weights: expected shape {topk.shape}, got {w.shape}")
    slot, k = np.nonzero(topk >= 0)
    expert = topk[slot, k]
    pos = placement.pos_of[expert]
    order = np.lexsort((k, slot, pos))
    slot, k, pos, expert = slot[order], k[order], pos[order], expert[order]
    n = slot.size
    new = np.ones(n, bool)
    new[1:] = (slot[1:] != slot[:-1]) | (pos[1:] != pos[:-1])
    starts = np.flatnonzero(new)
    row_slot, row_kfirst = slot[starts], k[starts]
    per_die = np.bincount(pos[starts], minlength=len(placement.dies))
    idx_first = np.full(topk.shape, -1, np.int64)
    idx_first[row_slot, row_kfirst] = topk[row_slot, row_kfirst]
    fields = dict(
        row_slot=row_slot,
        row_kfirst=row_kfirst,
        dest_offsets=np.concatenate(([0], np.cumsum(per_die))),
        ent_start=np.append(starts, n),
        ent_k=k,
        ent_local=placement.local_of[expert],
        ent_w=w[slot, k],
        idx_first=idx_first,
        num_tokens_per_expert=np.bincount(expert, minlength=placement.num_experts),
    )
    for name, arr in fields.items():
        dt = np.float32 if name == "ent_w" else np.int64
        fields[name] = arr = np.ascontiguousarray(arr, dtype=dt)
        arr.flags.writeable = False
    return DedupLayout(**fields)
