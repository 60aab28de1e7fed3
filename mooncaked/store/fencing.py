"""Who a store master may serve: the gate every StoreMaster call passes first.

A single master (no `--etcd`) serves everything, always. Under HA (leadership.py) a standby
serves nothing but `Describe(any_role)` and answers every other call UNAVAILABLE naming the
leader, so clients go there; the leader serves reads always, and writes only while its etcd
lease is surely alive: until `write_until`, which is the monotonic time its last successful
keepalive was *sent* plus the lease's TTL, less a margin. etcd cannot expire the lease before
then, so no standby can have taken over while we still write — no split brain, even for a
leader that was frozen (SIGSTOP) past its lease: its first call after waking finds the clock
past `write_until` and is refused before the keepalive even says the lease is gone.

The check is one set lookup and one clock read: it sits on every put's path.
"""

from __future__ import annotations

import math
import time

from mooncaked.store import metrics

WRITES = frozenset({
    "MountSegment", "RemountSegment", "EvacuateSegment", "ReportWrites", "UnmountSegment", "PutStart", "BatchPutStart", "PutEnd",
    "PutRevoke", "BatchPutEnd", "ReservePlaces", "Remove", "TaskDone",
})
"""Calls that change what the pool holds or where: refused by a leader unsure of its lease."""

LEADER, STANDBY, SINGLE = "leader", "standby", ""


class Gate:
    """One per master process; leadership.py moves it between leader and standby."""

    __slots__ = ("leading", "write_until", "leader", "role", "_monotonic")

    def __init__(self) -> None:
        self.leading = True  # False: a standby (or a deposed leader) serves nothing
        self.write_until = math.inf  # a single master is never fenced
        self.leader = ""  # the leader's gRPC address, as far as we know ("" : none known)
        self.role = SINGLE
        self._monotonic = time.monotonic

    def refusal(self, method: str) -> str | None:
        """Why `method` may not be served now (None: serve it)."""
        if self.leading:
            if method not in WRITES or self._monotonic() < self.write_until:
                return None
            metrics.REFUSED_CALLS.labels("fenced").inc()
            return (f"store master: {method} refused: this leader cannot vouch for its etcd lease now (etcd "
                    "unreachable?); reads go on, writes resume once etcd confirms the lease")
        if method == "Describe":
            return None  # its handler answers who leads when asked (DescribeRequest.any_role)
        metrics.REFUSED_CALLS.labels("standby").inc()
        return self.standby_message()

    def standby_message(self) -> str:
        return ("store master: not the leader (a standby); the leader is "
                + (self.leader or "not known yet (an election is under way)")
                + ": follow it with --store etcd://… or a list of masters")

    def writable(self) -> bool:
        return self.leading and self._monotonic() < self.write_until

    # -- moves (leadership.py) -----------------------------------------------------------------
    def stand_by(self, leader: str = "") -> None:
        self.leading = False
        self.write_until = -math.inf
        self.leader = leader
        self.role = STANDBY

    def lead(self, me: str, write_until: float) -> None:
        self.leader = me
        self.write_until = write_until
        self.role = LEADER
        self.leading = True

    def confirm(self, write_until: float) -> None:
        """A keepalive went through: writes are safe until `write_until`."""
        if self.leading and write_until > self.write_until:
            self.write_until = write_until
