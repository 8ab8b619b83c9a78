"""What a die validates before it publishes anything, and the compiled layout of its routing.

A die whose input fails these checks still takes part in the operation (`comm.alltoall.refuse`).
"""

from __future__ import annotations

import numpy as np

from comm.alltoall.fields import BAD_EVENT, DISPATCH
from comm.alltoall.handles import DispatchHandle
from comm.alltoall.state import A2AState, kernels
from comm.endpoint import Endpoint
from comm.routing import (
    DedupLayout,
    DispatchLayout,
    Placement,
    check_topk_idx,
    get_dedup_layout,
    get_dispatch_layout,
)

PROTOCOLS = ("pull", "fused")
QUANTS = (None, "none", "int8")
EVENT_LIMIT = 1 << 62


def check_event(event_id: object) -> int:
    """The event id as an int; ValueError (as for p2p) unless an int in [0, 2**62)."""
    ok = not isinstance(event_id, bool) and isinstance(event_id, int | np.integer)
    if not ok or not 0 <= event_id < EVENT_LIMIT:
        raise ValueError(f"event_id {event_id!r} must be an int in [0, 2**62)")
    return int(event_id)


def refusal_event(event_id: object) -> int:
    """The event_id word a refusing die publishes: its own if valid, else BAD_EVENT."""
    try:
        return check_event(event_id)
    except (TypeError, ValueError):
        return BAD_EVENT


def check_protocol(protocol: object) -> None:
    if protocol not in PROTOCOLS:
        raise ValueError(
            f"protocol {protocol!r}: supported here: {', '.join(PROTOCOLS)} (this die cannot"
            " take part in its peers' operation: they time out or are aborted)"
        )


def check_inputs(
    ep: Endpoint, x: np.ndarray, topk_idx: np.ndarray, topk_weights: np.ndarray, quant: str | None
) -> None:
    lo = ep.layout
    if quant not in QUANTS:
        raise ValueError(f"quant {quant!r}: choose None or 'int8'")
    if quant in (None, "none") and lo.a2a_dispatch_bytes == 1:
        raise ValueError(
            "quant None: this pod's dispatch rows are laid out for INT8 only"
            " (PodConfig.a2a_dispatch_dtype='int8'); pass quant='int8' or launch with 'float32'"
        )
    if not isinstance(x, np.ndarray) or x.dtype != np.float32 or x.ndim != 2:
        raise TypeError(f"x must be a float32 array [batch, hidden], got {describe(x)}")
    if x.shape[1] != lo.a2a_hidden:
        raise ValueError(f"x has hidden {x.shape[1]}, the pod was laid out for {lo.a2a_hidden}")
    if x.shape[0] > lo.a2a_max_batch:
        raise ValueError(
            f"batch {x.shape[0]} exceeds the configured maximum a2a_max_batch {lo.a2a_max_batch}"
        )
    want = (x.shape[0], lo.a2a_topk)
    for name, arr in (("topk_idx", topk_idx), ("topk_weights", topk_weights)):
        if not isinstance(arr, np.ndarray) or arr.shape != want:
            raise ValueError(f"{name} must have shape {want}, got {describe(arr)}")
    if topk_weights.dtype.kind != "f":
        raise TypeError(f"topk_weights must be a float array, got {describe(topk_weights)}")


def describe(a: object) -> str:
    if isinstance(a, np.ndarray):
        return f"{a.dtype}{list(a.shape)}"
    return type(a).__name__


def check_placement(ep: Endpoint, placement: Placement | None) -> Placement:
    st = ep.a2a
    if placement is not None:
        if st.checked is placement:
            return placement
        if not isinstance(placement, Placement):
            raise TypeError(
                f"placement must be a comm.routing.Placement, got {describe(placement)}"
            )
        most = max(placement.num_local(d) for d in placement.dies)
        cap = ep.layout.a2a_experts_per_die
        if most > cap or max(placement.dies) >= ep.num_dies:
            raise ValueError(
                f"placement puts {most} experts on one die (or names a die outside the pod);"
                f" the pod's areas are sized for {cap} per die"
                " (PodConfig.a2a_max_local_experts)"
            )
        if placement.num_experts != ep.layout.a2a_num_experts:
            raise ValueError(
                f"placement has {placement.num_experts} experts, the pod was laid out for"
                f" {ep.layout.a2a_num_experts}"
            )
        st.checked = placement
        return placement
    if st.placement is None:
        lo = ep.layout
        st.placement = Placement.default(lo.a2a_num_experts, tuple(range(ep.num_dies)))
    return st.placement


def layout_of(topk_idx: np.ndarray, placement: Placement) -> DispatchLayout:
    """`comm.routing.get_dispatch_layout` in one compiled pass (`comm.kernels.dispatch_layout`,
    equal to it); a routing the kernel refuses goes the numpy way, which raises the error
    naming the bad entry."""
    if topk_idx.dtype.kind not in "iu":
        check_topk_idx(topk_idx, placement.num_experts)  # raises its TypeError
    t = np.ascontiguousarray(topk_idx, np.int64)
    got = kernels().dispatch_layout(
        t, placement.pos_of, placement.local_of, placement.die_of, len(placement.dies)
    )
    if isinstance(got, int):  # the numpy path names the bad entry (and is the authority)
        return get_dispatch_layout(t, placement)
    return DispatchLayout(*got)


def dedup_layout_of(
    topk_idx: np.ndarray, topk_weights: np.ndarray, placement: Placement
) -> DedupLayout:
    """`comm.routing.get_dedup_layout` in one compiled pass (`comm.kernels.dedup_layout`, equal
    to it); input the kernel cannot take or refuses (an id out of range or repeated) goes the
    numpy way, which raises the error naming the problem, as `layout_of` does."""
    t, w = np.asarray(topk_idx), np.asarray(topk_weights)
    ok = isinstance(placement, Placement) and t.dtype.kind in "iu" and t.ndim == 2
    if not ok or w.shape != t.shape or w.dtype.kind not in "fiu":
        return get_dedup_layout(topk_idx, topk_weights, placement)
    t, w = np.ascontiguousarray(t, np.int64), np.ascontiguousarray(w, np.float32)
    got = kernels().dedup_layout(t, w, placement.pos_of, placement.local_of, len(placement.dies))
    if isinstance(got, int):  # an id out of range or repeated: the numpy path names it
        return get_dedup_layout(t, w, placement)
    return DedupLayout(*got)


def make_payload(x: np.ndarray, quant: str | None) -> tuple[np.ndarray, np.ndarray]:
    """(rows to send, per-row scales): INT8 + scales, or x itself with scales of 1."""
    if quant == "int8":
        return kernels().quantize_int8(x)  # comm.quant.quantize_int8, compiled, bit for bit
    return x, np.ones(len(x), np.float32)


def check_capacity(ep: Endpoint, lay: DispatchLayout, placement: Placement) -> None:
    """Refuse a dispatch whose rows for one destination would not fit its receive area (only a
    routing that names more experts of one die per token than the layout allows could)."""
    per_src = ep.layout.fused_disp_rows
    most = int(lay.num_tokens_per_die.max()) if lay.num_tokens_per_die.size else 0
    if most > per_src:
        p = int(np.argmax(lay.num_tokens_per_die))
        raise ValueError(
            f"dispatch sends {most} rows to die {placement.dies[p]}, more than its receive area"
            f" holds per source ({per_src} = a2a_max_batch x min(a2a_topk, experts per die))"
        )


def check_handle(st: A2AState, handle: object) -> None:
    if not isinstance(handle, DispatchHandle) or handle.protocol not in PROTOCOLS:
        raise TypeError(
            f"handle must be the DispatchHandle of a dispatch (a2e's goes to e2a), got"
            f" {describe(handle)}"
        )
    if handle.protocol == "fused" and (
        handle.op != st.fused_ops[DISPATCH] or handle.op == st.fused_combined
    ):
        again = " again" if handle.op == st.fused_combined else ""
        raise ValueError(
            f"handle: a fused combine reverses the latest fused dispatch or a2e of this die"
            f" (operation {st.fused_ops[DISPATCH]}) once; this is operation {handle.op}{again}"
            " (the fused combine buffer is single: fused dispatch and combine must alternate;"
            " the pull protocol allows several outstanding handles)"
        )


def check_expert_out(ep: Endpoint, expert_out: np.ndarray, n_rows: int) -> None:
    hidden = ep.layout.a2a_hidden
    if n_rows > ep.layout.pull_comb_rows:
        raise ValueError(
            f"combine would return {n_rows} rows, more than this die's combine area holds"
            f" ({ep.layout.pull_comb_rows} = dies x a2a_max_batch x min(a2a_topk, experts per"
            " die)): the dispatch routed a token to one expert more than once"
        )
    if not isinstance(expert_out, np.ndarray) or expert_out.dtype != np.float32:
        raise TypeError(f"expert_out must be float32 [n_rows, hidden], got {describe(expert_out)}")
    if expert_out.shape != (n_rows, hidden):
        raise ValueError(
            f"expert_out has shape {list(expert_out.shape)}, the dispatch delivered"
            f" {n_rows} rows of hidden {hidden}"
        )
