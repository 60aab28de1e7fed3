"""Messages between an engine and its transfer I/O process (io_transport.py, io_worker.py).

A private Unix socketpair, inherited by the child and nobody else, carries length-prefixed pickled
tuples: one frame per batch (not per op), so the engine's thread pays one small write and one
small read per batch while the I/O process moves the bytes. Frames are bounded (MAX_FRAME_BYTES);
a bigger batch is cut into several submits. Errors cross as (type name, message) and are rebuilt
as the same TransferError subclass, so callers catch what they catch on the in-process path.

engine -> I/O process:  ("config", dict) once, then ("map", region, shm_name, nbytes),
                         ("unmap", region), ("submit", batch_id, peer, timeout_s, ops),
                         ("cancel", batch_id)
I/O process -> engine:  ("ready", pid), ("done", batch_id, [None | (error type, message), ...])
An op is (is_write, local_region, local_offset, remote_region, remote_offset, length).
"""

from __future__ import annotations

import asyncio
import logging
import pickle
import socket
import struct
from typing import Any

from mooncaked.transfer import api
from mooncaked.transfer.handshake import HandshakeError

logger = logging.getLogger(__name__)

LENGTH = struct.Struct("<I")
MAX_FRAME_BYTES = 64 * 1024 * 1024
MAX_OPS_PER_SUBMIT = 16384
"""Ops per submit frame (~1.5 MB pickled): a bigger batch goes as several."""
WireError = tuple[str, str]
_ERRORS: dict[str, type[api.TransferError]] = {
    cls.__name__: cls
    for cls in (api.TransferError, api.UnknownRegionError, api.OutOfBoundsError, api.PeerUnavailableError,
                api.TransferTimeoutError, api.ProtocolError, api.BackendUnavailableError, HandshakeError)
}


def frame(message: tuple[Any, ...]) -> bytes:
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    if len(body) > MAX_FRAME_BYTES:
        raise api.TransferError(f"I/O process message of {len(body)} bytes exceeds {MAX_FRAME_BYTES}")
    return LENGTH.pack(len(body)) + body


async def read_frame(reader: asyncio.StreamReader) -> tuple[Any, ...] | None:
    """The next message, or None at end of stream; ProtocolError for an oversized frame."""
    try:
        head = await reader.readexactly(LENGTH.size)
    except asyncio.IncompleteReadError:
        return None
    (size,) = LENGTH.unpack(head)
    if size > MAX_FRAME_BYTES:
        raise api.ProtocolError(f"I/O process frame of {size} bytes exceeds {MAX_FRAME_BYTES}")
    try:
        body = await reader.readexactly(size)
    except asyncio.IncompleteReadError:
        return None
    return pickle.loads(body)  # noqa: S301 - a private socketpair between an engine and its own child


def recv_frame(sock: socket.socket) -> tuple[Any, ...] | None:
    """read_frame on a blocking socket (the I/O process's side)."""
    head = _recv_exactly(sock, LENGTH.size)
    if head is None:
        return None
    (size,) = LENGTH.unpack(head)
    if size > MAX_FRAME_BYTES:
        raise api.ProtocolError(f"engine frame of {size} bytes exceeds {MAX_FRAME_BYTES}")
    body = _recv_exactly(sock, size)
    return None if body is None else pickle.loads(body)  # noqa: S301 - our parent, on a private socketpair


def _recv_exactly(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            return None
        got += k
    return bytes(buf)


def encode_error(error: BaseException | None) -> WireError | None:
    if error is None:
        return None
    name = type(error).__name__ if type(error).__name__ in _ERRORS else "TransferError"
    return name, str(error)


def decode_error(wire: WireError | None) -> api.TransferError | None:
    if wire is None:
        return None
    name, message = wire
    return _ERRORS.get(name, api.TransferError)(message)
