"""Serving decisions, no processes, sockets or shared memory (imports nothing of ours).

- `request`: Request, SamplingParams and their status / finish reason;
- `kv`: KVManager, the RTC block bookkeeping of one DP group (prefix cache, refcounts, LRU);
- `scheduler`: Scheduler, the step plans of one DP group under asynchronous execution;
- `lb`: LoadBalancer, which decode DP group gets a new request.
"""

from .kv import KVFull, KVManager, block_hash
from .lb import LoadBalancer
from .request import FinishReason, Request, RequestStatus, SamplingParams
from .scheduler import Row, Scheduler, SchedulerConfig, StepOutput, StepPlan

__all__ = [
    "FinishReason",
    "KVFull",
    "KVManager",
    "LoadBalancer",
    "Request",
    "RequestStatus",
    "Row",
    "SamplingParams",
    "Scheduler",
    "SchedulerConfig",
    "StepOutput",
    "StepPlan",
    "block_hash",
]
