"""Mechanisms: PodConfig, the pod launcher and its dies, the serving processes, the CLI."""

from runtime._packages import use_our_sched

use_our_sched()  # before anything imports `sched` (it is also a stdlib module)

# ruff: noqa: E402

from memory.errors import (
    ConfigError,
    PeerRefused,
    PeerTimeout,
    PodAborted,
    PodError,
    ProtocolError,
    ShmError,
)
from runtime.pod import Die, DieCrashed, DieHung, Pod, PodConfig

__all__ = [
    "ConfigError",
    "Die",
    "DieCrashed",
    "DieHung",
    "PeerRefused",
    "PeerTimeout",
    "Pod",
    "PodAborted",
    "PodConfig",
    "PodError",
    "ProtocolError",
    "ShmError",
]
