"""Proving the cluster secret on a data-plane connection, both ways, before any other byte moves.

The transfer ports and the store master's fast path are raw sockets, so gRPC's metadata
cannot carry the secret there; instead each connection opens with a mutual challenge:

    server -> client  AUTH_MAGIC | server_nonce                     (8 + 32 bytes)
    client -> server  client_nonce | HMAC(secret, "mooncaked-client" | server_nonce | client_nonce)
    server -> client  HMAC(secret, "mooncaked-server" | client_nonce | server_nonce)

HMAC-SHA256 over fresh random nonces: the secret never crosses the wire, an answer recorded
on one connection is worthless on the next, and each side learns the other knows the secret
(the client will not send a request to a server that cannot prove it). Digests are compared in
constant time. A server that fails a client closes the connection without a word (logged).
AUTH_MAGIC lets a client without the secret say what is wrong instead of "bad header".

Servers run `ServerHandshake` inside their protocol (no I/O here, so the hot path keeps its
own buffers); clients run `client_handshake` on the raw socket before handing it to their
protocol. Without a configured secret no handshake happens at all.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import os
import socket

from mooncaked.transfer.api import PeerUnavailableError, TransferError

logger = logging.getLogger(__name__)

AUTH_MAGIC = b"MCKDAUTH"
NONCE_BYTES = 32
MAC_BYTES = 32  # SHA-256
CHALLENGE_BYTES = len(AUTH_MAGIC) + NONCE_BYTES
ANSWER_BYTES = NONCE_BYTES + MAC_BYTES
PROOF_BYTES = MAC_BYTES
HANDSHAKE_TIMEOUT_S = 5.0
"""A peer that has not finished the handshake by then is dropped (both ends)."""
_CLIENT = b"mooncaked-client"
_SERVER = b"mooncaked-server"


class HandshakeError(PeerUnavailableError):
    """The peer did not prove the cluster secret (or did not speak the handshake): unusable to us."""


def check_token(token: bytes | None) -> bytes | None:
    """The secret as given, or None; an empty one is a configuration mistake, not "no secret"."""
    if token is not None and not token:
        raise TransferError("the cluster secret is empty; give none or a real one")
    return token


def client_mac(token: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return hmac.new(token, _CLIENT + server_nonce + client_nonce, hashlib.sha256).digest()


def server_mac(token: bytes, client_nonce: bytes, server_nonce: bytes) -> bytes:
    return hmac.new(token, _SERVER + client_nonce + server_nonce, hashlib.sha256).digest()


class ServerHandshake:
    """The server's side of one connection: send `challenge`, then `verify` the client's answer."""

    __slots__ = ("_token", "_nonce", "challenge")

    def __init__(self, token: bytes) -> None:
        self._token = token
        self._nonce = os.urandom(NONCE_BYTES)
        self.challenge = AUTH_MAGIC + self._nonce

    def verify(self, answer: bytes | bytearray | memoryview) -> bytes:
        """The proof to send back if `answer` (ANSWER_BYTES) proves the secret; HandshakeError if not."""
        answer = bytes(answer)
        if len(answer) != ANSWER_BYTES:
            raise HandshakeError(f"handshake answer of {len(answer)} bytes, expected {ANSWER_BYTES}")
        client_nonce, mac = answer[:NONCE_BYTES], answer[NONCE_BYTES:]
        if not hmac.compare_digest(mac, client_mac(self._token, self._nonce, client_nonce)):
            raise HandshakeError("the client did not prove the cluster secret (wrong secret, or none)")
        return server_mac(self._token, client_nonce, self._nonce)


async def _recv_exactly(sock: socket.socket, n: int, what: str) -> bytes:
    loop = asyncio.get_running_loop()
    buf = bytearray()
    while len(buf) < n:
        chunk = await loop.sock_recv(sock, n - len(buf))
        if not chunk:
            raise HandshakeError(what)
        buf += chunk
    return bytes(buf)


class ClientHandshake:
    """The client's side, without I/O: `answer` the server's challenge, then `check` its proof.
    Driven by client_handshake (asyncio) and blocking_client_handshake (a blocking socket)."""

    __slots__ = ("_token", "_peer", "_client_nonce", "_server_nonce")

    def __init__(self, token: bytes, peer: str) -> None:
        self._token = token
        self._peer = peer
        self._client_nonce = os.urandom(NONCE_BYTES)
        self._server_nonce = b""

    def answer(self, challenge: bytes) -> bytes:
        if challenge[: len(AUTH_MAGIC)] != AUTH_MAGIC:
            raise HandshakeError(f"{self._peer} did not open with the cluster-secret handshake "
                                 "(it runs without a cluster secret, or is not a mooncaked data-plane port)")
        self._server_nonce = challenge[len(AUTH_MAGIC):]
        return self._client_nonce + client_mac(self._token, self._server_nonce, self._client_nonce)

    def check(self, proof: bytes) -> None:
        if not hmac.compare_digest(proof, server_mac(self._token, self._client_nonce, self._server_nonce)):
            raise HandshakeError(f"{self._peer} could not prove the cluster secret: it is not one of ours")


async def client_handshake(sock: socket.socket, token: bytes, peer: str) -> None:
    """Prove the secret to the server on `sock` (non-blocking, connected) and check its proof.

    The caller bounds it with a timeout and closes the socket on any error.
    """
    loop = asyncio.get_running_loop()
    client = ClientHandshake(token, peer)
    challenge = await _recv_exactly(sock, CHALLENGE_BYTES, f"{peer} closed the connection before its handshake")
    await loop.sock_sendall(sock, client.answer(challenge))
    client.check(await _recv_exactly(sock, PROOF_BYTES, f"{peer} refused our cluster secret (the secrets differ)"))


def blocking_client_handshake(sock: socket.socket, token: bytes, peer: str) -> None:
    """client_handshake on a blocking socket; the caller sets its timeout and closes it on error."""
    client = ClientHandshake(token, peer)
    sock.sendall(client.answer(_recv_exactly_blocking(sock, CHALLENGE_BYTES,
                                                      f"{peer} closed the connection before its handshake")))
    client.check(_recv_exactly_blocking(sock, PROOF_BYTES, f"{peer} refused our cluster secret (the secrets differ)"))


def _recv_exactly_blocking(sock: socket.socket, n: int, what: str) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise HandshakeError(what)
        buf += chunk
    return bytes(buf)


async def open_socket(host: str, port: int) -> socket.socket:
    """A connected non-blocking TCP socket to host:port (every address tried, like create_connection)."""
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    error: OSError = OSError(f"no address for {host}")
    for family, kind, proto, _, address in infos:
        sock = socket.socket(family, kind, proto)
        sock.setblocking(False)
        try:
            await loop.sock_connect(sock, address)
        except OSError as e:
            sock.close()
            error = e
            continue
        except BaseException:
            sock.close()
            raise
        if family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock
    raise error


async def authenticated(sock: socket.socket, token: bytes, peer: str, timeout_s: float) -> socket.socket:
    """`sock` once the handshake succeeded within timeout_s; closed (and HandshakeError) otherwise."""
    try:
        async with asyncio.timeout(timeout_s):
            await client_handshake(sock, token, peer)
    except TimeoutError:
        sock.close()
        raise HandshakeError(f"{peer} did not complete the cluster-secret handshake within {timeout_s}s "
                             "(does it run without a cluster secret?)") from None
    except BaseException:
        sock.close()
        raise
    return sock
