"""CUDA graphs of the decode step: at small batches a GPU decode step is bound by launching a few
hundred kernels from Python, not by reading the weights; one graph replay launches them all.

A graph is captured once per batch size of ``graph_batch_sizes`` over static input tensors, when
the engine starts (its KV cache still empty). A step of n decodes replays the smallest graph of at
least n rows; the extra rows are copies of row 0 (its token, position, cache slot, length and block
table): they compute row 0's values and write them to row 0's own slot, so no other cache slot is
touched. Graphs run only a step whose sequences all decode one token, with the flash backend (its
decode kernel reads lengths and block tables on the GPU), on a model that is one whole stage, with
no per-layer hook; every other step runs eagerly. Needs CUDA: nothing here runs on a CPU.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from mooncaked.engine.attention.metadata import AttentionMetadata

log = logging.getLogger(__name__)


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to ``max_num_seqs`` (and ``max_num_seqs`` itself)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return sorted(set(sizes + [max_num_seqs]))


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    hidden: torch.Tensor  # [batch, hidden]: the replay's output, overwritten by the next replay


class DecodeGraphs:
    """Captured decode steps of ``model`` over ``kv_layers``; ``run`` replays one (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, kv_layers: list, block_size: int, max_blocks_per_seq: int,
                 max_num_seqs: int, device: torch.device) -> None:
        self.sizes = graph_batch_sizes(max_num_seqs)
        self.max_batch = self.sizes[-1]
        self.max_blocks = max_blocks_per_seq
        n = self.max_batch
        with torch.device(device):
            self.input_ids = torch.zeros(n, dtype=torch.long)
            self.positions = torch.zeros(n, dtype=torch.long)
            self.slots = torch.zeros(n, dtype=torch.long)
            self.context_lens = torch.ones(n, dtype=torch.int32)
            self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32)
            self.cu_seqlens = torch.arange(n + 1, dtype=torch.int32)
        self.block_size = block_size
        self.replays = 0  # steps run by a graph (tests and logs read it)
        self._graphs: dict[int, _Captured] = {}
        pool = None
        for bs in reversed(self.sizes):  # the largest first: the others fit in its memory pool
            meta = self._meta(bs)
            args = (self.input_ids[:bs], self.positions[:bs], kv_layers, meta)
            model(*args)  # warm-up outside the graph (lazy initialisation, autotuning)
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool):
                hidden = model(*args)
            pool = graph.pool() if pool is None else pool
            self._graphs[bs] = _Captured(graph, hidden)
        torch.cuda.synchronize(device)
        log.info("CUDA graphs of the decode step captured for batch sizes %s", self.sizes)

    def _meta(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(slot_mapping=self.slots[:bs], q_lens=[1] * bs, ctx_lens=[1] * bs,
                                 block_tables=self.block_tables[:bs], num_decodes=bs,
                                 cu_seqlens_q=self.cu_seqlens[:bs + 1], cu_seqlens_k=self.cu_seqlens[:bs + 1],
                                 context_lens=self.context_lens[:bs], block_size=self.block_size)

    def fits(self, num_seqs: int, table_width: int) -> bool:
        """Whether a decode step of ``num_seqs`` sequences with block tables this wide has a graph."""
        return num_seqs <= self.max_batch and table_width <= self.max_blocks

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states of a decode step ([n, hidden], valid until the next replay)."""
        n = input_ids.shape[0]
        bs = next(b for b in self.sizes if b >= n)
        width = meta.block_tables.shape[1]
        for static, live in ((self.input_ids, input_ids), (self.positions, positions),
                             (self.slots, meta.slot_mapping), (self.context_lens, meta.context_lens)):
            static[:n] = live
            static[n:bs] = live[0]
        self.block_tables[:n, :width] = meta.block_tables
        self.block_tables[n:bs] = self.block_tables[0]
        captured = self._graphs[bs]
        captured.graph.replay()
        self.replays += 1
        return captured.hidden[:n]
