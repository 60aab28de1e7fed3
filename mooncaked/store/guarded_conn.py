"""One incoming connection of a store server on a plain socket (the master's fast path, an owner's
reads by key), guarded as the transfer ports are: a cap, the cluster-secret handshake first when
a secret is set, and a timer for the handshake, idle time and half-received requests
(mooncaked.transfer.conn_guard, mooncaked.transfer.handshake).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Protocol

from mooncaked.transfer.conn_guard import ConnLimits, ConnWatch, admit
from mooncaked.transfer.handshake import ANSWER_BYTES, HandshakeError, ServerHandshake

logger = logging.getLogger(__name__)


class GuardedServer(Protocol):
    """What a guarded connection needs of its server."""

    token: bytes | None
    limits: ConnLimits
    connections: set
    unproven: int


class GuardedConnection(asyncio.Protocol):
    """The admission, handshake and timer of one connection; subclasses parse what is in `_buf`."""

    what = "store"  # how the logs name this kind of connection

    def __init__(self, server: GuardedServer) -> None:
        self._server = server
        self._buf = bytearray()
        self._transport: asyncio.Transport | None = None
        self._peer = "?"
        self._handshake: ServerHandshake | None = None  # while the peer has not proven the secret
        self._watch: ConnWatch | None = None
        self._closed = False

    def _progress(self) -> int:
        """Requests taken so far (the timer's measure of progress)."""
        raise NotImplementedError

    def _partial(self) -> bool:
        """Whether a request is half received."""
        return bool(self._buf)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family != socket.AF_UNIX:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        peer = transport.get_extra_info("peername")
        self._peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) and peer else "a local client (unix socket)"
        server = self._server
        refused = admit(server.limits, len(server.connections), server.unproven, server.token is not None)
        if refused is not None:
            logger.warning("refused %s connection from %s: %s", self.what, self._peer, refused)
            self._closed = True
            transport.abort()  # type: ignore[attr-defined]
            return
        server.connections.add(self)
        if server.token is not None:
            self._handshake = ServerHandshake(server.token)
            server.unproven += 1
            transport.write(self._handshake.challenge)  # type: ignore[attr-defined]
        self._watch = ConnWatch(server.limits, server.token is None, self._progress, self._partial, self._drop)

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        self._server.connections.discard(self)
        if self._handshake is not None:
            self._handshake = None
            self._server.unproven -= 1
        if self._watch is not None:
            self._watch.cancel()

    def _prove(self) -> bool:
        """The handshake answer is the first ANSWER_BYTES of the buffer: True once proven."""
        assert self._handshake is not None and self._transport is not None and self._watch is not None
        try:
            proof = self._handshake.verify(self._buf[:ANSWER_BYTES])
        except HandshakeError as e:
            logger.warning("refused %s connection from %s: %s", self.what, self._peer, e)
            self.abort()
            return False
        del self._buf[:ANSWER_BYTES]
        self._handshake = None
        self._server.unproven -= 1
        self._watch.proven = True
        self._transport.write(proof)
        return True

    def _drop(self, why: str) -> None:
        """The timer's verdict: close now, whatever is buffered or queued."""
        if not self._closed:
            logger.warning("closing %s connection from %s: %s", self.what, self._peer, why)
            self.abort()

    def close(self) -> None:
        self._closed = True
        self._buf = bytearray()
        if self._transport is not None:
            self._transport.close()

    def abort(self) -> None:
        self._closed = True
        self._buf = bytearray()
        if self._transport is not None:
            self._transport.abort()
