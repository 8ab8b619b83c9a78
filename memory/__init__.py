"""HBM regions: layout, create / attach / unlink, field views, the app-area allocator.

The names below are loaded on first use (PEP 562), so that `from memory.errors import ...`
(the error classes every layer raises, and the CLI's parser) does not load numpy and posix_ipc.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from memory.lazy import lazy_exports

if TYPE_CHECKING:  # the same names, for type checkers and the import-direction test
    from memory.alloc import AppAllocator
    from memory.errors import (
        ConfigError,
        PeerRefused,
        PeerTimeout,
        PodAborted,
        PodError,
        ProtocolError,
        ShmError,
    )
    from memory.layout import FIELD_BYTES, P2P_ACK, P2P_DESC, P2P_RDV, RegionLayout, compute
    from memory.region import Region, RegionHandle, region_name

_HOME = {
    "AppAllocator": "memory.alloc",
    "ConfigError": "memory.errors",
    "PeerRefused": "memory.errors",
    "PeerTimeout": "memory.errors",
    "PodAborted": "memory.errors",
    "PodError": "memory.errors",
    "ProtocolError": "memory.errors",
    "ShmError": "memory.errors",
    "FIELD_BYTES": "memory.layout",
    "P2P_ACK": "memory.layout",
    "P2P_DESC": "memory.layout",
    "P2P_RDV": "memory.layout",
    "RegionLayout": "memory.layout",
    "compute": "memory.layout",
    "Region": "memory.region",
    "RegionHandle": "memory.region",
    "region_name": "memory.region",
}
__all__ = [
    "AppAllocator",
    "ConfigError",
    "FIELD_BYTES",
    "P2P_ACK",
    "P2P_DESC",
    "P2P_RDV",
    "PeerRefused",
    "PeerTimeout",
    "PodAborted",
    "PodError",
    "ProtocolError",
    "Region",
    "RegionHandle",
    "RegionLayout",
    "ShmError",
    "compute",
    "region_name",
]


__getattr__, __dir__ = lazy_exports(__name__, _HOME)
