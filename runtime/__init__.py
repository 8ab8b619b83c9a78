"""Mechanisms: PodConfig, the pod launcher and its dies, the CLI."""

from memory.errors import (
    ConfigError,
    PeerTimeout,
    PodAborted,
    PodError,
    ProtocolError,
    ShmError,
)
from runtime.config import PodConfig
from runtime.die import Die
from runtime.pod import DieCrashed, Pod

__all__ = [
    "ConfigError",
    "Die",
    "DieCrashed",
    "PeerTimeout",
    "Pod",
    "PodAborted",
    "PodConfig",
    "PodError",
    "ProtocolError",
    "ShmError",
]
