"""The engine's records of a request: what a caller gets back (`CompletionOutput` for a
finished request, `Delta` for a streamed one's new tokens or rendered bytes), the engine's view
of a live request (`TrackedRequest`), and `EngineError`, which ends pending requests.

The books that create and update them are `runtime.engine.tracker.RequestTracker`'s, which
re-exports these names; split from `tracker.py`, which keeps the books.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from memory.errors import PodError
from runtime.model import decode
from sched import SamplingParams


class EngineError(PodError):
    """The engine failed (a die or a master died, or it was closed); pending requests end with
    finish reason "error"."""


@dataclass
class CompletionOutput:
    """A finished request."""

    request_id: int
    prompt: str | list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    error: str = ""
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    group: int = -1
    ttft_s: float = 0.0
    e2e_s: float = 0.0

    @property
    def tpot_s(self) -> float:
        n = len(self.token_ids)
        return (self.e2e_s - self.ttft_s) / (n - 1) if n > 1 else 0.0


@dataclass
class Delta:
    """New tokens of a streamed request (`finish_reason` set on the last one). A rendered
    request's deltas carry `data` instead: the bytes for its client, `n_tokens` tokens' worth,
    `final` on its last bytes (which may come before the Delta with the finish reason)."""

    request_id: int
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    error: str = ""
    data: bytes = b""
    n_tokens: int = 0
    final: bool = False
    status: int = 200  # of a rendered response: 500 if the engine failed it, 503 if down


class TrackedRequest:
    """The engine's view of one request (times are `time.monotonic()` seconds)."""

    def __init__(self, rid: int, prompt, tokens: list[int], params: SamplingParams):
        self.id, self.prompt, self.tokens, self.params = rid, prompt, tokens, params
        self.out: list[int] = []
        self.group = -1
        self.t0 = time.monotonic()
        self.t_first = 0.0
        self.t_done = 0.0
        self.reason: str | None = None
        self.error = ""
        self.n_cached = 0
        self.done = threading.Event()
        self.listeners: list = []  # (loop, asyncio.Queue) of streams
        self.keep = False  # submit(): keep it after it finished, for result()
        self.pin: int | None = None  # a DP group chosen by the caller
        self.render: dict | None = None  # rendered for an HTTP client (runtime.engine.render)
        self.n_out = 0  # tokens generated (rendered: counted up to a stop string)
        self.t_sched = 0.0  # first planned (from the master)
        self.t_last = 0.0  # the last tokens arrived
        self.final = False  # a rendered request's last bytes went out
        self.resumed = 0  # times it was re-admitted after a restart (token recomputation)
        self.t_resumed = 0.0  # its first token after the latest re-admission
        self.aborted = False  # the caller aborted it (a restart must not resume it)
        self.prefill_group = -1  # a PD pod: its prefill die (`group` is its decode die)
        self.transcript: list[int] | None = None  # MTP oracle / synthetic drafts' source
        self.pd: dict = {}  # a PD request's times and transfer: sched, prefilled, landed, ...
        self.ns: str | None = None  # its cache salt: its prefix-cache namespace (`track`)

    @property
    def streamed(self) -> bool:
        """Does the master send tokens every step (else all of them with the finish)?"""
        if not self.listeners:
            return False
        r = self.render
        return r is None or bool(r.get("stream") or r.get("stop"))

    def output(self) -> CompletionOutput:
        return CompletionOutput(
            self.id, self.prompt, list(self.out), decode(self.out), self.reason or "error",
            self.error, len(self.tokens), self.n_cached, self.group,
            (self.t_first - self.t0) if self.t_first else 0.0, self.t_done - self.t0,
        )  # fmt: skip
