"""Turns last-position logits into next tokens, per request settings, without host syncs
for the all-greedy batch."""

from __future__ import annotations

import torch

from mooncaked.engine.sampling_params import SamplingParams


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
           banned: list[frozenset[int] | None] | None = None) -> tuple[list[int], list[float] | None]:
    """logits: [S, V] float32. Returns the chosen ids and, if any request asked, their log-probs.

    ``banned[i]``: token ids row i may not choose (min_tokens keeps EOS out of reach).
    """
    if banned and any(banned):
        logits = logits.clone()
        for i, ids in enumerate(banned):
            if ids:
                logits[i, list(ids)] = float("-inf")
    want_logprobs = any(p.logprobs for p in params)
    logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
    if all(p.greedy for p in params):
        chosen = logits.argmax(dim=-1)
    else:
        chosen = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
        for i, p in enumerate(params):
            chosen[i] = logits[i].argmax() if p.greedy else _sample_row(logits[i], p, generators[i])
    ids = chosen.tolist()
    lps = None
    if logprobs is not None:
        lps = logprobs.gather(1, chosen[:, None]).squeeze(1).tolist()
    return ids, lps


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
