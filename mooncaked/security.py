"""Who may talk to a mooncaked process: mutual TLS on gRPC, the cluster secret, the API key.

Three layers, each optional, all read from the settings once at start (`Security.load`):

- mutual TLS (`--tls-cert/--tls-key/--tls-ca`): every gRPC server requires a client
  certificate signed by the CA and every channel presents ours, so a peer without one gets
  no byte of any method; the conductor's HTTP front serves HTTPS from the same files.
- the cluster secret (`--cluster-token-file`): every call that changes or reveals the
  cluster's state (registration, heartbeats, engine and store-master calls) carries it as
  `x-mooncaked-token` metadata; `ServerAuth` compares it in constant time. Clients' channels
  attach it themselves (`Security.channel`). The data plane proves the same secret with its
  own handshake (it takes `Security.token` as bytes; it never crosses the wire there).
- the API key (`--api-key`): the client-facing `Generate` checks `authorization: Bearer`.

With neither TLS nor a secret a process may listen on loopback only, unless `--insecure`
(`check_exposure`): an open port on a network is an open cluster.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import os
import socket
import ssl
import stat
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from mooncaked.startup import StartupError

log = logging.getLogger(__name__)

TOKEN_METADATA = "x-mooncaked-token"
TOKEN_HEADER = "X-Mooncaked-Token"  # the same secret on the HTTP front's KV-indexer writes
MIN_TOKEN_CHARS = 16
# methods anyone who reached the port (with a certificate, under TLS) may call: the
# client-facing Generate (it checks the API key itself, below) and read-only health. Not Status:
# it lists every instance's, conductor's and store master's address (operators' screen, with the secret)
OPEN_METHODS = frozenset({
    "/mooncake.v1.Conductor/Generate",
    "/grpc.health.v1.Health/Check",
    "/grpc.health.v1.Health/Watch",
    "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
    "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
})
API_KEY_METHODS = frozenset({"/mooncake.v1.Conductor/Generate"})


def _read_secret_file(path: str, what: str, flag: str) -> bytes:
    """A file only its owner (and group) may read: a world-readable secret is no secret."""
    try:
        mode = os.stat(path).st_mode
        data = Path(path).read_bytes()
    except OSError as e:
        raise StartupError(f"{flag} {path}: cannot read the {what}: {e.strerror or e}") from None
    if mode & stat.S_IROTH:
        raise StartupError(f"{flag} {path}: the {what} is world-readable; run `chmod 0640 {path}` "
                           "(owner and the mooncaked group only)")
    return data


def _read_file(path: str, what: str, flag: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise StartupError(f"{flag} {path}: cannot read the {what}: {e.strerror or e}") from None


def read_token(path: str, flag: str = "--cluster-token-file") -> bytes:
    """The cluster secret from its file, stripped; printable ASCII (it travels as gRPC metadata)."""
    token = _read_secret_file(path, "cluster token", flag).strip()
    if len(token) < MIN_TOKEN_CHARS:
        raise StartupError(f"{flag} {path}: the cluster token is shorter than {MIN_TOKEN_CHARS} characters; "
                           f"make one with `openssl rand -hex 32 > {path}`")
    if not all(0x21 <= b <= 0x7E for b in token):
        raise StartupError(f"{flag} {path}: the cluster token must be printable ASCII without spaces; "
                           f"make one with `openssl rand -hex 32 > {path}`")
    return token


@dataclass(frozen=True)
class Security:
    """The credentials this process uses as a server and as a client (all None: plaintext, open)."""

    cert: bytes | None = None
    key: bytes | None = field(default=None, repr=False)
    ca: bytes | None = None
    token: bytes | None = field(default=None, repr=False)
    cert_file: str | None = None  # the HTTP front's ssl context loads files
    key_file: str | None = None
    ca_file: str | None = None

    @classmethod
    def load(cls, tls_cert: str | None = None, tls_key: str | None = None, tls_ca: str | None = None,
             cluster_token_file: str | None = None) -> Security:
        """Read the files once; a problem is a `StartupError` naming the flag and the fix."""
        cert = key = ca = None
        if tls_cert or tls_key or tls_ca:
            if not (tls_cert and tls_key and tls_ca):
                raise StartupError("mutual TLS needs --tls-cert, --tls-key and --tls-ca together")
            cert = _read_file(tls_cert, "certificate", "--tls-cert")
            key = _read_secret_file(tls_key, "private key", "--tls-key")
            ca = _read_file(tls_ca, "CA certificate", "--tls-ca")
            for data, flag, path in ((cert, "--tls-cert", tls_cert), (ca, "--tls-ca", tls_ca)):
                if b"-----BEGIN CERTIFICATE-----" not in data:
                    raise StartupError(f"{flag} {path}: not a PEM certificate")
            if b"PRIVATE KEY-----" not in key:
                raise StartupError(f"--tls-key {tls_key}: not a PEM private key")
            try:  # a key that does not match the certificate fails here, not at the first handshake
                ssl.create_default_context().load_cert_chain(tls_cert, tls_key)
            except ssl.SSLError as e:
                raise StartupError(f"--tls-key {tls_key} does not fit --tls-cert {tls_cert}: {e.reason or e}") \
                    from None
        token = read_token(cluster_token_file) if cluster_token_file else None
        return cls(cert, key, ca, token, tls_cert, tls_key, tls_ca)

    @classmethod
    def from_config(cls, cfg: Any) -> Security:
        """From a role's config (`mooncaked.config.RoleConfig`) or anything with the same four settings."""
        return cls.load(getattr(cfg, "tls_cert", None), getattr(cfg, "tls_key", None),
                        getattr(cfg, "tls_ca", None), getattr(cfg, "cluster_token_file", None))

    @property
    def tls(self) -> bool:
        return self.cert is not None

    @property
    def secured(self) -> bool:
        """Whether a peer must prove anything at all (TLS or the token)."""
        return self.tls or self.token is not None

    @property
    def mode(self) -> str:
        """What the start line says."""
        if self.tls and self.token:
            return "mTLS + cluster token"
        if self.tls:
            return "mTLS (no cluster token)"
        if self.token:
            return "cluster token, no TLS (traffic in clear)"
        return "insecure (no TLS, no cluster token)"

    # -- gRPC -----------------------------------------------------------------------------------
    def server_credentials(self) -> grpc.ServerCredentials | None:
        """Mutual TLS: our certificate, and a client certificate signed by the CA required; None: plaintext."""
        if not self.tls:
            return None
        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca,
                                           require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        if not self.tls:
            return None
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                            certificate_chain=self.cert)

    def token_metadata(self) -> tuple[tuple[str, str], ...]:
        """The metadata that proves the cluster secret (empty without one)."""
        return ((TOKEN_METADATA, self.token.decode()),) if self.token else ()

    def channel(self, address: str, options: Sequence[tuple[str, Any]] = ()) -> grpc.aio.Channel:
        """A grpc.aio channel to a peer: TLS with our certificate when configured, the token on every call."""
        # grpc.aio files an interceptor under one kind of call only: one object per kind
        interceptors = [kind(self.token_metadata()) for kind in _TOKEN_INTERCEPTORS] if self.token else None
        creds = self.channel_credentials()
        if creds is None:
            return grpc.aio.insecure_channel(address, options=list(options), interceptors=interceptors)
        return grpc.aio.secure_channel(address, creds, options=list(options), interceptors=interceptors)

    def sync_channel(self, address: str, options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
        """The same for blocking clients (mooncakectl, tools)."""
        creds = self.channel_credentials()
        channel = (grpc.insecure_channel(address, options=list(options)) if creds is None
                   else grpc.secure_channel(address, creds, options=list(options)))
        if self.token:
            channel = grpc.intercept_channel(channel, _SyncTokenInterceptor(self.token_metadata()))
        return channel

    def server_interceptors(self, api_key: str | None = None) -> list[grpc.aio.ServerInterceptor]:
        if self.token is None and api_key is None:
            return []
        return [ServerAuth(self.token, api_key)]

    # -- HTTP -----------------------------------------------------------------------------------
    def http_ssl_context(self) -> ssl.SSLContext | None:
        """The conductor's HTTPS context (server certificate only: HTTP clients prove the API key)."""
        if not self.tls:
            return None
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(self.cert_file, self.key_file)
        return ctx

    def token_ok(self, presented: str | bytes | None) -> bool:
        """Constant-time: is `presented` the cluster secret (always True without one)?"""
        if self.token is None:
            return True
        if presented is None:
            return False
        given = presented.encode() if isinstance(presented, str) else presented
        return hmac.compare_digest(given, self.token)


# -- the client side: the token on every call ----------------------------------------------------

def _with_metadata(details: grpc.aio.ClientCallDetails, extra: tuple[tuple[str, str], ...]):
    metadata = grpc.aio.Metadata(*(details.metadata or ()), *extra)
    return grpc.aio.ClientCallDetails(details.method, details.timeout, metadata, details.credentials,
                                      details.wait_for_ready)


class _Token:
    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self.metadata = metadata


class _UnaryUnaryToken(_Token, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(_with_metadata(details, self.metadata), request)


class _UnaryStreamToken(_Token, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(_with_metadata(details, self.metadata), request)


class _StreamUnaryToken(_Token, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, details, request_iterator):
        return await continuation(_with_metadata(details, self.metadata), request_iterator)


class _StreamStreamToken(_Token, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, details, request_iterator):
        return await continuation(_with_metadata(details, self.metadata), request_iterator)


_TOKEN_INTERCEPTORS = (_UnaryUnaryToken, _UnaryStreamToken, _StreamUnaryToken, _StreamStreamToken)


@dataclass(frozen=True)
class _SyncDetails(grpc.ClientCallDetails):
    method: str
    timeout: float | None
    metadata: Any
    credentials: Any
    wait_for_ready: Any
    compression: Any


class _SyncTokenInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                            grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self.metadata = metadata

    def _details(self, d):
        return _SyncDetails(d.method, d.timeout, [*(d.metadata or ()), *self.metadata], d.credentials,
                            getattr(d, "wait_for_ready", None), getattr(d, "compression", None))

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)

    def intercept_stream_stream(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)


# -- the server side: one check before any handler runs -------------------------------------------

class ServerAuth(grpc.aio.ServerInterceptor):
    """Refuses (UNAUTHENTICATED) a call without the cluster token, except `OPEN_METHODS`; `Generate`
    needs the API key when one is set. A refused call's request is never parsed."""

    def __init__(self, token: bytes | None, api_key: str | None = None) -> None:
        self.token = token
        self.api_key = api_key.encode() if api_key else None

    def refusal(self, method: str, metadata: Sequence[tuple[str, Any]] | None) -> str | None:
        """Why this call is refused, or None."""
        values = dict(metadata or ())
        if method in API_KEY_METHODS:
            if self.api_key is None:
                return None
            scheme, _, key = str(values.get("authorization", "")).partition(" ")
            if scheme.lower() == "bearer" and hmac.compare_digest(key.strip().encode(), self.api_key):
                return None
            return "missing or wrong API key: send 'authorization: Bearer <key>' metadata"
        if method in OPEN_METHODS or self.token is None:
            return None
        given = values.get(TOKEN_METADATA)
        if isinstance(given, str) and hmac.compare_digest(given.encode(), self.token):
            return None
        log.warning("refused %s: %s cluster token", method, "wrong" if given else "no")
        return (f"{method} needs the cluster secret: give this client --cluster-token-file "
                "(the same file as the cluster's)")

    async def intercept_service(self, continuation, handler_call_details):
        why = self.refusal(handler_call_details.method, handler_call_details.invocation_metadata)
        handler = await continuation(handler_call_details)
        if why is None or handler is None:
            return handler
        return _refusing(handler, why)


def _refusing(handler: grpc.RpcMethodHandler, why: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that ends the call UNAUTHENTICATED (the request
    stays raw bytes: nothing from an unauthenticated peer is parsed)."""

    async def refuse(_request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, why)

    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(refuse)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(refuse)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(refuse)
    return grpc.stream_stream_rpc_method_handler(refuse)


# -- where a process may listen --------------------------------------------------------------------

def is_loopback(host: str) -> bool:
    """True when every address `host` names is a loopback one (a wildcard or unknown host is not)."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos)


def check_exposure(addresses: Sequence[tuple[str, Any]], secured: bool, insecure: bool) -> None:
    """Refuse (one line) to listen beyond loopback with neither TLS nor a cluster token, unless --insecure."""
    if secured or insecure:
        return
    for flag, address in addresses:
        if address is None:
            continue
        host = address[0] if isinstance(address, tuple) else str(address).rpartition(":")[0]
        if not is_loopback(str(host)):
            raise StartupError(
                f"{flag} {address} is reachable beyond this machine, but neither TLS nor a cluster token is set: "
                "give --tls-cert/--tls-key/--tls-ca and/or --cluster-token-file (docs/deploy.md), listen on "
                "127.0.0.1, or pass --insecure to accept that anyone who reaches the port owns the cluster")
