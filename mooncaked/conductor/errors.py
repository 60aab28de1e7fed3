"""What the conductor's core raises instead of a wire status.

The core (``conductor/core.py``, ``conductor/membership.py``) knows nothing of gRPC or HTTP:
it raises one of these, and each front maps them to its own statuses in one table (the gRPC
servicer in ``roles/conductor.py``, ``http_api.STATUS_MAP``). The message is what the client
reads, so it says what to change or what was missing.
"""

from __future__ import annotations


class ConductorError(Exception):
    """A request the conductor could not serve; ``str(e)`` is the message for the client."""

    @property
    def message(self) -> str:
        return str(self)


class BadRequest(ConductorError):
    """The request itself is wrong (empty prompt, bad sampling, too long): fix it and ask again.

    ``code`` is OpenAI's machine-readable code where it has one (``context_length_exceeded``)."""

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.code = code


def too_long_message(what: str, prompt_tokens: int, context: int) -> str:
    """What a prompt that leaves no room in the context for a new token is told (both fronts' checks)."""
    return (f"{what} has {prompt_tokens} tokens; the model's context is {context} tokens, which must hold the "
            "prompt and at least one new token")


def too_long(prompt_tokens: int, context: int) -> BadRequest:
    """A prompt that leaves no room in the context for the token it asks for."""
    return BadRequest(too_long_message("the prompt", prompt_tokens, context), "context_length_exceeded")


class Rejected(ConductorError):
    """Refused on purpose, before any work: an SLO would break (early rejection), or no room came in time.

    ``reason`` is machine-readable ("ttft_slo", "tbt_slo", "kv_capacity", "kv_wait"; "resource_exhausted"
    when no KV room came before the wait's end) for metrics."""

    def __init__(self, message: str, reason: str = "resource_exhausted") -> None:
        super().__init__(message)
        self.reason = reason


class NoInstance(ConductorError):
    """No instance of ``role`` ("prefill" | "decode") can take the request now."""

    def __init__(self, message: str, role: str = "") -> None:
        super().__init__(message)
        self.role = role


class PeerFailed(ConductorError):
    """An engine the request was on failed it: ``peer`` names it, ``kind`` is its ``EngineError`` kind
    (conductor/engine_link.py), so a front can tell "gone" (unavailable) from "broke" (internal)."""

    def __init__(self, message: str, peer: str = "", kind: str = "unavailable") -> None:
        super().__init__(message)
        self.peer = peer
        self.kind = kind


class DeadlineExceeded(ConductorError):
    """The request's own deadline passed (or the cluster's startup window, with the request's deadline)."""


class NotFound(ConductorError):
    """An instance or request that is not known."""


class AlreadyExists(ConductorError):
    """A name that is taken (a live instance's)."""


class FailedPrecondition(ConductorError):
    """The cluster's state forbids it (another block size, another model)."""


class OutOfRange(ConductorError):
    """It can never fit (a prompt no decode instance could ever hold)."""


_KIND_REASONS = {"deadline": "deadline_exceeded", "exhausted": "resource_exhausted", "invalid": "invalid_argument",
                 "precondition": "failed_precondition"}


def metric_reason(e: ConductorError) -> str:
    """The label a refusal is counted under (``mooncaked_conductor_rejections{reason}``): the scheduler's
    finer reason for a rejection, else the name of the status the client saw (as the series always had)."""
    if isinstance(e, Rejected):
        return e.reason
    if isinstance(e, PeerFailed):
        return _KIND_REASONS.get(e.kind, e.kind)
    return _REASONS.get(type(e), "internal")


_REASONS: dict[type, str] = {BadRequest: "invalid_argument", NoInstance: "unavailable",
                             DeadlineExceeded: "deadline_exceeded", NotFound: "not_found",
                             AlreadyExists: "already_exists", FailedPrecondition: "failed_precondition",
                             OutOfRange: "out_of_range"}
