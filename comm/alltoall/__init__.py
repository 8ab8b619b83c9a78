"""Expert-parallel all-to-all: dispatch / combine (pull, fused), A2E / E2A (docs/protocols.md §5-8).

```python
d = comm.dispatch(die, x, topk_idx, topk_weights, protocol="pull", quant="int8", event_id=n)
expert_out = run_my_experts(d)             # d.x rows grouped by local expert, d.expert_counts
out = comm.combine(die, expert_out, d.handle, event_id=n)
```

One module per data path, as DeepEP keeps one kernel file per path:

    pull.py        `dispatch` / `combine`: the entry points (protocol="fused" is handed over)
                   and the pull protocol (§6)
    fused.py       FusedDispatch / FusedCombine with AIV-Direct (§7)
    trampoline.py  `a2e` / `e2a` with trampoline forwarding (§8)
    split.py       `Split`: attention / expert dies, DP domains, micro-batches, op numbers
    refuse.py      a die with bad input still takes part, so every die's counters stay in step
    fields.py      the field and flag protocol the three share
    inputs.py      what a die validates before it publishes
    packets.py     dispatch packets: dedup rows packed, received rows grouped by local expert
    scatter.py     the combine-side writes of the fused combine and E2A
    areas.py       bounds-checked views of the areas in any die's region
    state.py       `ep.a2a`: operation numbers (`a2a_counters`, `a2a_realign`), caches, `kernels()`
    handles.py     `DispatchResult`, `DispatchHandle`, `DedupGroups`, `A2EHandle`
"""

from comm.alltoall.fields import (
    BAD_EVENT,
    COMBINE,
    DEDUP_CODE,
    DISPATCH,
    F_COUNT,
    F_EVENT,
    F_OFF,
    F_SEQ,
    G_COUNT,
    G_EVENT,
    G_QUANT,
    G_SEQ,
    OFF_BITS,
    OP_CODE_MASK,
    QUANT_CODE,
    QUANT_NAME,
    REFUSED,
)
from comm.alltoall.handles import A2EHandle, DedupGroups, DispatchHandle, DispatchResult
from comm.alltoall.inputs import EVENT_LIMIT, PROTOCOLS, QUANTS
from comm.alltoall.pull import combine, dispatch, weighted_sum
from comm.alltoall.split import Split
from comm.alltoall.state import A2AState, a2a_counters, a2a_realign, kernels
from comm.alltoall.trampoline import DEST_SHIFT, a2e, a2e_align, e2a

__all__ = [
    "BAD_EVENT",
    "COMBINE",
    "DEDUP_CODE",
    "DEST_SHIFT",
    "DISPATCH",
    "EVENT_LIMIT",
    "F_COUNT",
    "F_EVENT",
    "F_OFF",
    "F_SEQ",
    "G_COUNT",
    "G_EVENT",
    "G_QUANT",
    "G_SEQ",
    "OFF_BITS",
    "OP_CODE_MASK",
    "PROTOCOLS",
    "QUANTS",
    "QUANT_CODE",
    "QUANT_NAME",
    "REFUSED",
    "A2AState",
    "A2EHandle",
    "Split",
    "DedupGroups",
    "DispatchHandle",
    "DispatchResult",
    "a2a_counters",
    "a2a_realign",
    "a2e",
    "a2e_align",
    "combine",
    "dispatch",
    "e2a",
    "kernels",
    "weighted_sum",
]
