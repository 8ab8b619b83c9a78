"""The data plane: XCCL point-to-point send / recv (`comm.p2p`), the expert-parallel all-to-all
(`comm.alltoall`: dispatch / combine, A2E / E2A) and its compiled kernels (`comm.kernels`), the
wait policy, the trace; `comm.reference` computes every collective in plain numpy.

Every function takes the calling die first (`runtime.Die`, a `comm.Endpoint`):

    comm.send(die, buf, dst, event_id, cores=1, variant="mte")
    comm.recv(die, buf, src, event_id, cores=1, variant="mte")
    req = comm.isend(...); req.test(); req.wait()
    comm.barrier(die)
    d = comm.dispatch(die, x, topk_idx, topk_weights); y = comm.combine(die, rows, d.handle)
"""

from comm.alltoall import (
    A2EHandle,
    DispatchHandle,
    DispatchResult,
    Split,
    a2e,
    a2e_align,
    combine,
    dispatch,
    e2a,
)
from comm.endpoint import Endpoint, barrier
from comm.p2p import VARIANTS, Request, irecv, isend, recv, resync, send
from comm.trace import Trace, steps_of, to_chrome, write_chrome
from comm.wait import WaitContext, WaitPolicy, wait_ge
from memory.errors import (
    ConfigError,
    PeerRefused,
    PeerTimeout,
    PodAborted,
    PodError,
    ProtocolError,
)

__all__ = [
    "VARIANTS",
    "A2EHandle",
    "Split",
    "a2e",
    "a2e_align",
    "e2a",
    "DispatchHandle",
    "DispatchResult",
    "combine",
    "dispatch",
    "ConfigError",
    "Endpoint",
    "PeerRefused",
    "PeerTimeout",
    "PodAborted",
    "PodError",
    "ProtocolError",
    "Request",
    "Trace",
    "WaitContext",
    "WaitPolicy",
    "barrier",
    "irecv",
    "isend",
    "recv",
    "resync",
    "send",
    "steps_of",
    "to_chrome",
    "wait_ge",
    "write_chrome",
]
