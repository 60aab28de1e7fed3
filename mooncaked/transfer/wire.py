"""The tcp backend's wire format: fixed little-endian headers, raw payloads.

Request:  REQ header (region name in a fixed 64-byte field) | payload (write only)
Response: RESP header | body (read data, info JSON, or an error message)

Requests on one connection are answered in order, so a client can pipeline
many ops per connection and match responses FIFO (req_id double-checks).
"""

from __future__ import annotations

import enum
import json
import logging
import struct
from dataclasses import asdict, dataclass

from mooncaked.transfer.api import (
    MAX_REGION_NAME_BYTES,
    OutOfBoundsError,
    PeerInfo,
    ProtocolError,
    RegionInfo,
    TransferError,
    UnknownRegionError,
)
from mooncaked.transfer.handshake import AUTH_MAGIC

logger = logging.getLogger(__name__)

MAGIC = 0x444B434D  # b"MCKD" little-endian
VERSION = 1
MAX_OP_BYTES = 1 << 40  # a length above this is garbage, not a request
MAX_ERROR_BYTES = 64 * 1024
MAX_INFO_BYTES = 16 * 1024 * 1024

# magic, version, op, name_len, req_id, offset, length, name (zero-padded)
REQ = struct.Struct(f"<IBBHQQQ{MAX_REGION_NAME_BYTES}s")
RESP = struct.Struct("<IBBHQQ")  # magic, version, status, reserved, req_id, body_len


class Op(enum.IntEnum):
    WRITE = 1
    READ = 2
    INFO = 3


class Status(enum.IntEnum):
    OK = 0
    UNKNOWN_REGION = 1
    OUT_OF_BOUNDS = 2
    BAD_REQUEST = 3


_OPS: dict[int, Op] = {o.value: o for o in Op}
_STATUSES: dict[int, Status] = {s.value: s for s in Status}
"""Wire value -> member: a dict lookup costs a fraction of calling the enum."""


@dataclass(slots=True)  # not frozen: a frozen dataclass costs ~1 us more to build, once per request
class Request:
    op: Op
    name: bytes
    req_id: int
    offset: int
    length: int


def pack_request(op: Op, req_id: int, name: bytes, offset: int, length: int) -> bytes:
    return REQ.pack(MAGIC, VERSION, op, len(name), req_id, offset, length, name)


def unpack_request(header: bytes | bytearray | memoryview) -> Request:
    """Parse a request header; ProtocolError (says why) for anything not ours."""
    magic, version, op, name_len, req_id, offset, length, name = REQ.unpack(header)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic 0x{magic:08x}")
    if version != VERSION:
        raise ProtocolError(f"unsupported version {version} (speak {VERSION})")
    kind = _OPS.get(op)
    if kind is None:
        raise ProtocolError(f"unknown op {op}")
    if name_len > MAX_REGION_NAME_BYTES or (op != Op.INFO and name_len == 0):
        raise ProtocolError(f"bad region name length {name_len}")
    if length > MAX_OP_BYTES or offset > MAX_OP_BYTES:
        raise ProtocolError(f"absurd range offset={offset} length={length}")
    return Request(kind, name[:name_len], req_id, offset, length)


def pack_response(status: Status, req_id: int, body_len: int) -> bytes:
    return RESP.pack(MAGIC, VERSION, status, 0, req_id, body_len)


def unpack_response(header: bytes | bytearray | memoryview) -> tuple[Status, int, int]:
    magic, version, status, _, req_id, body_len = RESP.unpack(header)
    if version != VERSION and bytes(header[: len(AUTH_MAGIC)]) == AUTH_MAGIC:
        raise ProtocolError("the peer requires the cluster secret (it opened with the handshake): "
                            "give this engine the same cluster token file as the peer")
    if magic != MAGIC or version != VERSION:
        raise ProtocolError(f"bad response header (magic 0x{magic:08x}, version {version})")
    member = _STATUSES.get(status)
    if member is None:
        raise ProtocolError(f"unknown response status {status}")
    return member, req_id, body_len


def error_status(exc: TransferError) -> Status:
    if isinstance(exc, UnknownRegionError):
        return Status.UNKNOWN_REGION
    if isinstance(exc, OutOfBoundsError):
        return Status.OUT_OF_BOUNDS
    return Status.BAD_REQUEST


def error_from_status(status: Status, message: str, peer: str) -> TransferError:
    """Rebuild the typed error the peer raised, naming the peer."""
    text = f"peer {peer}: {message}"
    if status == Status.UNKNOWN_REGION:
        return UnknownRegionError(text)
    if status == Status.OUT_OF_BOUNDS:
        return OutOfBoundsError(text)
    return TransferError(text)


def encode_info(info: PeerInfo) -> bytes:
    return json.dumps(
        {
            "host_id": info.host_id,
            "rdma_session": info.rdma_session,
            "regions": [asdict(r) for r in info.regions.values()],
        }
    ).encode()


def decode_info(body: bytes) -> PeerInfo:
    try:
        raw = json.loads(body)
        regions = {r["name"]: RegionInfo(**r) for r in raw["regions"]}
        return PeerInfo(raw["host_id"], regions, raw.get("rdma_session"))
    except (ValueError, KeyError, TypeError) as e:
        raise ProtocolError(f"malformed peer info: {e}") from e
