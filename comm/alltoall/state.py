"""A die's all-to-all state (`ep.a2a`): operation numbers, placements and the views it caches.

`a2a_counters` / `a2a_realign` let the launcher resync the operation numbers after a failed
`pod.run` (`runtime.pod`); `kernels()` loads `comm.kernels` (numba) on first use.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import ModuleType

import numpy as np

from comm.alltoall.handles import DispatchHandle
from comm.endpoint import Endpoint
from comm.routing import Placement
from memory.errors import ConfigError


@dataclass(slots=True)
class A2AState:
    """A die's all-to-all state (`ep.a2a`), the same numbers on every die while in step.

    Attributes:
        pull_ops: [dispatch, combine] operation numbers of the pull protocol (field seq words).
        fused_ops: [dispatch, combine] operation numbers of fused dispatch / A2E and fused
            combine / E2A (flag seq words and combine completion words).
        placement: the default placement; a2e_placement: the A2E placement over expert dies.
        checked: the last caller placement that passed the capacity check.
        last: the handle of this die's latest dispatch (what a refusing combine owes).
        fused_combined: the fused dispatch operation this die combined last (once only).
        place_info: per-die facts of the last placement used; comb_f32: combine buffer views;
            views: word views (`meta_words`) and flat combine buffers, made once per area.
        a2e_open: an attention die's A2E calls awaiting their E2A, op -> (event id, slot base,
            rows); a2e_next_mb: the micro-batch its next A2E call must be.
    """

    pull_ops: list[int] = field(default_factory=lambda: [0, 0])
    fused_ops: list[int] = field(default_factory=lambda: [0, 0])
    placement: Placement | None = None
    a2e_placement: Placement | None = None
    checked: Placement | None = None
    last: DispatchHandle | None = None
    fused_combined: int = 0
    place_info: _PlaceInfo | None = None
    comb_f32: dict = field(default_factory=dict)
    views: dict = field(default_factory=dict)
    a2e_open: dict = field(default_factory=dict)
    a2e_next_mb: int = 0

    def counters(self) -> list[int]:
        return [*self.pull_ops, *self.fused_ops]

    def realign(self, counters: list[int]) -> None:
        """Set the operation numbers (the launcher's resync passes the maximum over dies)."""
        self.pull_ops[:] = counters[:2]
        self.fused_ops[:] = counters[2:4]
        self.a2e_open.clear()
        self.a2e_next_mb = 0


def a2a_state(ep: Endpoint) -> A2AState:
    st = getattr(ep, "a2a", None)
    if st is None:
        if not ep.layout.a2a_max_batch:
            raise ConfigError(
                "a2a_max_batch: this pod has no all-to-all areas; launch it with"
                " PodConfig(a2a_max_batch=..., a2a_hidden=..., a2a_topk=..., num_experts=...)"
            )
        st = ep.a2a = A2AState()
    return st


def a2a_counters(ep: Endpoint) -> list[int] | None:
    """This die's operation numbers (None if it never ran an all-to-all); for resync. A die
    in a group (`comm.group_view`) runs its all-to-all through the view: its numbers."""
    ep = getattr(ep, "group", None) or ep
    st = getattr(ep, "a2a", None)
    return None if st is None else st.counters()


def a2a_realign(ep: Endpoint, counters: list[int]) -> None:
    """Resync after a failed pod.run: every die takes the same (maximum) operation numbers, so
    the next operation is in step whatever each die had done; every field and completion word
    holds at most these numbers, so none of them can satisfy the next wait."""
    ep = getattr(ep, "group", None) or ep
    if ep.layout.a2a_max_batch:
        a2a_state(ep).realign(counters)


@dataclass(frozen=True)
class _PlaceInfo:
    """Per-die facts of a placement, computed once per placement object (hot-path lookups)."""

    placement: Placement
    pos: list[int]  # [die] position in placement.dies, -1 if the die hosts no expert
    num_local: list[int]  # [die] experts hosted
    experts: list  # [die] its logical experts in local order (int64; empty if none)
    pos_arr: np.ndarray  # int64 [die]: pos, for the kernels
    dies_arr: np.ndarray  # int64 [position]: placement.dies
    exp_flat: np.ndarray  # int64: every die's experts, die after die
    exp_start: np.ndarray  # int64 [die + 1]: die d's are exp_flat[exp_start[d]:exp_start[d + 1]]


def place_info(ep: Endpoint, placement: Placement) -> _PlaceInfo:
    st = ep.a2a
    info = st.place_info
    if info is None or info.placement is not placement:
        pos = [-1] * ep.num_dies
        for p, d in enumerate(placement.dies):
            pos[d] = p
        counts = np.bincount(placement.die_of, minlength=ep.num_dies).tolist()
        experts = [placement.experts_on(d) if pos[d] >= 0 else np.zeros(0, np.int64)
                   for d in range(ep.num_dies)]  # fmt: skip
        sizes = [len(e) for e in experts]
        info = st.place_info = _PlaceInfo(
            placement, pos, counts[: ep.num_dies], experts,
            np.array(pos, np.int64), np.array(placement.dies, np.int64),
            np.concatenate([np.asarray(e, np.int64) for e in experts]),
            np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64),
        )  # fmt: skip
    return info


@dataclass(frozen=True)
class _Mem:
    """Where every region of the pod is mapped in this die (int64 [dies] addresses) and a
    region's size, made once per die: the fused protocol's kernels address any die's region
    through them (`comm.kernels.region`), so one call writes into every destination. The
    endpoint keeps every region mapped while it lives, so the addresses stay valid."""

    addrs: np.ndarray
    nbytes: int


def region_addrs(ep: Endpoint) -> _Mem:
    views = ep.a2a.views
    m = views.get("mem")
    if m is None:
        arrays = [r.array for r in ep.regions]
        m = views["mem"] = _Mem(np.array([a.ctypes.data for a in arrays], np.int64),
                                len(arrays[0]))  # fmt: skip
    return m


_KERNELS = None


def kernels() -> ModuleType:
    """`comm.kernels` (numba), imported on first use: a pod with bfloat16 combine rows loads it
    in the launcher before its dies fork (`runtime.pod`), so they start with it compiled. Kept
    in a global: an import statement costs ~2.4 us, and a collective looks it up ~5 times."""
    global _KERNELS
    if _KERNELS is None:
        from comm import kernels as k

        _KERNELS = k
    return _KERNELS
