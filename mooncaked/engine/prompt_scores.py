"""Scoring a prompt (``SamplingParams.prompt_logprobs``, OpenAI's echo with logprobs): each prompt token's
log-prob given the tokens before it, taken from the rows a step computes, and kept on the sequence.

The runner scores a step's rows (``score_prompts``); the engine keeps them (``keep_scores``). A scored
prompt is computed whole (the scheduler matches no prefix for it), since a reused block has no logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mooncaked.engine.outputs import TopLogprobs
from mooncaked.engine.scheduler import ScheduledSeq
from mooncaked.engine.sequence import Sequence

# rows go through the head this many at a time: a whole 8k-token chunk at once would hold 8k x vocab fp32
# logits (1.6 GB for a 49k vocabulary)
SCORE_ROWS = 256


@dataclass
class PromptScores:
    """Log-probs of prompt tokens ``start + 1 ..`` given the tokens before each (one step's rows)."""

    start: int  # the position whose logits give ``logprobs[0]`` (prompt token ``start + 1``)
    logprobs: list[float]
    top: list[TopLogprobs] | None  # with prompt_logprobs > 0: the most likely tokens at each position


def score_prompts(model, batch: list[ScheduledSeq], hidden: torch.Tensor, bounds: list[int],
                  device: torch.device) -> dict[str, PromptScores]:
    """For each scored sequence, the log-prob of every prompt token this step's rows predict (the row at
    position p predicts token p + 1), from the raw model distribution, as the sampled tokens' are, through
    ``model.score_logits`` (the head's fp32 weights where it keeps them: a score must not depend on how
    the prompt's steps were cut). ``bounds``: each sequence's first row in ``hidden``."""
    out: dict[str, PromptScores] = {}
    for k, s in enumerate(batch):
        seq = s.seq
        if not seq.params.scored:
            continue
        start = seq.num_computed_tokens
        end = min(start + s.num_new_tokens, len(seq.prompt_token_ids) - 1)  # the last row predicts no prompt token
        if end <= start:
            continue
        targets = torch.tensor(seq.prompt_token_ids[start + 1: end + 1], device=device)
        want = seq.params.prompt_logprobs or 0
        lps: list[float] = []
        tops: list[TopLogprobs] = []
        for a in range(0, end - start, SCORE_ROWS):
            b = min(a + SCORE_ROWS, end - start)
            rows = torch.log_softmax(model.score_logits(hidden[bounds[k] + a: bounds[k] + b]), dim=-1)
            lps += rows.gather(1, targets[a:b, None]).squeeze(1).tolist()
            if want:
                top = torch.topk(rows, want, dim=-1)
                tops += [TopLogprobs(i, v) for i, v in zip(top.indices.tolist(), top.values.tolist())]
        out[seq.request_id] = PromptScores(start, lps, tops if want else None)
    return out


def keep_scores(seq: Sequence, scores: PromptScores) -> None:
    """Append a step's scores to the sequence; rows a recompute (after preemption) scored again are skipped."""
    skip = len(seq.prompt_logprobs) - scores.start
    if skip < 0:
        raise RuntimeError(f"{seq.request_id}: prompt rows {len(seq.prompt_logprobs)}..{scores.start} were not scored")
    seq.prompt_logprobs += scores.logprobs[skip:]
    if scores.top is not None:
        seq.prompt_top_logprobs += scores.top[skip:]
