"""Executes one scheduled step: builds the flat batch, runs the model, samples.

It owns the model and the KV pool; it reads sequences but never changes them (the
engine applies the results).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field

import torch

from mooncaked.engine.attention import AttentionMetadata, make_backend
from mooncaked.engine.bf16_weights import EXACT_ROWS, fp32_step
from mooncaked.engine.config import EngineConfig, ModelConfig
from mooncaked.engine.cuda_graphs import DecodeGraphs
from mooncaked.engine.four_bit import NATIVE_ROWS
from mooncaked.engine.native import native_module
from mooncaked.engine.kv_cache import KVCache
from mooncaked.engine.loader import check_checkpoint, load_weights
from mooncaked.engine.models.llama import LayerHook, LlamaForCausalLM
from mooncaked.engine.outputs import TopLogprobs
from mooncaked.engine.prompt_scores import PromptScores, score_prompts
from mooncaked.engine.precision import Precision, check_supported, cpu_flags, native_bf16
from mooncaked.engine.quant import quantize_model
from mooncaked.engine.sampler import History, draw_seed, sample
from mooncaked.engine.scheduler import ScheduledSeq
from mooncaked.engine.stage import PipelineStage

log = logging.getLogger(__name__)

@dataclass
class StepResult:
    """Tokens sampled this step, keyed by request id (only for sequences that reached their end)."""

    tokens: dict[str, int]
    logprobs: dict[str, float]
    seconds: float
    num_tokens: int
    all_logits: dict[str, torch.Tensor]
    top_logprobs: dict[str, TopLogprobs]
    errors: dict[str, str] = field(default_factory=dict)  # requests whose token could not be sampled, and why
    # a pipeline stage that is not the last: each request's hidden states of this step's tokens
    hidden_out: dict[str, torch.Tensor] = field(default_factory=dict)
    prompt_scores: dict[str, PromptScores] = field(default_factory=dict)  # scored prompts' rows of this step


def stage_config(cfg: ModelConfig, stage: PipelineStage) -> ModelConfig:
    """``cfg`` as this stage's KV cache sees it: only the stage's layers."""
    return dataclasses.replace(cfg, num_layers=stage.num_stage_layers)


class ModelRunner:
    def __init__(self, model_cfg: ModelConfig, engine_cfg: EngineConfig, model_dir, precision: Precision,
                 num_blocks: int, max_model_len: int, kv_pool: torch.Tensor | None = None,
                 stage: PipelineStage | None = None) -> None:
        self.cfg = model_cfg
        check_supported(precision, torch.device(engine_cfg.device), cpu_flags())  # before any weight is read
        self.stage = stage or PipelineStage.of(0, 1, model_cfg.num_layers)
        self.device = torch.device(engine_cfg.device)
        self.dtype = dtype = precision.dtype
        self.block_size = engine_cfg.block_size
        self.exact_small_steps = engine_cfg.exact_small_steps
        self.eos_token_ids: frozenset[int] = frozenset(model_cfg.eos_token_ids)
        scale = model_cfg.head_dim ** -0.5
        self.backend = make_backend(engine_cfg.attention_backend, self.device, self.block_size,
                                    model_cfg.num_heads, model_cfg.num_kv_heads, model_cfg.head_dim, scale)
        check_checkpoint(model_cfg, model_dir)  # before a model of the config's size is allocated
        with torch.device(self.device):
            self.model = LlamaForCausalLM(model_cfg, self.backend, max_model_len, self.stage).to(dtype)
        self.model.rope.float()
        if self.device.type == "cpu":  # fp32 norms and rotary in one pass a row (built once per machine)
            self.model.use_native(native_module())
        load_weights(self.model, model_cfg, model_dir, dtype)
        if precision.weights != "none":
            # torch's int4 kernel is fast only where the CPU multiplies bf16 natively (engine/four_bit.py)
            four_bit_head = self.device.type == "cpu" and native_bf16(cpu_flags())
            n = quantize_model(self.model, precision.weights, four_bit_head=four_bit_head,
                               exact_small_steps=engine_cfg.exact_small_steps)
            log.info("model runner: %d linear layers hold %s weights", n, precision.weights)
        self.model.eval()
        self.kv = KVCache.allocate(stage_config(model_cfg, self.stage), num_blocks, self.block_size, dtype,
                                   self.device, kv_pool)
        self.kv_layers = self.kv.layers()
        self.graphs: DecodeGraphs | None = None
        if (engine_cfg.cuda_graphs and self.device.type == "cuda" and self.backend.name == "flash"
                and self.stage.is_first and self.stage.is_last):
            with torch.inference_mode():  # as run() replays them
                self.graphs = DecodeGraphs(self.model, self.kv_layers, self.block_size,
                                           -(-max_model_len // self.block_size), engine_cfg.max_num_seqs, self.device)
        log.info("model runner: %s on %s (%s, %s weights: %s), attention=%s", model_cfg.architecture, self.device,
                 dtype, precision.weights, precision.reason, self.backend.name)

    @torch.inference_mode()
    def run(self, batch: list[ScheduledSeq], layer_hook: LayerHook | None = None,
            all_logits: bool = False, hidden_in: dict[str, torch.Tensor] | None = None) -> StepResult:
        """One forward over the batch. ``all_logits`` also returns every new position's logits
        per request (for scoring and tests), at the cost of the full vocabulary projection.
        ``hidden_in``: a pipeline stage's input, each request's hidden states of its new tokens."""
        t0 = time.perf_counter()
        # decodes first, so backends see two contiguous slices
        batch = sorted(batch, key=lambda s: s.num_new_tokens != 1)
        input_ids, positions, slots, meta = self._prepare(batch)
        layers = batch[0].seq.layers  # the scheduler steps one layer range at a time
        if any(s.seq.layers != layers for s in batch):
            raise ValueError("one step runs sequences of one layer range")
        x_in = None
        if not self.takes_tokens(layers):
            rows = hidden_in or {}
            missing = [s.seq.request_id for s in batch if s.seq.request_id not in rows]
            if missing:
                raise ValueError(f"stage {self.stage}: no input hidden states for {missing}")
            x_in = torch.cat([rows[s.seq.request_id] for s in batch]).to(self.device, self.dtype)
        # a small step (a lone short prompt, a few decodes) multiplies in fp32 where the layers can (bf16_weights)
        small = self.exact_small_steps and len(batch) <= NATIVE_ROWS and input_ids.shape[0] <= EXACT_ROWS
        if self._graphed(batch, meta, layer_hook, layers):
            hidden = self.graphs.run(input_ids, positions, meta)  # type: ignore[union-attr]
        else:
            with fp32_step(small):
                hidden = self.model(input_ids, positions, self.kv_layers, meta, layer_hook, x_in, layers)
        if not self.samples(layers):
            bounds = meta.cu_seqlens_q.tolist()
            out = {s.seq.request_id: hidden[bounds[k]:bounds[k + 1]] for k, s in enumerate(batch)}
            return StepResult({}, {}, time.perf_counter() - t0, int(input_ids.shape[0]), {}, {}, hidden_out=out)
        samplers = [s for s in batch if s.samples]
        tokens: dict[str, int] = {}
        logprobs: dict[str, float] = {}
        tops: dict[str, TopLogprobs] = {}
        errors: dict[str, str] = {}
        if samplers:
            last = torch.tensor(
                [i for i, s in zip(meta.cu_seqlens_q[1:].tolist(), batch) if s.samples], device=self.device
            ) - 1
            logits = self.model.compute_logits(hidden[last])
            params = [s.seq.params for s in samplers]
            gens = [self._generator_for(s) for s in samplers]
            # min_tokens: the (EOS and model-specific) stop ids cannot be chosen yet
            banned = [(s.seq.stop_ids | self.eos_token_ids) if len(s.seq.output_token_ids) < s.seq.params.min_tokens
                      else None for s in samplers]
            histories = [History(s.seq.prompt_token_ids, s.seq.output_token_ids) if s.seq.params.penalized
                         else None for s in samplers]
            # structured outputs: each constrained row's allowed tokens (the engine made its Constraint)
            allowed = [s.seq.constraint.allowed() if s.seq.constraint is not None else None for s in samplers]
            out = sample(logits, params, gens, banned, histories, allowed)
            for k, s in enumerate(samplers):
                rid = s.seq.request_id
                broken = s.seq.constraint.error if s.seq.constraint is not None else None
                if broken is not None or (out.errors is not None and out.errors[k] is not None):
                    errors[rid] = broken or out.errors[k]  # type: ignore[index]
                    continue
                tokens[rid] = out.token_ids[k]
                if out.logprobs is not None and out.logprobs[k] is not None:
                    logprobs[rid] = out.logprobs[k]
                if out.top_logprobs is not None and out.top_logprobs[k] is not None:
                    tops[rid] = out.top_logprobs[k]
        scores = score_prompts(self.model, batch, hidden, meta.cu_seqlens_q.tolist(), self.device)
        full: dict[str, torch.Tensor] = {}
        if all_logits:
            bounds = meta.cu_seqlens_q.tolist()
            for k, s in enumerate(batch):
                full[s.seq.request_id] = self.model.compute_logits(hidden[bounds[k] : bounds[k + 1]])
        return StepResult(tokens, logprobs, time.perf_counter() - t0, int(input_ids.shape[0]), full, tops, errors,
                          prompt_scores=scores)

    def _graphed(self, batch: list[ScheduledSeq], meta: AttentionMetadata, layer_hook: LayerHook | None,
                 layers: tuple[int, int] | None) -> bool:
        """Whether this step replays a CUDA graph: every sequence decodes, the whole model, no hook."""
        return (self.graphs is not None and meta.num_decodes == len(batch) and layer_hook is None
                and self.takes_tokens(layers) and self.samples(layers)
                and self.graphs.fits(len(batch), meta.block_tables.shape[1]))

    def takes_tokens(self, layers: tuple[int, int] | None) -> bool:
        """Whether a step over ``layers`` starts from token ids (else from the previous stage's hidden states)."""
        return self.stage.is_first and (layers is None or layers[0] == 0)

    def samples(self, layers: tuple[int, int] | None) -> bool:
        """Whether a step over ``layers`` ends in the head (else it hands hidden states on)."""
        return self.stage.is_last and (layers is None or layers[1] == self.stage.num_stage_layers)

    @staticmethod
    def _generator_for(s: ScheduledSeq) -> torch.Generator | None:
        """A seeded request's generator, set for the token this step samples: the draw depends on
        (seed, position) only, so the instance that samples it does not matter."""
        gen = s.seq.generator
        if gen is not None and s.seq.params.seed is not None:
            gen.manual_seed(draw_seed(s.seq.params.seed, s.seq.num_tokens))
        return gen

    def _prepare(self, batch: list[ScheduledSeq]):
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        q_lens: list[int] = []
        ctx_lens: list[int] = []
        tables: list[list[int]] = []
        for s in batch:
            seq, n = s.seq, s.num_new_tokens
            start = seq.num_computed_tokens
            tokens = seq.all_token_ids
            ids += tokens[start : start + n]
            pos += range(start, start + n)
            table = seq.block_table
            slots += [table[p // bs] * bs + p % bs for p in range(start, start + n)]
            q_lens.append(n)
            ctx_lens.append(start + n)
            tables.append(table)
        width = max(len(t) for t in tables)
        padded = [t + [0] * (width - len(t)) for t in tables]
        dev = self.device
        cu_q = [0]
        cu_k = [0]
        for q, c in zip(q_lens, ctx_lens):
            cu_q.append(cu_q[-1] + q)
            cu_k.append(cu_k[-1] + c)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            q_lens=q_lens,
            ctx_lens=ctx_lens,
            block_tables=torch.tensor(padded, dtype=torch.int32, device=dev),
            num_decodes=sum(1 for q in q_lens if q == 1),
            cu_seqlens_q=torch.tensor(cu_q, dtype=torch.int32, device=dev),
            cu_seqlens_k=torch.tensor(cu_k, dtype=torch.int32, device=dev),
            context_lens=torch.tensor(ctx_lens, dtype=torch.int32, device=dev),
            block_size=bs,
        )
        return (torch.tensor(ids, dtype=torch.long, device=dev), torch.tensor(pos, dtype=torch.long, device=dev),
                slots, meta)
