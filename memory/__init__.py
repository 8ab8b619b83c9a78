"""HBM regions: layout, create / attach / unlink, field views, the app-area allocator."""

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

__all__ = [
    "FIELD_BYTES",
    "P2P_ACK",
    "P2P_DESC",
    "P2P_RDV",
    "AppAllocator",
    "ConfigError",
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
