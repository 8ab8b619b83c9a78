"""The serving engine (FlowServe's, 001 §4): `Engine` in the caller's process (the TE-shell role:
processes, the DP balancer, the books of the requests), one master per DP group
(`master`: scheduler and KV manager), the die loop (`executor`), output processes (`output`,
rendering with `render`), the shared-memory step rings (`step_ring`), the wire frames (`wire`),
the schedule replay (`replay`) and the serving trace (`trace`). Imports the model and the pod,
never the decode application or the HTTP API.
"""

from runtime.engine.config import EngineConfig
from runtime.engine.engine import Engine
from runtime.engine.records import CompletionOutput, Delta, EngineError
from sched import SamplingParams

__all__ = ["CompletionOutput", "Delta", "Engine", "EngineConfig", "EngineError", "SamplingParams"]
