"""A store client's metadata calls to the master: on the master's fast path when it offers one, else gRPC.

Why a seam of its own: every put and get makes one or two of these calls, and which channel carries
them changes under the caller (the fast path opens, breaks, backs off; the leader moves under HA).
Callers name the method and hand the request; this decides how it travels and maps gRPC errors to
the store's typed errors (errors.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from mooncaked.proto.mooncake.v1 import store_pb2_grpc
from mooncaked.security import Security
from mooncaked.store.errors import StoreError, StoreUnavailable, from_rpc_error
from mooncaked.store.fast_channel import FastChannel
from mooncaked.store.fast_wire import RequestTooBig
from mooncaked.store.master_link import MasterLink, host_of
from mooncaked.store.reservations import Places
from mooncaked.transfer import host_id

logger = logging.getLogger(__name__)

FAST_RETRY_S = 1.0  # after the fast path failed to open, gRPC carries the calls this long (doubling to the max)
FAST_RETRY_MAX_S = 30.0
FAST_CONNECT_TIMEOUT_S = 1.0  # the master answered Describe: its fast port answers at once or not at all


class MasterCalls:
    """One client's calls to the master (the leader, under HA: `link` follows it).

    `places` is the client's stock of places reserved ahead: it belongs to the master that reserved
    them, so a lost fast path (a master killed, restarted or deposed) forgets it, and a new channel
    tells it which master's epoch it now follows. `suspect()` runs whenever the master may be gone
    (the fast path was lost, a call found it unavailable): master_watch.py."""

    def __init__(self, link: MasterLink, security: Security, client_id: str, places: Places, *,
                 fast_path: bool = True, timeout_s: float = 5.0, suspect: Callable[[], None] = lambda: None) -> None:
        self.link = link
        self.security = security
        self.client_id = client_id
        self.places = places
        self.use_fast_path = fast_path
        self.timeout_s = timeout_s
        self.suspect = suspect
        self.fast: FastChannel | None = None
        self.retry_at = 0.0  # after a fast-path failure, gRPC until then (loop time)
        self._backoff = FAST_RETRY_S
        self._lock = asyncio.Lock()

    @property
    def stub(self) -> store_pb2_grpc.StoreMasterStub:
        return self.link.stub

    def open_fast_now(self) -> FastChannel | None:
        """The fast channel when it is open (a call written to it goes out before the caller's next)."""
        fast = self.fast
        return fast if fast is not None and not fast.closed else None

    async def call(self, what: str, request: Any) -> Any:
        """Call method `what` of the master with `request`; its reply, or a StoreError."""
        fast = self.open_fast_now()
        if fast is not None:
            try:
                return await fast.call(what, request, self.timeout_s)
            except RequestTooBig:  # over the fast path's frame limit: this one goes by gRPC
                return await self._grpc_reply(what, getattr(self.stub, what)(request, timeout=self.timeout_s))
        return await (await self.send(what, request))

    async def send(self, what: str, request: Any) -> Awaitable[Any]:
        """Put a call on the wire now (opening the fast path first when it is due); the returned
        awaitable gives its reply."""
        fast = self.open_fast_now() or await self._open_fast()
        if fast is not None:
            try:
                return fast.send(what, request, self.timeout_s)
            except RequestTooBig:  # over the fast path's frame limit: this one goes by gRPC
                pass
        return self._grpc_reply(what, getattr(self.stub, what)(request, timeout=self.timeout_s))  # starts here

    async def _grpc_reply(self, what: str, call: Awaitable[Any]) -> Any:
        try:
            return await call
        except grpc.aio.AioRpcError as e:
            error = from_rpc_error(e, what)
            if isinstance(error, StoreUnavailable):
                self.suspect()
            raise error from None

    def _lost(self) -> None:
        """The fast path's master is lost to us: its reserved places are another master's to give."""
        self.places.forget()
        self.suspect()

    def leader_moved(self) -> None:
        """The leader moved: the fast path reopens toward the new one at the next call."""
        self.retry_at, self._backoff = 0.0, FAST_RETRY_S
        if self.fast is not None:
            self.fast.fail("the store master leader moved")

    def close(self) -> None:
        if self.fast is not None:
            self.fast.close()

    async def _open_fast(self) -> FastChannel | None:
        """A fresh fast-path channel (asked for with Describe), or None to use gRPC for now.

        Calls never wait for an opening in progress (they take gRPC meanwhile), and failed openings
        back off from FAST_RETRY_S up to FAST_RETRY_MAX_S, so a firewalled fast port costs nothing.
        """
        loop = asyncio.get_running_loop()
        if not self.use_fast_path or loop.time() < self.retry_at or self._lock.locked():
            return None
        async with self._lock:
            try:
                address, reply = await self.link.describe(self.timeout_s)  # the leader's, under HA
                if not reply.fast_path_port:
                    self.retry_at = loop.time() + FAST_RETRY_MAX_S  # this master has none (maybe the next)
                    return None
                host = host_of(address)
                link = self.link if self.link.following else None  # calls it no longer serves go on by gRPC
                timeout = min(self.timeout_s, FAST_CONNECT_TIMEOUT_S)
                self.fast = None
                if reply.fast_path_unix and reply.host_id == host_id():  # same host: the cheaper socket
                    try:
                        self.fast = await FastChannel.connect(host, 0, timeout, unix=reply.fast_path_unix,
                                                              token=self.security.token, link=link, on_lost=self._lost)
                    except StoreUnavailable as e:
                        logger.info("store client %s: %s; using TCP", self.client_id, e)
                if self.fast is None:
                    self.fast = await FastChannel.connect(host, reply.fast_path_port, timeout,
                                                          token=self.security.token, link=link, on_lost=self._lost)
                self.places.follow(reply.master_epoch)
                self._backoff = FAST_RETRY_S
                return self.fast
            except (grpc.aio.AioRpcError, StoreError) as e:
                self.retry_at = loop.time() + self._backoff
                self._backoff = min(2 * self._backoff, FAST_RETRY_MAX_S)
                detail = e.details() if isinstance(e, grpc.aio.AioRpcError) else str(e)
                logger.info("store client %s: no fast path to the master for now (%s); using gRPC",
                            self.client_id, detail)
                return None


__all__ = ["FAST_RETRY_MAX_S", "FAST_RETRY_S", "MasterCalls"]
