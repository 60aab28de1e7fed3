"""What every daemon shares: a grpc.aio server with health checking and reflection,
one shutdown path for SIGTERM/SIGINT, systemd's notify protocol, and the channel options
and default deadline every gRPC client uses."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
from collections.abc import Iterable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from mooncaked.rpc_parse import ParseErrorsAreInvalidArgument
from mooncaked.security import Security
from mooncaked.startup import bind_error, probe

log = logging.getLogger(__name__)

# every call from one role to another carries a deadline; these are the defaults
RPC_TIMEOUT_S = 10.0
CHANNEL_OPTIONS = [
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
]
# for channels to a peer that may restart (the store master): found again within a second, not after
# gRPC's default reconnect backoff (up to 2 minutes); and a connection of the channel's own: by default a
# process's channels to one address share one, with its backoff, so a client started just after the peer
# came back failed its first call with the old connection's "Connection refused"
RECONNECT_OPTIONS = [
    ("grpc.use_local_subchannel_pool", 1),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
# servers accept the clients' keepalive pings (the default policy answers them with GOAWAY), and own
# their port alone: with gRPC's default SO_REUSEPORT a second daemon on the same port starts without
# error and the kernel splits the connections between the two
SERVER_OPTIONS = CHANNEL_OPTIONS + [
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
    ("grpc.http2.max_ping_strikes", 0),
    ("grpc.so_reuseport", 0),
]


def sd_notify(state: str) -> None:
    """Tell systemd (Type=notify) about our state: one datagram to $NOTIFY_SOCKET, if set."""
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return
    if addr.startswith("@"):
        addr = "\0" + addr[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.connect(addr)
            s.sendall(state.encode())
    except OSError as e:
        log.warning("could not notify systemd (%s): %s", state, e)


class RoleServer:
    """Owns one grpc.aio server; ``serve()`` runs until a signal, then shuts down once.

    `flag`: the setting `listen` came from, named in the error when the port is taken.
    `security`: mutual TLS and the cluster token every call but the open ones must carry;
    `api_key`: what the conductor's `Generate` requires (mooncaked/security.py)."""

    def __init__(self, listen: str, service_names: Iterable[str], flag: str = "--listen",
                 security: Security | None = None, api_key: str | None = None) -> None:
        self.listen = listen
        self.flag = flag
        self.security = security or Security()
        # authentication first (a refused call is never parsed), then undecodable bytes -> INVALID_ARGUMENT
        interceptors = [*self.security.server_interceptors(api_key), ParseErrorsAreInvalidArgument()]
        self.server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=interceptors)
        self.health = health.aio.HealthServicer() if hasattr(health, "aio") else health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        names = list(service_names)
        reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], self.server)
        self._names = names
        self.stopping = asyncio.Event()
        self.port = 0

    async def start(self) -> int:
        try:
            creds = self.security.server_credentials()
            self.port = (self.server.add_insecure_port(self.listen) if creds is None
                         else self.server.add_secure_port(self.listen, creds))
        except RuntimeError:  # grpc says only "Failed to bind"; a plain bind tells why
            self.port = 0
        if self.port == 0:
            raise bind_error(self.flag, self.listen, probe(self.listen))
        await self.server.start()
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        return self.port

    async def _set_health(self, status) -> None:
        for name in ["", *self._names]:
            result = self.health.set(name, status)
            if asyncio.iscoroutine(result):
                await result

    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stopping.set)

    async def not_serving(self) -> None:
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)

    async def stop(self, grace_s: float = 2.0) -> None:
        await self.not_serving()
        await self.server.stop(grace_s)

