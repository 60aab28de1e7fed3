"""Per-request sampling settings, validated when the request is made."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

MAX_TOP_LOGPROBS = 20  # as OpenAI's chat API: the sampler's top-k of the log-probs is cheap, a long list is not
# below this a temperature only sharpens the distribution into its argmax, while dividing the logits by it
# overflows float32 (1e-40 turned every logit into inf and the probabilities into NaN): such rows are greedy
TEMPERATURE_FLOOR = 1e-5
MAX_SEED = (1 << 64) - 1  # torch.Generator takes 64-bit seeds
MAX_LOGIT_BIAS = 300  # tokens one request may bias: a map is bounded before it is read, each entry costs an index
LOGIT_BIAS_RANGE = 100.0  # as OpenAI: -100 all but bans a token, +100 all but forces it


class RequestError(ValueError):
    """A request the engine cannot serve as asked; the message says what to change."""


@dataclass
class SamplingParams:
    max_tokens: int = 64
    min_tokens: int = 0  # EOS and stop token ids are suppressed until this many tokens are out
    temperature: float = 0.0  # 0 (or anything below TEMPERATURE_FLOOR) means greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = False  # the sampled token's log-prob (of the raw model distribution: see sampler.py)
    top_logprobs: int = 0  # with logprobs: also the k most likely tokens and their log-probs
    presence_penalty: float = 0.0  # OpenAI: minus this from every token already generated once or more
    frequency_penalty: float = 0.0  # OpenAI: minus this times how often a token was generated
    repetition_penalty: float = 1.0  # HF/vLLM: prompt and generated tokens' logits shrink by this factor
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] = field(default_factory=dict)  # OpenAI: added to these tokens' logits
    # scoring (OpenAI's echo with logprobs): each prompt token's log-prob given the tokens before it, and
    # this many most likely tokens at each position; None: off. The whole prompt is then computed (no
    # prefix cache, pool or peer KV: a reused block has no logits)
    prompt_logprobs: int | None = None
    # structured outputs: an llguidance grammar (engine/grammar.py: from a JSON schema, a regex, Lark) that
    # every token must keep to; the answer stops once it is complete. None: free text
    grammar: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    def validate(self) -> None:
        if not _integer(self.max_tokens) or self.max_tokens <= 0:
            raise RequestError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not _integer(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise RequestError(f"min_tokens must be an integer in [0, max_tokens], got {self.min_tokens!r}")
        if not _finite(self.temperature) or self.temperature < 0:
            raise RequestError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _integer(self.top_k) or self.top_k < 0:
            raise RequestError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if not _finite(self.top_p) or not 0 < self.top_p <= 1:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _finite(self.min_p) or not 0 <= self.min_p <= 1:
            raise RequestError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and (not _integer(self.seed) or not 0 <= self.seed <= MAX_SEED):
            raise RequestError(f"seed must be an integer in [0, 2**64), got {self.seed!r}")
        if not isinstance(self.stop, list) or any(not isinstance(s, str) or not s for s in self.stop):
            raise RequestError("stop must be a list of non-empty strings")
        if not isinstance(self.stop_token_ids, list) or any(not _integer(t) or t < 0 for t in self.stop_token_ids):
            raise RequestError("stop_token_ids must be non-negative integers")
        if not _integer(self.top_logprobs) or not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise RequestError(
                f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs!r}")
        if self.top_logprobs and not self.logprobs:
            raise RequestError("top_logprobs needs logprobs=True")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _finite(v) or not -2 <= v <= 2:
                raise RequestError(f"{name} must be between -2 and 2, got {v!r}")
        if not _finite(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise RequestError(f"repetition_penalty must be a number > 0 (1 is off), got {self.repetition_penalty!r}")
        if self.prompt_logprobs is not None and (not _integer(self.prompt_logprobs)
                                                 or not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS):
            raise RequestError(f"prompt_logprobs must be None or an integer in [0, {MAX_TOP_LOGPROBS}], "
                               f"got {self.prompt_logprobs!r}")
        if self.grammar is not None:
            from mooncaked.engine.grammar import grammar_error

            why = grammar_error(self.grammar)
            if why:
                raise RequestError(why)
        if not isinstance(self.logit_bias, dict) or len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise RequestError(f"logit_bias must map at most {MAX_LOGIT_BIAS} token ids to biases")
        for t, b in self.logit_bias.items():
            if not _integer(t) or t < 0 or not _finite(b) or not -LOGIT_BIAS_RANGE <= b <= LOGIT_BIAS_RANGE:
                raise RequestError(f"logit_bias maps token ids (integers >= 0) to numbers in [-{LOGIT_BIAS_RANGE:g}, "
                                   f"{LOGIT_BIAS_RANGE:g}]; got {t!r}: {b!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < TEMPERATURE_FLOOR

    @property
    def scored(self) -> bool:
        """Whether the prompt's own log-probs are wanted (every prompt token is then computed)."""
        return self.prompt_logprobs is not None

    @property
    def penalized(self) -> bool:
        """Whether the logits change with the tokens seen so far (the sampler then needs them)."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1


def _integer(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _finite(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
