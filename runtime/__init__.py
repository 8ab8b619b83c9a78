"""Mechanisms: PodConfig, the pod launcher and its dies, the CLI."""

from memory.errors import (
    ConfigError,
    PeerRefused,
    PeerTimeout,
    PodAborted,
    PodError,
    ProtocolError,
    ShmError,
)
from runtime.config import PodConfig
from runtime.die import Die
from runtime.pod import DieCrashed, DieHung, Pod

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
