"""The store's typed failures: the master raises them, `service.py` maps them to gRPC
statuses in one place, and the client maps statuses back, so callers on both sides catch
one vocabulary instead of status codes."""

from __future__ import annotations

import logging

import grpc

logger = logging.getLogger(__name__)


class StoreError(Exception):
    """Base of every store failure; the message says what to do."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL


class InvalidArgument(StoreError):
    """The request itself is wrong (negative or oversized object, empty key)."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(StoreError):
    """An unknown key or segment."""

    code = grpc.StatusCode.NOT_FOUND


class NoRoom(StoreError):
    """The pool is full right now; retrying later or adding capacity helps."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class FailedPrecondition(StoreError):
    """The call does not fit the state: PutEnd without PutStart, a dead client's segment."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class StoreUnavailable(StoreError):
    """The master (or a peer holding the bytes) cannot be reached."""

    code = grpc.StatusCode.UNAVAILABLE


_BY_CODE: dict[grpc.StatusCode, type[StoreError]] = {
    cls.code: cls for cls in (InvalidArgument, NotFound, NoRoom, FailedPrecondition, StoreUnavailable)
}
_BY_CODE[grpc.StatusCode.DEADLINE_EXCEEDED] = StoreUnavailable


_BY_VALUE: dict[int, grpc.StatusCode] = {c.value[0]: c for c in grpc.StatusCode}


def from_rpc_error(err: grpc.RpcError, what: str) -> StoreError:
    """The typed error for a failed call to the master (`what` names the call)."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = err.details() if hasattr(err, "details") else str(err)
    cls = _BY_CODE.get(code, StoreError)
    return cls(f"store master {what}: {code.name}: {details}")


def from_status(status: int, details: str, what: str) -> StoreError:
    """The same typed error for a status that came back on the fast path."""
    code = _BY_VALUE.get(status, grpc.StatusCode.UNKNOWN)
    return _BY_CODE.get(code, StoreError)(f"store master {what}: {code.name}: {details}")
