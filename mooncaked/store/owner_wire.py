"""The frames of a read by key from a DRAM segment's owner (owner_server.py, owner_link.py).

A request names the key, the size and the checksum the reader expects; the owner answers in
request order with a status and, when it serves, exactly `size` bytes of the object. No other
message exists: the owner serves committed objects and nothing else.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

REQUEST = struct.Struct("<HQQQ")  # key length, request id, size, checksum; then the key (utf-8)
REPLY = struct.Struct("<QBQ")  # request id, status, size; then `size` bytes when the status is SERVED
MAX_KEY_BYTES = 4096
MAX_OBJECT_BYTES = 1 << 40

SERVED = 0
NOT_HELD = 1  # no committed copy of that key with that size and checksum here (removed, moved, re-put)
WINDOW_CLOSED = 2  # this owner has not heard from the master recently enough to vouch for anything
STATUS_NAMES = {SERVED: "served", NOT_HELD: "not_held", WINDOW_CLOSED: "window_closed"}


class WireError(ValueError):
    """A frame that breaks the format: the connection is closed."""


@dataclass(frozen=True, slots=True)
class KeyRequest:
    req_id: int
    key: str
    size: int
    checksum: int


def pack_request(r: KeyRequest) -> bytes:
    key = r.key.encode()
    if len(key) > MAX_KEY_BYTES:
        raise WireError(f"key of {len(key)} bytes is over the {MAX_KEY_BYTES}-byte limit")
    return REQUEST.pack(len(key), r.req_id, r.size, r.checksum) + key


def request_bytes(r: KeyRequest) -> int:
    """How many bytes the request took on the wire."""
    return REQUEST.size + len(r.key.encode())


def read_requests(buf: bytes | bytearray | memoryview, limit: int = 1 << 62) -> tuple[list[KeyRequest], int]:
    """The whole requests at the start of `buf` (`limit` at most), and how many bytes they took."""
    out: list[KeyRequest] = []
    pos, n = 0, len(buf)
    while n - pos >= REQUEST.size and len(out) < limit:
        klen, req_id, size, csum = REQUEST.unpack_from(buf, pos)
        if klen == 0 or klen > MAX_KEY_BYTES or size == 0 or size > MAX_OBJECT_BYTES:
            raise WireError(f"bad request header (key {klen} bytes, size {size})")
        end = pos + REQUEST.size + klen
        if end > n:
            break
        try:
            key = bytes(buf[pos + REQUEST.size:end]).decode()
        except UnicodeDecodeError:
            raise WireError("a key that is not utf-8") from None
        out.append(KeyRequest(req_id, key, size, csum))
        pos = end
    return out, pos
