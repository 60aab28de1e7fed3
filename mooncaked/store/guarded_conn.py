"""One incoming connection of a store server on a plain socket (the master's fast path, an owner's
reads by key), guarded as the transfer ports are: a cap, the cluster-secret handshake first when
a secret is set, and a timer for the handshake, idle time and half-received requests
(mooncaked.transfer.conn_guard, mooncaked.transfer.handshake).

And one peer cannot take the server over by the requests it sends:
- Answers the peer does not read hold up its requests. Once its answers queued in the process pass
  the write buffer's high mark (`write_high`), the connection stops reading (and answering what it
  already sent) until they drain: a peer that sends and never reads stalls only itself, and then
  its timer drops it; it cannot grow the server's memory.
- Requests answered in one turn of the event loop are capped (MAX_PER_TURN): what is left waits for
  the next turn, behind the other connections and timers (the pings that keep owners alive), with
  reading paused meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Protocol

from mooncaked.transfer import conn_guard
from mooncaked.transfer.conn_guard import ConnLimits, ConnWatch, admit
from mooncaked.transfer.handshake import ANSWER_BYTES, HandshakeError, ServerHandshake

logger = logging.getLogger(__name__)

MAX_PER_TURN = 64  # requests one connection has answered in a turn of the event loop at most
WRITE_HIGH = 1 << 20  # answers queued (bytes) above which a connection stops taking requests


class GuardedServer(Protocol):
    """What a guarded connection needs of its server."""

    token: bytes | None
    limits: ConnLimits
    connections: set
    unproven: int


class GuardedConnection(asyncio.Protocol):
    """The admission, handshake and timer of one connection; subclasses parse what is in `_buf`."""

    what = "store"  # how the logs name this kind of connection
    write_high = WRITE_HIGH

    def __init__(self, server: GuardedServer) -> None:
        self._server = server
        self._buf = bytearray()
        self._transport: asyncio.Transport | None = None
        self._peer = "?"
        self._handshake: ServerHandshake | None = None  # while the peer has not proven the secret
        self._watch: ConnWatch | None = None
        self._closed = False  # by us (close, abort) or the peer
        self._lost = False  # connection_lost came: nothing of it is left
        self._holds: set[str] = set()  # why requests are not taken now ("answers", "turn", ...): reading paused

    def _serve(self, buf: bytes | bytearray) -> tuple[int, bool]:
        """Answer the whole requests at the start of `buf`, at most MAX_PER_TURN, stopping as soon as
        a hold is set (an answer filled the write buffer). Returns how many bytes the answered ones
        took and whether whole requests may be left. Raises `bad_input` on garbage. A subclass's own."""
        raise NotImplementedError

    bad_input: tuple[type[Exception], ...] = ()  # what _serve raises on bytes that break the format

    def _take(self, data: bytes) -> None:
        """Serve what arrived: straight from `data` when nothing is buffered (the usual case: no
        copy), else from the buffer; whole requests left over are served on a later turn."""
        if self._holds:
            self._buf += data
            return
        try:
            if self._buf:
                self._buf += data
                used, more = self._serve(self._buf)
                del self._buf[:used]
            else:
                used, more = self._serve(data)
                if used < len(data):
                    self._buf += data[used:]
        except self.bad_input as e:
            self._broken(e)
            return
        if more and not self._closed:
            self._later()

    def _broken(self, e: Exception) -> None:
        logger.warning("closing %s connection from %s: %s", self.what, self._peer, e)
        self.abort()

    def _later(self) -> None:
        """Serve the rest on the loop's next turn, after everyone else; read nothing meanwhile."""
        if "turn" not in self._holds:
            self._hold("turn")
            asyncio.get_running_loop().call_soon(self._release, "turn")

    def _hold(self, why: str) -> None:
        if not self._holds and self._open():
            self._transport.pause_reading()  # type: ignore[union-attr]
        self._holds.add(why)

    def _release(self, why: str) -> None:
        if why not in self._holds:
            return
        self._holds.discard(why)
        if self._holds or not self._open():
            return
        self._transport.resume_reading()  # type: ignore[union-attr]
        if self._buf:
            self._take(b"")

    def _open(self) -> bool:
        return not self._closed and self._transport is not None and not self._transport.is_closing()

    def pause_writing(self) -> None:
        self._hold("answers")  # the peer reads its answers slower than it asks: wait for it

    def resume_writing(self) -> None:
        self._release("answers")

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
        transport.set_write_buffer_limits(high=self.write_high)  # type: ignore[attr-defined]
        server.connections.add(self)
        if server.token is not None:
            self._handshake = ServerHandshake(server.token)
            server.unproven += 1
            transport.write(self._handshake.challenge)  # type: ignore[attr-defined]
        self._watch = ConnWatch(server.limits, server.token is None, self._progress, self._partial, self._drop)

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = self._lost = True
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
        """The timer's verdict: close now, whatever is buffered or queued (closed already too: a peer
        that does not take the answers owed must not keep the connection)."""
        if not self._lost:
            logger.warning("closing %s connection from %s: %s", self.what, self._peer, why)
            self.abort()

    def close(self) -> None:
        """Close once the answers owed are sent (within conn_guard.CLOSE_FLUSH_S, else cut off)."""
        self._closed = True
        self._buf = bytearray()
        if self._transport is not None:
            conn_guard.close_within(self._transport, lambda: self._drop("answers owed not taken after its close"))

    def abort(self) -> None:
        self._closed = True
        self._buf = bytearray()
        if self._transport is not None:
            self._transport.abort()
