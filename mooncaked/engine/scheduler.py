"""Decides what runs each step: continuous batching under a token budget.

Running sequences go first (decodes and the next chunk of a chunked prefill), then
waiting ones are admitted, in order, while the step's token budget, the sequence cap and the
free KV blocks allow. A prompt joins a step that already prefills another only if the step's
prefill tokens stay within ``pack_tokens`` with it: every prompt in a step waits for the whole
step, so packing pays only where a step's fixed cost is large (on a GPU, not on a CPU).

When a running sequence needs a block and none is free, the most recently admitted sequence
is preempted by recompute: its blocks are released (full ones stay in the prefix cache) and it
goes back to the front of the queue.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

from mooncaked.engine.block_manager import BlockManager
from mooncaked.engine.sequence import Sequence, SeqStatus
from mooncaked.hashing import block_local_hash, chain_hash

log = logging.getLogger(__name__)


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """This chunk reaches the sequence's last token, so the step yields a new token for it."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens

    @property
    def prefill_tokens(self) -> int:
        """Tokens of this chunk that are prefill, not a decode's one token."""
        decode = self.num_new_tokens == 1 and self.seq.num_computed_tokens == self.seq.num_tokens - 1
        return 0 if decode else self.num_new_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 pack_tokens: int | None = None) -> None:
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.pack_tokens = max_num_batched_tokens if pack_tokens is None else pack_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    # -- queue --------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def awaiting_input(self) -> bool:
        """Some pipeline-stage sequence cannot go on until its previous stage's next chunk arrives."""
        return any(s.input_ready is not None and s.input_left <= 0 and s.num_uncomputed > 0
                   for s in (*self.running, *self.waiting))

    def finish(self, seq: Sequence, reason: str) -> None:
        """End a sequence wherever it is and give its blocks back (a ``hold_blocks`` sequence keeps
        them when it completed: its KV is still wanted; not when it was aborted or failed)."""
        if seq.finished:
            return
        seq.finish_reason = reason
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED
        if not (seq.hold_blocks and reason not in ("abort", "error")):
            self._release(seq)

    def _release(self, seq: Sequence) -> None:
        if seq.block_table:
            self.bm.release(seq.block_table)
        seq.block_table = []
        if seq.imported_blocks:
            self.bm.release(seq.imported_blocks)
            seq.imported_blocks = []

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.num_computed_tokens = 0
        seq.block_hashes = []
        seq.unkept_blocks = 0  # its imported KV is gone: what it recomputes is its own
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        out.preempted.append(seq)
        log.debug("preempted %s (recompute)", seq.request_id)

    # -- the decision ---------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.input_left, budget)
            if n <= 0 or not self._same_layers(seq, out):  # a stage waiting for its input; another layer range
                i += 1
                continue
            need = self.bm.blocks_needed(seq.num_computed_tokens + n) - len(seq.block_table)
            while need > self.bm.num_free_blocks and self.running[-1] is not seq:
                self._preempt(self.running[-1], out)
            if need > self.bm.num_free_blocks:
                self._preempt(seq, out)
                break
            if need > 0:
                seq.block_table += self.bm.allocate(need)  # type: ignore[operator]
            out.scheduled.append(ScheduledSeq(seq, n))
            budget -= n
            i += 1
        if out.preempted:
            return out
        deferred: list[Sequence] = []
        prefill = sum(s.prefill_tokens for s in out.scheduled)
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.input_ready is not None and seq.input_ready <= seq.imported_tokens:
                deferred.append(self.waiting.popleft())  # a pipeline stage whose first chunk has not arrived
                continue
            if self._prefix_in_flight(seq) or not self._same_layers(seq, out):
                deferred.append(self.waiting.popleft())  # keeps its place; the ones behind it may go
                continue
            room = budget if prefill == 0 else min(budget, self.pack_tokens - prefill)
            if room <= 0 or not self._admit(seq, budget, room, out):
                break
            budget -= out.scheduled[-1].num_new_tokens
            prefill += out.scheduled[-1].prefill_tokens
        self.waiting.extendleft(reversed(deferred))
        return out

    @staticmethod
    def _same_layers(seq: Sequence, out: SchedulerOutput) -> bool:
        """One step runs one layer range (elastic CPP shares of prompts run apart from whole-model work)."""
        return not out.scheduled or out.scheduled[0].seq.layers == seq.layers

    def _prefix_in_flight(self, seq: Sequence) -> bool:
        """Whether a running prefill is computing blocks of ``seq``'s prompt that are not cached yet.

        Admitted now, ``seq`` would compute them a second time in the same steps; waiting costs it
        nothing (the same engine computes them either way) and its admission then hits them in the
        prefix cache, once the other sequence has committed them. Whole blocks only, as the prefix
        cache holds them; the waiting ends when that sequence passes them, finishes or leaves."""
        if not self.bm.enable_prefix_caching or seq.imported_blocks or seq.exact_prefix or seq.params.scored:
            return False
        bs = self.bm.block_size
        tokens = seq.all_token_ids
        limit = (seq.num_tokens - 1) // bs * bs  # as match_prefix: the last token is always computed
        for r in self.running:
            done = r.num_computed_tokens // bs * bs
            prompt = r.prompt_token_ids
            end = min(limit, len(prompt))
            if done >= end:
                continue
            shared = 0  # whole blocks the two prompts share (the first differing block ends it)
            while shared + bs <= end and prompt[shared:shared + bs] == tokens[shared:shared + bs]:
                shared += bs
            if shared > done:
                return True
        return False

    def _admit(self, seq: Sequence, budget: int, room: int, out: SchedulerOutput) -> bool:
        """Admit ``seq`` with a chunk of up to ``budget`` tokens, if what it has left to compute fits in
        ``room`` (what packing leaves it) and its blocks can be had; else leave it waiting as it was."""
        bs = self.bm.block_size
        if seq.imported_blocks or seq.exact_prefix:
            seq.block_table, seq.imported_blocks = seq.imported_blocks, []
            seq.num_computed_tokens = seq.imported_tokens
            self.commit_full_blocks(seq)
            matched: list[int] = []
        else:
            # a scored prompt computes every token: a cached block has no logits to score it with
            limit = 0 if seq.params.scored else (seq.num_tokens - 1) // bs
            matched, hashes = self.bm.match_prefix(seq.all_token_ids, limit)
            seq.block_table = matched
            seq.block_hashes = hashes
            seq.num_computed_tokens = len(matched) * bs
        n = min(seq.input_left, budget)
        # an elastic share of a prompt holds all its blocks from the start: the lead names them to the
        # other stages with its first chunk, and they write their layers of the prompt into them
        upto = len(seq.prompt_token_ids) if seq.layers is not None else seq.num_computed_tokens + n
        need = self.bm.blocks_needed(upto) - len(seq.block_table)
        fresh = self.bm.allocate(need) if need > 0 and n <= room else []
        if fresh is None or n > room:
            # no room, in blocks or in the step: give the prefix blocks back and wait (they stay cached)
            if matched:
                self.bm.release(matched)
                seq.block_table, seq.block_hashes, seq.num_computed_tokens = [], [], 0
            else:
                seq.imported_blocks, seq.block_table = seq.block_table, []
                seq.num_computed_tokens = 0
            return False
        seq.block_table += fresh
        if not seq.admitted_once:
            seq.num_cached_tokens = seq.num_computed_tokens
            seq.admitted_once = True
        self.waiting.popleft()
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)
        out.scheduled.append(ScheduledSeq(seq, n))
        return True

    # -- after the step -------------------------------------------------------------------
    def commit_full_blocks(self, seq: Sequence) -> None:
        """Hash and publish every block whose tokens are now all computed."""
        bs = self.bm.block_size
        tokens = seq.all_token_ids
        parent = seq.block_hashes[-1] if seq.block_hashes else None
        for j in range(len(seq.block_hashes), seq.num_computed_tokens // bs):
            block_tokens = tuple(tokens[j * bs : (j + 1) * bs])
            parent = chain_hash(parent, block_local_hash(block_tokens, self.bm.hash_seed), self.bm.hash_seed)
            if j >= seq.unkept_blocks:  # an unkept block is freed, unpublished, when the sequence ends
                self.bm.commit_full_block(seq.block_table[j], parent, block_tokens)
            seq.block_hashes.append(parent)
