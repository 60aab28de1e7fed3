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
from mooncaked.transfer.engine import TransferEngine
from mooncaked.transfer.shm import host_id

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
