"""A request as the scheduler sees it: prompt, sampling parameters, accepted output and the
counters of asynchronous execution.

Counters (positions are token positions in `all_tokens`, 0-based):
- `num_scheduled`: positions [0, num_scheduled) have their KV written by planned rows (in flight
  included); `num_computed` <= `num_scheduled` counts those whose result arrived (and prefix hits).
- `pending_samples`: planned rows that will sample, result not arrived; the next sampled token
  has output index `index_base + len(output) + pending_samples` (`index_base`: the tokens a
  resumed request had delivered before a restart; they are part of its prompt now).
- `epoch`: bumped on preemption; a row carries its epoch and results of an older one are dropped.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS or a stop token (the stop token is part of the output)
    LENGTH = "length"  # max_tokens reached
    ABORT = "abort"  # the client or the runtime aborted it
    ERROR = "error"  # the runtime failed it (never set by the scheduler)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(slots=True)
class SamplingParams:
    """How to sample one request. `temperature` 0 is greedy; `seed` seeds the per-token rng
    (draws keyed on (seed, token index) only). `seed` None: the engine draws one when it accepts
    the request and records it (`RequestTracker.track`); a scheduler used alone takes 0."""

    max_tokens: int = 16
    temperature: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def validate(self, vocab_size: int) -> None:
        """TypeError for a wrong type, ValueError for a bad value; both name the field."""
        if not _is_int(vocab_size) or vocab_size < 1:
            raise ValueError(f"vocab_size must be an int >= 1, got {vocab_size!r}")
        if not _is_int(self.max_tokens):
            raise TypeError(f"max_tokens must be an int, got {type(self.max_tokens).__name__}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not isinstance(self.temperature, int | float) or isinstance(self.temperature, bool):
            raise TypeError(f"temperature must be a float, got {type(self.temperature).__name__}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature}")
        if self.seed is not None and not _is_int(self.seed):
            raise TypeError(f"seed must be an int, got {type(self.seed).__name__}")
        if self.seed is not None and self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")
        if not isinstance(self.stop_token_ids, tuple | list):
            raise TypeError(f"stop_token_ids must be a tuple of ints, got {self.stop_token_ids!r}")
        for t in self.stop_token_ids:
            if not _is_int(t):
                raise TypeError(f"stop_token_ids must hold ints, got {t!r}")
            if not 0 <= t < vocab_size:
                raise ValueError(f"stop_token_ids: {t} is outside [0, {vocab_size})")
        if not isinstance(self.ignore_eos, bool):
            raise TypeError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")


@dataclass(slots=True, eq=False)
class Request:
    """One generation request; the scheduler owns every field after `Scheduler.add`."""

    request_id: int
    prompt: list[int]
    params: SamplingParams
    eos_token_id: int | None = None
    arrival: float = 0.0
    output: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    num_computed: int = 0
    num_scheduled: int = 0
    num_cached: int = 0
    epoch: int = 0
    num_preemptions: int = 0
    pending_samples: int = 0
    last_plan: int = -1
    index_base: int = 0  # a resumed request: tokens delivered before (its output indices go on)
    ns: str | None = None  # its prefix-cache namespace (cache salt; `sched.pool_types.ns_root`)

    @property
    def all_tokens(self) -> list[int]:
        """prompt + accepted output (a new list)."""
        return self.prompt + self.output

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
