"""Serving decisions, no processes, sockets or shared memory (imports nothing of ours).

- `request`: Request, SamplingParams and their status / finish reason;
- `kv`: KVManager, the RTC block bookkeeping of one DP group (prefix cache, refcounts, LRU);
- `scheduler`: Scheduler, the step plans of one DP group under asynchronous execution;
- `lb`: LoadBalancer, which decode DP group gets a new request;
- `eplb`: expert load balancing, which die holds which replica of which expert (ExpertMap,
  plan: DeepSeek's EPLB port and the greedy of 001 §4.5; replica_for by token position).
"""

from .eplb import ExpertMap, plan, replica_for, row_positions
from .kv import KVFull, KVManager, block_hash
from .lb import LoadBalancer
from .request import FinishReason, Request, RequestStatus, SamplingParams
from .scheduler import Row, Scheduler, SchedulerConfig, StepOutput, StepPlan

__all__ = [
    "ExpertMap",
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
    "plan",
    "replica_for",
    "row_positions",
]
