"""What `dispatch` and `a2e` return and `combine` and `e2a` take back: results and handles."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from comm.alltoall.split import Split
from comm.routing import DedupLayout, DispatchLayout, Placement


@dataclass(frozen=True)
class DedupGroups:
    """An expert die's view of the dedup rows it received (one group per (source die, token)),
    in receive order: by source die, then the source's send order (batch slot).

    Attributes:
        src, slot, kfirst: int64 [groups], where the group's pre-reduced combine row goes: the
            source die, and the (batch slot, k) of the token's first expert on this die.
        start: int64 [groups + 1], entries of group g are start[g]:start[g + 1], ascending k.
        pos: int64 [entries], the entry's row in the dispatch output (grouped by expert).
        w: float32 [entries], the entry's routing weight, as the source sent it.
    """

    src: np.ndarray
    slot: np.ndarray
    kfirst: np.ndarray
    start: np.ndarray
    pos: np.ndarray
    w: np.ndarray


@dataclass(frozen=True)
class DispatchHandle:
    """What `combine` needs from the `dispatch` it reverses (treat as opaque).

    Attributes:
        protocol, quant: as dispatched.
        placement: the expert placement used.
        layout: this die's DispatchLayout (its messages in canonical send order); None after
            a dedup dispatch, whose rows are `dedup`'s.
        topk_idx: int64 [batch, k]; topk_weights: float32 [batch, k] (this die's tokens).
        recv_src_rank: int64 [n_rows], the source die of each dispatched row this die received.
        op: the dispatch operation number.
        recv_slot, recv_k: int64 [n_rows], each row's (batch_slot, k_index) at its source.
        dedup: with dedup, this die's DedupLayout (its rows as a source); groups: the
            DedupGroups it received (as an expert die). None without dedup.
    """

    protocol: str
    quant: str | None
    placement: Placement
    layout: DispatchLayout | None
    topk_idx: np.ndarray
    topk_weights: np.ndarray
    recv_src_rank: np.ndarray
    op: int
    recv_slot: np.ndarray | None = None
    recv_k: np.ndarray | None = None
    dedup: DedupLayout | None = None
    groups: DedupGroups | None = None


@dataclass(frozen=True)
class DispatchResult:
    """Rows this die received, grouped by local expert (the order of `comm.reference`).

    Attributes:
        x: [n_rows, hidden] float32, or int8 when quantized.
        scales: float32 [n_rows] per-row INT8 scales, or None.
        src_rank, batch_slot, k_index, local_expert: int64 [n_rows], each row's origin.
        expert_counts: int64 [experts_per_die], rows per local expert.
        handle: pass to `combine`.
    """

    x: np.ndarray
    scales: np.ndarray | None
    src_rank: np.ndarray
    batch_slot: np.ndarray
    k_index: np.ndarray
    local_expert: np.ndarray
    expert_counts: np.ndarray
    handle: DispatchHandle


def dispatch_result(proto: str, quant: str | None, placement: Placement,
                    lay: DispatchLayout | None, topk_idx: np.ndarray, topk_weights: np.ndarray,
                    op: int, rows: tuple, dl: DedupLayout | None = None,
                    groups: DedupGroups | None = None) -> DispatchResult:  # fmt: skip
    """The DispatchResult of `rows` = (x, scales, src_rank, slot, k_index, local_expert,
    expert_counts), with its handle."""
    x, scales, src_rank, slot, k_index, local, counts = rows
    handle = DispatchHandle(
        protocol=proto,
        quant=quant,
        placement=placement,
        layout=lay,
        topk_idx=np.asarray(topk_idx, np.int64),
        topk_weights=np.asarray(topk_weights, np.float32),
        recv_src_rank=src_rank,
        op=op,
        recv_slot=slot,
        recv_k=k_index,
        dedup=dl,
        groups=groups,
    )
    return DispatchResult(x, scales, src_rank, slot, k_index, local, counts, handle)


@dataclass(frozen=True)
class A2EHandle:
    """What `e2a` needs from `a2e` (treat as opaque).

    Attributes:
        split: the pod's `comm.alltoall.split.Split` (attention dies, expert dies, domains).
        role: "attention" or "expert".
        dispatch: an expert die's DispatchHandle (None on attention dies).
        topk_idx, topk_weights: an attention die's routing (None on expert dies).
        partner_slots: on a trampoline, the (batch_slot, k_index, expert die) of every row its
            attention die routed.
        metadata_writes: fields this die wrote in other dies' meta areas during `a2e`.
        op: the pod-wide operation number of the call (`Split.next_op`); e2a uses it too.
        event_id: the operation's event id (an expert die may have learned it from the packets).
        slot_base: an attention die's first batch slot of the micro-batch.
        trampoline: an attention die's trampoline; partner: a trampoline's attention die.
        domain, microbatch: the (domain, micro-batch) position of the call.
    """

    split: Split
    role: str
    dispatch: DispatchHandle | None
    topk_idx: np.ndarray | None
    topk_weights: np.ndarray | None
    partner_slots: tuple[np.ndarray, np.ndarray, np.ndarray] | None
    metadata_writes: int
    op: int = 0
    event_id: int = 0
    slot_base: int = 0
    trampoline: int = -1
    partner: int | None = None
    domain: int = 0
    microbatch: int = 0

    @property
    def n_att(self) -> int:
        return len(self.split.att_dies)
