"""Plain data and errors of the data plane: what callers pass in and catch.

Everything here is backend-neutral; the backends and the engine speak these
types so that a caller never imports a backend module.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Literal

logger = logging.getLogger(__name__)

OpKind = Literal["write", "read"]
Backend = Literal["tcp", "shm", "auto", "rdma", "mooncake-tcp"]
BACKENDS: tuple[str, ...] = ("tcp", "shm", "auto", "rdma", "mooncake-tcp")
"""mooncake-tcp: the rdma adapter over Mooncake's own TCP transport, so the
adapter can be exercised where no RDMA NIC exists (CI)."""
MOONCAKE_BACKENDS: tuple[str, ...] = ("rdma", "mooncake-tcp")

DEFAULT_TIMEOUT_S = 30.0
"""Deadline of one op, counted from when its request starts to go out."""
DEFAULT_CONNECT_TIMEOUT_S = 5.0
MAX_REGION_NAME_BYTES = 64
"""Region names travel in a fixed header field, so one recv reads a whole request head."""


@dataclass(frozen=True, slots=True)
class TransferOp:
    """One contiguous byte range moved between a local and a remote region.

    write: local[local_offset:+length] -> peer's remote[remote_offset:+length].
    read:  peer's remote[remote_offset:+length] -> local[local_offset:+length].
    """

    op: OpKind
    local_region: str
    local_offset: int
    peer: str
    remote_region: str
    remote_offset: int
    length: int


@dataclass(frozen=True, slots=True)
class RegionInfo:
    """What a peer needs to address a region: name and size; for shared
    memory the segment name (peers on the host map it); the base address is
    for one-sided RDMA, where the peer names raw addresses."""

    name: str
    nbytes: int
    shm_name: str | None = None
    address: int = 0


@dataclass(frozen=True, slots=True)
class PeerInfo:
    """A peer's answer to the control query: who it is and what it serves."""

    host_id: str
    regions: dict[str, RegionInfo] = field(default_factory=dict)
    rdma_session: str | None = None


@dataclass(frozen=True, slots=True)
class EngineStats:
    """Counters a test or an operator reads to see how traffic was spread."""

    incoming_connections: int
    ops_per_incoming_connection: list[int]
    outgoing_connections: dict[str, int]
    io_process_pid: int | None = None
    """The transfer I/O process serving this engine's tcp ops, while one runs (io_process=True)."""


class TransferError(Exception):
    """Base of every data-plane failure; the message says what to do."""


class UnknownRegionError(TransferError):
    """A region name is not registered (locally or on the peer)."""


class OutOfBoundsError(TransferError):
    """offset + length runs past the end of a region."""


class PeerUnavailableError(TransferError):
    """The peer cannot be reached or its connection broke."""


class TransferTimeoutError(PeerUnavailableError):
    """The peer did not complete an op before its deadline."""


class ProtocolError(TransferError):
    """Bytes on a connection do not follow the wire format."""


class BackendUnavailableError(TransferError):
    """The chosen backend cannot work here (missing package or device)."""


def parse_address(address: str) -> tuple[str, int]:
    """Split "host:port" (or "[v6]:port") into its parts."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise TransferError(f"bad transfer address {address!r}: expected 'host:port'")
    return host.strip("[]"), int(port)


def check_bounds(where: str, region: str, nbytes: int, offset: int, length: int) -> None:
    """Raise OutOfBoundsError naming the region unless [offset, offset+length) fits."""
    if offset < 0 or length < 0 or offset + length > nbytes:
        raise OutOfBoundsError(
            f"{where} region {region!r}: range [{offset}, {offset + length}) "
            f"is outside its {nbytes} bytes"
        )
