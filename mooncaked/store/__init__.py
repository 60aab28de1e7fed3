"""The Mooncake Store: a cluster-wide KV pool.

master.py/eviction.py (metadata state machine), service.py (its gRPC face, served by
master_runner.py; pool_events.py streams what the pool holds to prefix indexes), client.py (what
engines embed: DRAM segment, LMDB tier; puts in writes.py, gets in gets.py + reads.py, bytes
through transfer/). See docs/architecture.md, the store's row.

The client is imported lazily: the master never needs torch or the data plane, and a
store daemon should start in a second, not in the time torch takes to import.
"""

from typing import TYPE_CHECKING, Any

from mooncaked.store.errors import (
    FailedPrecondition,
    InvalidArgument,
    NoRoom,
    NotFound,
    StoreError,
    StoreUnavailable,
)
from mooncaked.store.records import Policy, checksum

if TYPE_CHECKING:
    from mooncaked.store.client import StoreClient, StoreClientConfig


def __getattr__(name: str) -> Any:
    if name in ("StoreClient", "StoreClientConfig"):
        from mooncaked.store import client

        return getattr(client, name)
    raise AttributeError(f"module 'mooncaked.store' has no attribute {name!r}")


__all__ = [
    "FailedPrecondition",
    "InvalidArgument",
    "NoRoom",
    "NotFound",
    "Policy",
    "StoreClient",
    "StoreClientConfig",
    "StoreError",
    "StoreUnavailable",
    "checksum",
]
