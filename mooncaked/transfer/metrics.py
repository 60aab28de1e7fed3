"""Prometheus counters of the data plane, one set per process.

prometheus-client keeps metrics in a process-wide registry, so they live
here once; every engine in the process adds to the same series, labelled by
backend so tcp and shm traffic can be told apart. Labelled children are
cached: looking labels up costs more than the increment on the hot path.
"""

from __future__ import annotations

import functools
import logging
from collections import Counter as Tally
from collections.abc import Sequence

from prometheus_client import Counter

from mooncaked.transfer.api import TransferOp

logger = logging.getLogger(__name__)

BYTES_SENT = Counter(
    "mooncaked_transfer_sent_bytes",
    "Payload bytes this process pushed out (tcp: onto the wire; shm: copied into a peer).",
    ["backend"],
)
BYTES_RECEIVED = Counter(
    "mooncaked_transfer_received_bytes",
    "Payload bytes that landed in this process's regions.",
    ["backend"],
)
OPS = Counter(
    "mooncaked_transfer_ops",
    "Transfer ops, by who started them (initiator) or served them (target).",
    ["backend", "op", "role", "result"],
)
SERIES = (BYTES_SENT, BYTES_RECEIVED, OPS)  # an engine's page (role_metrics.py)


@functools.cache
def _ops(backend: str, op: str, role: str, ok: bool) -> Counter:
    return OPS.labels(backend, op, role, "ok" if ok else "error")


@functools.cache
def _sent(backend: str) -> Counter:
    return BYTES_SENT.labels(backend)


@functools.cache
def _received(backend: str) -> Counter:
    return BYTES_RECEIVED.labels(backend)


def count_op(backend: str, op: str, role: str, ok: bool, sent: int = 0, received: int = 0) -> None:
    """Record one op and the payload bytes it moved in this process."""
    _ops(backend, op, role, ok).inc()
    if sent:
        _sent(backend).inc(sent)
    if received:
        _received(backend).inc(received)


def count_batch(backend: str, role: str, ops: Tally[tuple[str, bool]], sent: int, received: int) -> None:
    """Record a batch at once: ops maps (op kind, ok) to how many."""
    for (op, ok), n in ops.items():
        _ops(backend, op, role, ok).inc(n)
    if sent:
        _sent(backend).inc(sent)
    if received:
        _received(backend).inc(received)


def count_initiated(backend: str, ops: Sequence[TransferOp], oks: Sequence[bool]) -> None:
    """Record ops this process started (oks[i]: whether ops[i] succeeded) and
    the payload bytes the successful ones moved. A single op, the common
    put/get, is counted directly: building a tally would cost more."""
    if len(ops) == 1:
        op, ok = ops[0], oks[0]
        sent = op.length if ok and op.op == "write" else 0
        received = op.length if ok and op.op == "read" else 0
        count_op(backend, op.op, "initiator", ok, sent, received)
        return
    tally: Tally[tuple[str, bool]] = Tally()
    sent = received = 0
    for op, ok in zip(ops, oks, strict=True):
        tally[op.op, ok] += 1
        if ok and op.op == "write":
            sent += op.length
        elif ok:
            received += op.length
    count_batch(backend, "initiator", tally, sent, received)
