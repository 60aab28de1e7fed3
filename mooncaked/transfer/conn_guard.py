"""Bounds on a raw-socket server's incoming connections: how many, and how long each may dawdle.

Used by the transfer port and the store master's fast path. A server admits a connection only
under its cap (and, while the cluster-secret handshake is pending, under a smaller cap of
unproven ones, so strangers cannot crowd out peers), and gives each one a `ConnWatch`: one timer
per connection, never one per request, that closes it when

- the handshake is not done within `handshake_timeout_s`,
- a request or frame is half received and makes no progress for `partial_timeout_s`,
- nothing arrives (and nothing is half received) for `idle_timeout_s`.

"Progress" is whatever counter the connection passes in: bytes received on the transfer port
(a big payload may stream slowly, but must keep streaming), frames completed on the fast path
(a frame must be complete within the timeout, so a half frame is never held). The hot path
only bumps that counter; the clock is read by the timer.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

from mooncaked.transfer.handshake import HANDSHAKE_TIMEOUT_S

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ConnLimits:
    """What one server allows its incoming connections."""

    max_connections: int = 512
    max_unproven: int = 64  # of those, connections still in the handshake
    handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S
    idle_timeout_s: float = 300.0
    partial_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if self.max_connections < 1 or self.max_unproven < 1:
            raise ValueError("connection caps must be at least 1")
        for name in ("handshake_timeout_s", "idle_timeout_s", "partial_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")

    @property
    def client_idle_s(self) -> float:
        """Clients of a server with these limits stop using a connection idle this long and close
        it within twice that: well inside the server's idle timeout, so the server never drops a
        connection a client is about to send on."""
        return self.idle_timeout_s / 5


CLIENT_IDLE_CLOSE_S = ConnLimits().client_idle_s
CLOSE_FLUSH_S = 5.0
"""A connection the server closes with answers still queued is cut off if its peer has not taken them by then
(a peer that never reads would otherwise keep it, and its place under the cap, for ever)."""


def close_within(transport: asyncio.Transport, cut_off: Callable[[], None]) -> None:
    """Close `transport` once what is queued is sent, calling `cut_off` (which aborts it unless it is gone
    already) after CLOSE_FLUSH_S if something is still queued."""
    transport.close()
    if transport.get_write_buffer_size():
        asyncio.get_running_loop().call_later(CLOSE_FLUSH_S, cut_off)


def admit(limits: ConnLimits, connections: int, unproven: int, needs_proof: bool) -> str | None:
    """Why a new connection is refused (logged by the caller), or None to take it."""
    if connections >= limits.max_connections:
        return f"already {connections} connections (the cap)"
    if needs_proof and unproven >= limits.max_unproven:
        return f"already {unproven} connections in the handshake (the cap)"
    return None


class ConnWatch:
    """The timer of one connection; see the module docstring for the rules."""

    __slots__ = ("_loop", "_limits", "_progress", "_partial", "_close", "_timer", "_seen", "_since", "_opened",
                 "_due", "proven")

    def __init__(self, limits: ConnLimits, proven: bool, progress: Callable[[], int],
                 partial: Callable[[], bool], close: Callable[[str], None]) -> None:
        self._loop = asyncio.get_running_loop()
        self._limits = limits
        self._progress = progress
        self._partial = partial
        self._close = close
        self.proven = proven  # set by the connection when the handshake succeeds
        self._seen = progress()
        self._opened = self._since = self._loop.time()  # _since: when the counter last moved
        self._timer: asyncio.TimerHandle | None = None
        self._due = 0.0
        self._schedule()

    def _tick_s(self) -> float:
        lim = self._limits
        shortest = min(lim.idle_timeout_s, lim.partial_timeout_s)
        if not self.proven:
            shortest = min(shortest, lim.handshake_timeout_s)
        return max(0.01, shortest / 4)

    def _schedule(self, delay: float | None = None) -> None:
        delay = self._tick_s() if delay is None else delay
        self._due = self._loop.time() + delay
        self._timer = self._loop.call_later(delay, self._check)

    def _check(self) -> None:
        self._timer = None
        now = self._loop.time()
        if now - self._due > max(0.5, self._tick_s()):
            # the loop was blocked: what the peer sent meanwhile may still sit unread in the
            # kernel (uvloop runs timers before reading), so judge after the next read
            return self._schedule(0.01)
        lim = self._limits
        seen = self._progress()
        if seen != self._seen:
            self._seen, self._since = seen, now
        waited = now - self._since
        if not self.proven and now - self._opened >= lim.handshake_timeout_s:
            return self._close(f"no cluster-secret handshake within {lim.handshake_timeout_s:g}s")
        if self._partial():
            if waited >= lim.partial_timeout_s:
                return self._close(f"a half-received request made no progress for {lim.partial_timeout_s:g}s")
        elif waited >= lim.idle_timeout_s:
            return self._close(f"idle for {lim.idle_timeout_s:g}s")
        self._schedule()

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
