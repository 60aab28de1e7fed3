"""Turns last-position logits into next tokens, per request settings, without host syncs
for the all-greedy batch.

Order, as vLLM's: log-probs are taken from the raw logits (the model's own distribution, before
min_tokens bans, penalties, temperature or top-k/p/min-p filtering: vLLM's default
``raw_logprobs``), so they mean the same whatever the request's sampling settings; then banned
tokens are masked, penalties applied (repetition, then frequency and presence), and the token is
chosen: argmax when greedy (penalties apply there too, as in HF and vLLM), otherwise temperature,
top-k, min-p, top-p and a draw.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mooncaked.engine.outputs import TopLogprobs
from mooncaked.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class History:
    """The tokens a row's penalties look at."""

    prompt_token_ids: list[int]
    output_token_ids: list[int]


@dataclass
class Sampled:
    """The chosen ids; when any row asked, their log-probs (None elsewhere) and top-k lists."""

    token_ids: list[int]
    logprobs: list[float | None] | None = None
    top_logprobs: list[TopLogprobs | None] | None = None


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
           banned: list[frozenset[int] | None] | None = None,
           histories: list[History | None] | None = None) -> Sampled:
    """logits: [S, V] float32 (not modified).

    ``banned[i]``: token ids row i may not choose (min_tokens keeps EOS out of reach).
    ``histories[i]``: row i's prompt and output so far; needed only for rows with penalties.
    """
    want_logprobs = any(p.logprobs for p in params)
    raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
    masked = bool(banned) and any(banned)  # type: ignore[arg-type]
    penalized = [i for i, p in enumerate(params) if p.penalized]
    if masked or penalized:
        logits = logits.clone()
    if masked:
        for i, ids in enumerate(banned):  # type: ignore[arg-type]
            if ids:
                logits[i, list(ids)] = float("-inf")
    if penalized:
        if histories is None:
            raise ValueError("penalties need each penalized row's history")
        for i in penalized:
            h = histories[i]
            assert h is not None, "a penalized row needs its history"
            apply_penalties(logits[i], params[i], h.prompt_token_ids, h.output_token_ids)
    if all(p.greedy for p in params):
        chosen = logits.argmax(dim=-1)
    else:
        chosen = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
        for i, p in enumerate(params):
            chosen[i] = logits[i].argmax() if p.greedy else _sample_row(logits[i], p, generators[i])
    out = Sampled(chosen.tolist())
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
    row = row / p.temperature
    if p.top_k > 0 and p.top_k < row.shape[-1]:
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
