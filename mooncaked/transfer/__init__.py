"""Data plane: register memory regions, move bytes between peers in batches.

Backends: tcp (default), shm (peers on one host), rdma (Mooncake's Transfer
Engine, optional); auto picks shm or tcp per peer. Knows nothing of models.
"""

from mooncaked.transfer.api import (
    BackendUnavailableError,
    EngineStats,
    OutOfBoundsError,
    PeerInfo,
    PeerUnavailableError,
    ProtocolError,
    RegionInfo,
    TransferError,
    TransferOp,
    TransferTimeoutError,
    UnknownRegionError,
)
from mooncaked.transfer.host import host_id


def __getattr__(name: str):
    """`TransferEngine` loads torch (for tensor regions): imported on first use, so processes that only
    speak the wire (the store master) start without it."""
    if name == "TransferEngine":
        from mooncaked.transfer.engine import TransferEngine

        return TransferEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = [
    "BackendUnavailableError",
    "EngineStats",
    "OutOfBoundsError",
    "PeerInfo",
    "PeerUnavailableError",
    "ProtocolError",
    "RegionInfo",
    "TransferEngine",
    "TransferError",
    "TransferOp",
    "TransferTimeoutError",
    "UnknownRegionError",
    "host_id",
]
