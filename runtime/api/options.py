"""`ServerOptions`: a checked `xpod serve` run (the CLI builds it from flags, `runtime.cli`).
No aiohttp here: building the options must work without the `serve` extra."""

from __future__ import annotations

from dataclasses import dataclass

from runtime.engine import EngineConfig


@dataclass(frozen=True)
class ServerOptions:
    """A checked `xpod serve` run.

    Attributes:
        engine: the EngineConfig (valid, its PodConfig too).
        host, port: where to listen (port 0: a free one, printed).
        model_name: the model id clients name (`xpod-<preset>` by default).
        max_queue: requests the shell may hold while every group is full; past it: 503.
        drain_timeout_s: on SIGTERM / Ctrl-C, how long in-flight requests may run on.
        health_timeout_s: a group that has not answered a heartbeat for this long is unhealthy.
        max_body_bytes: larger request bodies get 413.
        access_log: log every HTTP request on stderr.
        shell_batch: run the shell's threads as SCHED_BATCH (`runtime.pod.proc.batch_scheduling`).
        replay_check: a file: log every step, and at the end replay them through the
            single-process reference and write what it found there as JSON ("" = off).
        loop_receiver: the event loop reads the masters' messages (`Engine.attach_loop`), not
            the engine's receiver thread.
    """

    engine: EngineConfig
    host: str = "127.0.0.1"
    port: int = 8000
    model_name: str = ""
    max_queue: int = 1024
    drain_timeout_s: float = 30.0
    health_timeout_s: float = 5.0
    max_body_bytes: int = 1 << 20
    access_log: bool = False
    shell_batch: bool = True
    loop_receiver: bool = True
    replay_check: str = ""

    @property
    def served_name(self) -> str:
        return self.model_name or f"xpod-{self.engine.model}"

    @property
    def heartbeat_s(self) -> float:
        return min(1.0, self.health_timeout_s / 4)
