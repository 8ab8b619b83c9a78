"""Mechanisms: the pod (`runtime.pod`), the toy model (`runtime.model`), `xpod decode`
(`runtime.decode`), the serving engine (`runtime.engine`), the HTTP API (`runtime.api`) and the
`xpod` command (`runtime.cli`); docs/architecture.md §1 draws their import direction.

`from runtime import Pod, PodConfig` and the error classes are loaded on first use (PEP 562):
`xpod --help` and `xpod clean` start without loading numpy, the pod or the model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from memory.lazy import lazy_exports
from runtime._packages import use_our_sched

use_our_sched()  # before anything imports `sched` (it is also a stdlib module)

if TYPE_CHECKING:  # the same names, for type checkers and the import-direction test
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

_HOME = {
    "ConfigError": "memory.errors",
    "PeerRefused": "memory.errors",
    "PeerTimeout": "memory.errors",
    "PodAborted": "memory.errors",
    "PodError": "memory.errors",
    "ProtocolError": "memory.errors",
    "ShmError": "memory.errors",
    "Die": "runtime.pod",
    "DieCrashed": "runtime.pod",
    "DieHung": "runtime.pod",
    "Pod": "runtime.pod",
    "PodConfig": "runtime.pod",
}
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


__getattr__, __dir__ = lazy_exports(__name__, _HOME)
