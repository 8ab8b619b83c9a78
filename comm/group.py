"""Groups of dies: the expert-parallel all-to-all over a subset of the pod (`group_view`).

A prefill-decode disaggregated pod (`runtime.engine.pd`) runs two lockstep EP groups in one
pod: the prefill dies and the decode dies, each with its own dispatch / combine, operation
numbers and event ids. A group is a view of the pod in which the group's dies are ranks
0..n-1: every all-to-all field, area and counter is indexed by rank, so two groups of one pod
never touch a word of each other (a die belongs to one group, and a group's operations write
only into the regions of its own dies). The view shares the die's regions, wait policy, abort
word and trace; it has its own all-to-all state (`view.a2a`) and p2p counters. p2p between the
dies of a group goes through the die's own endpoint (global ids), never through the view:
the view's ranks would index other fields.
"""

from __future__ import annotations

from collections.abc import Sequence

from comm.endpoint import Endpoint
from memory.errors import ConfigError


def group_view(ep: Endpoint, dies: Sequence[int]) -> Endpoint:
    """The all-to-all view of `ep`'s group `dies` (global die ids, ascending, `ep` among
    them): `view.die_id` is this die's rank, `view.num_dies` the group's size, `view.dies`
    the ranks' global ids. Pass it to `comm.dispatch` / `comm.combine` in place of the die."""
    dies = tuple(int(d) for d in dies)
    if not dies or list(dies) != sorted(set(dies)) or not 0 <= dies[0] <= dies[-1] < ep.num_dies:
        raise ConfigError(
            f"group {list(dies)}: need distinct ascending die ids in [0, {ep.num_dies - 1}]"
        )
    if ep.die_id not in dies:
        raise ConfigError(f"group {list(dies)}: die {ep.die_id} is not in it")
    view = Endpoint(
        dies.index(ep.die_id),
        [ep.regions[d] for d in dies],
        ep.policy,
        ep.ub_bytes,
        ep.trace,
        ep.ctx.abort,
        fabric=ep.fab.view(dies),  # a group over hosts pushes through its die's fabric
    )
    view.dies = dies
    view.parent = ep
    ep.group = view  # the launcher's resync of the operation numbers goes through the view
    return view


__all__ = ["group_view"]
