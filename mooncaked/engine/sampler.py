"""Turns last-position logits into next tokens, per request settings, without host syncs
for the all-greedy batch beyond reading the chosen ids.

Order, as vLLM's: log-probs are taken from the raw logits (the model's own distribution, before
min_tokens bans, logit_bias, penalties, temperature or top-k/p/min-p filtering: vLLM's default
``raw_logprobs``), so they mean the same whatever the request's sampling settings; then logit_bias
is added, banned tokens are masked, penalties applied (repetition, then frequency and presence),
a grammar's allowed tokens kept (structured outputs: engine/grammar.py), and the token is chosen:
argmax when greedy (penalties, biases and the grammar apply there too, as in HF and vLLM), otherwise
temperature, top-k, min-p, top-p and a draw.

Numerically safe for any settings ``SamplingParams`` accepts: sampling runs in float32, the
logits are shifted so their maximum is 0 before the temperature divides them (nothing
overflows), and every filter keeps the most likely allowed token, so a draw always has mass
to draw from. A row whose *model* logits hold NaN or +inf (or nothing but -inf) is reported
in ``Sampled.errors`` and its token is meaningless: that request fails, its batch does not.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mooncaked.engine.grammar import NO_TOKEN
from mooncaked.engine.outputs import TopLogprobs
from mooncaked.engine.sampling_params import SamplingParams

BROKEN_ROW = "the model's logits for this request hold NaN or infinity (broken weights or KV cache?)"
# beyond this every float32 logit difference divides to ~0: the draw is uniform over the allowed tokens
MAX_TEMPERATURE = 1e30
_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class History:
    """The tokens a row's penalties look at."""

    prompt_token_ids: list[int]
    output_token_ids: list[int]


@dataclass
class Sampled:
    """The chosen ids; when any row asked, their log-probs (None elsewhere) and top-k lists;
    when a row's logits were broken, why (its id is then meaningless)."""

    token_ids: list[int]
    logprobs: list[float | None] | None = None
    top_logprobs: list[TopLogprobs | None] | None = None
    errors: list[str | None] | None = None


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
           banned: list[frozenset[int] | None] | None = None,
           histories: list[History | None] | None = None,
           allowed: list[torch.Tensor | None] | None = None) -> Sampled:
    """logits: [S, V], any float dtype (not modified; sampled in float32).

    ``generators[i]``: row i's random source (None: torch's global one).
    ``banned[i]``: token ids row i may not choose (min_tokens keeps EOS out of reach).
    ``histories[i]``: row i's prompt and output so far; needed only for rows with penalties.
    ``allowed[i]``: [V] bool, the only tokens row i may choose (its grammar): applied last and
    never relaxed (a ban that leaves none of them falls back to the allowed ones' raw logits);
    a row that allows none fails (``Sampled.errors``).
    """
    logits = logits.float()
    # one pass decides the common case: no NaN or infinity anywhere, so no row is broken and (with no
    # penalty to overflow and no ban that covers the vocabulary) there is nothing to repair; the checks
    # and repairs below take ~9 passes over the logits (8 ms a step at batch 16 on one core)
    clean = bool(torch.isfinite(logits).all())
    broken = torch.zeros(logits.shape[0], dtype=torch.bool, device=logits.device) if clean else _broken_rows(logits)
    want_logprobs = any(p.logprobs for p in params)
    raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
    masked = bool(banned) and any(banned)  # type: ignore[arg-type]
    penalized = [i for i, p in enumerate(params) if p.penalized]
    biased = [i for i, p in enumerate(params) if p.logit_bias]
    x = logits.clone() if masked or penalized or biased else logits
    vocab = x.shape[-1]
    for i in biased:  # ids past the vocabulary bias nothing (the HTTP front refuses them)
        bias = {t: b for t, b in params[i].logit_bias.items() if t < vocab}
        if bias:
            ids = torch.tensor(list(bias), dtype=torch.long, device=x.device)
            x[i, ids] += torch.tensor(list(bias.values()), dtype=x.dtype, device=x.device)
    if masked:
        for i, ids in enumerate(banned):  # type: ignore[arg-type]
            if ids:
                x[i, [t for t in ids if 0 <= t < vocab]] = float("-inf")
    if penalized:
        if histories is None:
            raise ValueError("penalties need each penalized row's history")
        for i in penalized:
            h = histories[i]
            assert h is not None, "a penalized row needs its history"
            apply_penalties(x[i], params[i], h.prompt_token_ids, h.output_token_ids)
    vocab_banned = masked and any(ids and len(ids) >= vocab for ids in banned)  # type: ignore[union-attr]
    if not clean or penalized or vocab_banned:
        x = _choosable(x, logits, broken)
    unmet: dict[int, str] = {}
    if allowed is not None and any(a is not None for a in allowed):
        x = logits.clone() if x is logits else x
        unmet = _constrain(x, logits, allowed)
    if all(p.greedy for p in params):
        chosen = x.argmax(dim=-1)
    else:
        chosen = torch.empty(x.shape[0], dtype=torch.long, device=x.device)
        for i, p in enumerate(params):
            chosen[i] = x[i].argmax() if p.greedy else _sample_row(x[i], p, generators[i])
    ids_and_flags = torch.stack([chosen, broken.long()]).tolist()  # the one host sync
    out = Sampled(ids_and_flags[0])
    if any(ids_and_flags[1]) or unmet:
        out.errors = [BROKEN_ROW if bad else unmet.get(i) for i, bad in enumerate(ids_and_flags[1])]
    if raw_logprobs is not None:
        lps = raw_logprobs.gather(1, chosen[:, None]).squeeze(1).tolist()
        out.logprobs = [lp if p.logprobs else None for lp, p in zip(lps, params)]
        k = max(p.top_logprobs for p in params)
        if k:
            top = torch.topk(raw_logprobs, k, dim=-1)
            top_ids, top_lps = top.indices.tolist(), top.values.tolist()
            out.top_logprobs = [TopLogprobs(top_ids[i][: p.top_logprobs], top_lps[i][: p.top_logprobs])
                                if p.logprobs else None for i, p in enumerate(params)]
    return out


def _constrain(x: torch.Tensor, raw: torch.Tensor, allowed: list[torch.Tensor | None]) -> dict[int, str]:
    """Mask each constrained row of ``x`` (in place) to its allowed tokens; the rows that allow none."""
    unmet: dict[int, str] = {}
    for i, ok in enumerate(allowed):
        if ok is None:
            continue
        ok = ok.to(x.device)
        if ok.shape[0] < x.shape[1]:  # the logits are wider than the tokenizer's vocabulary
            ok = torch.cat([ok, ok.new_zeros(x.shape[1] - ok.shape[0])])
        if not bool(ok.any()):
            unmet[i] = NO_TOKEN
            continue
        row = x[i].masked_fill(~ok, float("-inf"))
        if bool(torch.isneginf(row).all()):  # bans and penalties left none: the allowed ones, as the model has them
            row = torch.nan_to_num(raw[i], nan=float("-inf")).masked_fill(~ok, float("-inf"))
            if bool(torch.isneginf(row).all()):
                row = torch.where(ok, 0.0, float("-inf"))
        x[i] = row
    return unmet


def _broken_rows(logits: torch.Tensor) -> torch.Tensor:
    """[S] bool: rows the model got wrong (a NaN or +inf anywhere, or no finite logit at all)."""
    return (torch.isnan(logits).any(-1) | torch.isposinf(logits).any(-1)
            | torch.isneginf(logits).all(-1))


def _choosable(x: torch.Tensor, raw: torch.Tensor, broken: torch.Tensor) -> torch.Tensor:
    """The logits to choose from, free of NaN and +inf, with at least one finite entry per row.

    Penalties may overflow (a tiny repetition penalty divides a logit into +inf): +inf becomes
    float32's largest value, NaN -inf. A row whose bans and penalties left nothing allowed
    falls back to its raw logits; a broken row becomes uniform (its token is discarded)."""
    big = torch.finfo(torch.float32).max
    x = torch.nan_to_num(x, nan=float("-inf"), posinf=big, neginf=float("-inf"))
    nothing_left = torch.isneginf(x).all(-1, keepdim=True)
    x = torch.where(nothing_left, torch.nan_to_num(raw, nan=float("-inf"), posinf=big, neginf=float("-inf")), x)
    return torch.where(broken[:, None], torch.zeros_like(x), x)


def apply_penalties(row: torch.Tensor, p: SamplingParams, prompt_ids: list[int], output_ids: list[int]) -> None:
    """Penalize one row of logits in place.

    repetition (HF/vLLM): each token seen in the prompt or the output has its logit divided by
    the penalty when positive, multiplied by it when negative (> 1 discourages repeats);
    frequency and presence (OpenAI): ``logit -= frequency * count + presence * (count > 0)``,
    counting the output tokens only.
    """
    if p.repetition_penalty != 1:
        seen = torch.tensor(sorted(set(prompt_ids) | set(output_ids)), dtype=torch.long, device=row.device)
        vals = row[seen]
        row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if output_ids and (p.frequency_penalty != 0 or p.presence_penalty != 0):
        counts = torch.bincount(torch.tensor(output_ids, dtype=torch.long, device=row.device),
                                minlength=row.shape[-1])[: row.shape[-1]].to(row.dtype)
        row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)


def _sample_row(row: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> torch.Tensor:
    """Draw from one finite-maximum row. Shifted so its maximum is 0, the row divided by any
    temperature stays in [-inf, 0]; softmax then gives the best token at least 1/V, and every
    filter below keeps it, so ``multinomial`` always sees finite, non-negative mass."""
    temperature = min(p.temperature, MAX_TEMPERATURE)
    row = (row - row.max()) / temperature
    if 0 < p.top_k < row.shape[-1]:
        kth = torch.topk(row, p.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    probs = torch.softmax(row, dim=-1)
    if p.min_p > 0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    if p.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        cumulative = sorted_probs.cumsum(0)
        # keep the smallest set whose mass reaches top_p (the token that crosses it included)
        drop = cumulative - sorted_probs >= p.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return torch.multinomial(probs, 1, generator=gen).squeeze(0)


def draw_seed(seed: int, position: int) -> int:
    """The seed of the draw for the token at ``position`` of a request seeded with ``seed``.

    A request's randomness is a function of (seed, position) alone, not of which instance
    drew the tokens before: a prefill instance sampling the first token and a decode instance
    sampling the rest give what one engine gives (and a recomputed request draws the same).
    Two rounds of splitmix64, so neighbouring seeds and positions give unrelated streams."""
    return _splitmix64(_splitmix64(seed) ^ position) >> 1  # torch wants it below 2**63 on every device


def _splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)
