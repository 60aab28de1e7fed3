"""What the engine hands back to callers."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TopLogprobs:
    """The most likely next tokens at one position, most likely first, with their log-probs."""

    token_ids: list[int]
    logprobs: list[float]


@dataclass
class Output:
    """A request's result so far. In a stream, ``new_token_ids``/``new_text`` hold the delta.

    ``logprobs[i]`` is the log-prob of ``token_ids[i]``; ``top_logprobs[i]`` the ``top_logprobs``
    most likely tokens at that position (both only when the request asked for them).
    """

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" (``error`` says what went wrong)
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache, not computed
    logprobs: list[float] | None = None
    top_logprobs: list[TopLogprobs] | None = None
    # with SamplingParams.prompt_logprobs: entry i is prompt token i + 1's log-prob given the tokens before it
    # (the first prompt token has none), and the most likely tokens there; complete once the prompt is computed
    prompt_logprobs: list[float] | None = None
    prompt_top_logprobs: list[TopLogprobs] | None = None
    compute_s: float = 0.0  # engine step time of the steps this request took part in
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    error: str | None = None  # with finish_reason "error": why this request failed (the engine serves on)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
