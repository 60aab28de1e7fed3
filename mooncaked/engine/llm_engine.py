"""The engine: the stable Python API over scheduler + model runner.

``Engine.from_pretrained(...)``, ``engine.generate(prompts, params)`` and
``async for out in engine.stream(prompt, params)`` are what the daemon, the tests and
users' scripts call. A step is: take new requests, schedule, run, apply the results.
Requests may be added from any thread; whoever steps serves every request.

No request can stop the engine: an exception in a step fails that step's requests (each gets
finish_reason "error" and the reason in ``Output.error``) and the next step goes on. Should the
driver die anyway (a bug), every waiting request gets an error at once, ``driver_failure`` says
why, and ``on_driver_death`` tells the owner (the daemon reports itself dead and exits).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from mooncaked.engine.block_manager import BlockManager
from mooncaked.engine.config import EngineConfig, parse_dtype
from mooncaked.engine.driver import Driver
from mooncaked.engine.precision import cpu_flags, pick_precision
from mooncaked.engine.prompt_scores import keep_scores
from mooncaked.engine.kv_cache import bytes_per_block, plan_num_blocks
from mooncaked.engine.loader import read_model_config, resolve_model_dir
from mooncaked.engine.grammar import Constraint
from mooncaked.engine.model_runner import ModelRunner, stage_config
from mooncaked.engine.outputs import Output, TopLogprobs
from mooncaked.engine.sampling_params import RequestError, SamplingParams
from mooncaked.engine.scheduler import ScheduledSeq, Scheduler
from mooncaked.engine.sequence import Sequence
from mooncaked.engine.stage import PipelineStage
from mooncaked.engine.step_records import EngineStats, HiddenSink, HiddenSource, StepHook, StepRecord, StepSeq
from mooncaked.engine.tokenizer import IncrementalDetokenizer, Tokenizer

log = logging.getLogger(__name__)

Prompt = str | list[int]
Sink = Callable[[Output], None]


class EngineStoppedError(RuntimeError):
    """The engine's driver died: it takes no more requests (its process should be restarted)."""


@dataclass
class _Request:
    seq: Sequence
    detok: IncrementalDetokenizer
    sink: Sink


@dataclass
class _FirstToken:
    """A prefilled request entering decode with the token its prefill instance sampled."""

    req: _Request
    token: int
    logprob: float | None
    top: TopLogprobs | None


# the finish_reason of a pipeline stage (not the last) that computed its layers of the whole prompt
PREFILLED = "prefilled"


class Engine:
    def __init__(self, model_dir: Path, config: EngineConfig,
                 kv_pool_alloc: Callable[[int], torch.Tensor] | None = None,
                 executor: concurrent.futures.ThreadPoolExecutor | None = None) -> None:
        """``kv_pool_alloc(nbytes)`` lets the caller provide the KV pool's memory (e.g. a region the
        transfer engine registered, shared memory for same-host peers). ``executor``: the thread this
        engine is being built on, which then runs its async steps (engine/engine_thread.py says why;
        default: a new one, started with the driver)."""
        self.model_dir = model_dir
        self.config = config
        self.model_config, _ = read_model_config(model_dir)
        self.tokenizer = Tokenizer(model_dir)
        device = torch.device(config.device)
        self.precision = pick_precision(config.dtype, config.quantize, device, self.model_config.dtype, cpu_flags())
        self.dtype = self.precision.dtype
        limit = self.model_config.max_position_embeddings
        if self.model_config.sliding_window:
            # we do not implement windowed attention: stay inside the window, where it is exact
            limit = min(limit, self.model_config.sliding_window)
        self.max_model_len = min(config.max_model_len or limit, limit)
        k, n = config.pipeline_stage or (0, 1)
        self.stage = PipelineStage.of(k, n, self.model_config.num_layers)
        kv_cfg = stage_config(self.model_config, self.stage)  # the KV cache holds this stage's layers only
        num_blocks = plan_num_blocks(kv_cfg, config.block_size, self.dtype, device,
                                     config.kv_cache_bytes, config.gpu_memory_fraction)
        pool = None
        if kv_pool_alloc is not None:
            pool = kv_pool_alloc(num_blocks * bytes_per_block(kv_cfg, config.block_size, self.dtype))
        self.runner = ModelRunner(self.model_config, config, model_dir, self.precision, num_blocks, self.max_model_len,
                                  pool, self.stage)
        self.block_manager = BlockManager(num_blocks, config.block_size, config.hash_seed,
                                          config.enable_prefix_caching, record_events=config.record_kv_events)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.step_tokens,
                                   config.pack_tokens)
        self.eos_token_ids = frozenset(self._eos_ids())
        self.runner.eos_token_ids = self.eos_token_ids
        # called on the engine thread after each layer wrote its KV for the step's tokens
        self.layer_hook: StepHook | None = None
        # a pipeline stage's input (not the first stage) and output (not the last); engine thread
        self.hidden_source: HiddenSource | None = None
        self.hidden_sink: HiddenSink | None = None
        self.starved = False  # the last step found only pipeline stages waiting for input (driver.py)
        self._held: dict[str, Sequence] = {}
        self.step_log: collections.deque[StepRecord] = collections.deque(maxlen=512)
        self._requests: dict[str, _Request] = {}
        self._inbox: collections.deque[_Request] = collections.deque()
        self._aborts: collections.deque[str] = collections.deque()
        self._step_lock = threading.Lock()
        self._driver = Driver(self, executor, self._driver_died)
        self._prefill_tokens = 0
        self._cached_tokens = 0
        self._decode_tokens = 0
        self._steps = 0
        # set once, if the driver dies of something the step's own error handling did not catch
        self.driver_failure: BaseException | None = None
        # called on the driver's event loop when it dies; the daemon reports itself dead and exits
        self.on_driver_death: Callable[[BaseException], None] | None = None

    # -- construction -------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, model: str | Path | None = "default", device: str = "cpu",
                        dtype: str | torch.dtype | None = None, block_size: int = 16,
                        kv_cache_bytes: int | None = None, cache_dir: Path | None = None,
                        kv_pool_alloc: Callable[[int], torch.Tensor] | None = None,
                        executor: concurrent.futures.ThreadPoolExecutor | None = None,
                        **engine_kwargs) -> "Engine":
        """Load ``model`` ("default", an HF folder or a .gguf file) from disk; nothing is downloaded."""
        model_dir = resolve_model_dir(model, cache_dir)
        cfg = EngineConfig(device=device, dtype=parse_dtype(dtype),
                           block_size=block_size, kv_cache_bytes=kv_cache_bytes, **engine_kwargs)
        return cls(model_dir, cfg, kv_pool_alloc, executor)

    def _eos_ids(self) -> set[int]:
        ids = set(self.model_config.eos_token_ids)
        gen = self.model_dir / "generation_config.json"
        if gen.is_file():
            import json

            eos = json.loads(gen.read_text()).get("eos_token_id")
            ids |= set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    # -- requests -------------------------------------------------------------------------
    def tokenize(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
        if not ids:
            raise RequestError("the prompt is empty")
        vocab = self.model_config.vocab_size
        if any((not isinstance(t, int)) or t < 0 or t >= vocab for t in ids):
            raise RequestError(f"prompt token ids must be integers in [0, {vocab})")
        return ids

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None,
                    sink: Sink | None = None, imported_blocks: list[int] | None = None,
                    hold_blocks: bool = False, stage_input: int | None = None, keep_imported: bool = True,
                    layers: tuple[int, int] | None = None, constraint: Constraint | None = None) -> str:
        """Queue a request; thread-safe.

        ``imported_blocks``: KV blocks the caller already filled with this prompt's first
        ``len(imported_blocks) * block_size`` tokens (incremental prefill: only the rest is
        computed). ``hold_blocks``: keep the blocks after the request finishes, until
        ``release(request_id)`` (a prefill instance still pushing that KV elsewhere).
        ``keep_imported=False``: use the imported blocks for this request only; those not already in
        the prefix cache are not published there and are freed with the request (KV pulled from a
        peer for a prefix that is not hot: it stays the peer's).

        On a pipeline stage the request starts exactly after ``imported_blocks`` (its group agreed
        on that prefix); ``stage_input``: the tokens whose input hidden states have arrived (a stage
        that is not the first; ``set_stage_input`` moves it on).

        ``constraint``: the request's grammar state, made beforehand off the engine thread
        (``constraint_for``); without one, a request with a grammar makes it when it first samples.

        ``layers`` (elastic CPP, a whole-model engine lent a share of one prompt): compute only layers
        [first, end) of it, from the token ids when first is 0 and else from ``stage_input``'s hidden
        states, sampling only when end is the last layer. Like a stage's, it starts exactly after
        ``imported_blocks``; its new blocks hold only these layers, so none is published (a lead
        publishes them with ``publish_held`` once the other stages filled the rest).
        """
        params = params or SamplingParams()
        params.validate()
        ids = self.tokenize(prompt)
        imported = list(imported_blocks or [])
        if imported and len(imported) * self.config.block_size >= len(ids):
            raise RequestError("imported blocks must leave at least one prompt token to compute")
        if params.scored and (imported or layers is not None):
            raise RequestError("prompt_logprobs needs the whole prompt computed through every layer here: "
                               "no imported KV blocks, no share of layers")
        staged = self.stage.count > 1
        unkept = 0 if keep_imported else len(imported)
        if layers is not None:
            layers = self._check_layers(layers, stage_input)
            staged, unkept = True, -(-len(ids) // self.config.block_size)
        elif staged and (stage_input is None) != self.stage.is_first:
            raise RequestError(f"stage {self.stage}: stage_input is required exactly on stages after the first")
        seq = Sequence(request_id or uuid.uuid4().hex, ids, params, imported_blocks=imported,
                       imported_tokens=len(imported) * self.config.block_size, hold_blocks=hold_blocks,
                       exact_prefix=staged, input_ready=stage_input, unkept_blocks=unkept, layers=layers)
        seq.constraint = constraint
        return self._enqueue(seq, sink)

    def _check_layers(self, layers: tuple[int, int], stage_input: int | None) -> tuple[int, int]:
        first, end = (int(v) for v in layers)
        n = self.model_config.num_layers
        if self.stage.count > 1:
            raise RequestError(f"stage {self.stage} holds part of the model; a layer range needs a whole-model engine")
        if not 0 <= first < end <= n or (first, end) == (0, n):
            raise RequestError(f"layer range {first}-{end} must be a part of the model's {n} layers")
        if (stage_input is None) != (first == 0):
            raise RequestError("stage_input is required exactly on a layer range that does not start at layer 0")
        return first, end

    def publish_held(self, request_id: str) -> int:
        """Publish the full blocks of a finished ``hold_blocks`` request that computed part of the layers
        (an elastic lead), once the other stages wrote the rest into them; engine thread (``call``). The
        number of blocks the prefix cache now has from it."""
        with self._step_lock:
            seq = self._held.get(request_id)
            if seq is None or not seq.block_table:
                return 0
            seq.unkept_blocks, seq.block_hashes = 0, []  # commit every full block again, this time published
            self.scheduler.commit_full_blocks(seq)
            return len(seq.block_hashes)

    def set_stage_input(self, request_id: str, ready_tokens: int) -> bool:
        """The previous stage's hidden states of the request's first ``ready_tokens`` tokens have
        arrived; thread-safe. False: no such request (it ended or never came)."""
        req = self._requests.get(request_id)
        if req is None or req.seq.input_ready is None:
            return False
        req.seq.input_ready = max(req.seq.input_ready, ready_tokens)
        self._wake_if_driven()
        return True

    def add_prefilled(self, request_id: str, prompt_token_ids: list[int], first_token: int, blocks: list[int],
                      params: SamplingParams, sink: Sink, first_logprob: float | None = None,
                      first_top: TopLogprobs | None = None, constraint: Constraint | None = None) -> str:
        """Continue a request whose prompt KV already sits in ``blocks`` (from ``reserve``) and whose
        first token was sampled elsewhere: the decode side of disaggregation. Thread-safe.

        ``first_logprob``/``first_top``: what the prefill's sampler said of that token, so the
        stream's log-probs start with it."""
        params.validate()
        ids = self.tokenize(prompt_token_ids)
        if len(blocks) != self.block_manager.blocks_needed(len(ids)):
            raise RequestError(f"{len(blocks)} blocks cannot hold exactly {len(ids)} prompt tokens")
        seq = Sequence(request_id, ids, params, imported_blocks=list(blocks), imported_tokens=len(ids))
        seq.admitted_once = True
        seq.constraint = constraint  # made from no tokens: the first one is consumed as it is appended
        req = self._make(seq, sink)
        # the first token goes out at once and may already end the request
        self._requests[seq.request_id] = req
        self._inbox.append(_FirstToken(req, first_token, first_logprob, first_top))
        self._wake_if_driven()
        return request_id

    def _enqueue(self, seq: Sequence, sink: Sink | None) -> str:
        req = self._make(seq, sink)
        self._requests[seq.request_id] = req
        self._inbox.append(req)
        self._wake_if_driven()
        return seq.request_id

    def _make(self, seq: Sequence, sink: Sink | None) -> _Request:
        n = len(seq.prompt_token_ids)
        if n >= self.max_model_len:
            raise RequestError(
                f"the prompt has {n} tokens; this model serves at most {self.max_model_len - 1} "
                "prompt tokens (its context length less one for the answer)"
            )
        capacity = self.block_manager.num_blocks * self.config.block_size
        if n + 1 > capacity:
            raise RequestError(f"the prompt needs {n + 1} KV slots; the cache holds {capacity}")
        if self.driver_failure is not None:
            raise EngineStoppedError(f"the engine stopped ({self.driver_failure!r}); it takes no new requests")
        if seq.request_id in self._requests:
            raise RequestError(f"request id {seq.request_id!r} is already in use")
        params = seq.params
        if params.seed is not None:
            seq.generator = torch.Generator(device=self.runner.device).manual_seed(params.seed)
        eos = frozenset() if params.ignore_eos else self.eos_token_ids
        seq.stop_ids = eos | frozenset(params.stop_token_ids)
        detok = IncrementalDetokenizer(self.tokenizer, list(params.stop), params.skip_special_tokens)
        return _Request(seq, detok, sink or (lambda out: None))

    def _wake_if_driven(self) -> None:
        self._driver.wake()

    # -- KV handed between instances (run these on the engine thread: see ``call``) ---------
    def reserve(self, num_tokens: int) -> list[int] | None:
        """Blocks for ``num_tokens`` tokens of KV that another instance will write; None if no room."""
        with self._step_lock:
            return self.block_manager.allocate(self.block_manager.blocks_needed(num_tokens))

    def unreserve(self, blocks: list[int]) -> None:
        with self._step_lock:
            self.block_manager.release(blocks)

    def release(self, request_id: str) -> None:
        """Give back the blocks a finished ``hold_blocks`` request kept."""
        with self._step_lock:
            seq = self._held.pop(request_id, None)
            if seq is not None and seq.block_table:
                self.block_manager.release(seq.block_table)
                seq.block_table = []

    async def call(self, fn, *args):
        """Run ``fn(*args)`` on the engine thread, between steps (the block manager is not thread-safe).
        Works after the driver died too (bookkeeping such as giving blocks back)."""
        loop = asyncio.get_running_loop()
        self.start_driver(loop)
        return await loop.run_in_executor(self._driver.thread(), fn, *args)

    def abort(self, request_id: str) -> None:
        """Stop a request (a client went away); its blocks are freed at the next step. Thread-safe."""
        self._aborts.append(request_id)
        self._wake_if_driven()

    def abort_all(self) -> None:
        """Stop every request (a daemon past its drain timeout). Thread-safe."""
        for rid in list(self._requests):
            self.abort(rid)

    def has_work(self) -> bool:
        return bool(self._inbox or self._aborts or self.scheduler.has_work())

    # -- the step -------------------------------------------------------------------------
    def step(self) -> list[Output]:
        """One step. An exception outside the model run (which fails only its own requests)
        means the engine's bookkeeping went wrong: every request is failed, the engine goes on
        empty. If even that fails, the exception is raised (and a driver dies of it)."""
        with self._step_lock:
            try:
                return self._step()
            except Exception as e:
                log.exception("engine step failed; failing every request")
                return self._fail_all(f"the engine step failed: {e!r}")

    def _step(self) -> list[Output]:
        outputs: list[Output] = []
        while self._inbox:
            item = self._inbox.popleft()
            if isinstance(item, _FirstToken):
                self.scheduler.add(item.req.seq)
                self._append_token(item.req, item.token, item.logprob, item.top, outputs)
            else:
                self.scheduler.add(item.seq)
        while self._aborts:
            req = self._requests.get(self._aborts.popleft())
            if req is not None and not req.seq.finished:
                self.scheduler.finish(req.seq, "abort")
                outputs.append(self._emit(req, []))
        plan = self.scheduler.schedule()
        for seq in plan.preempted:
            if seq.exact_prefix:  # its group computes from one agreed prefix: it cannot start over alone
                self._fail(self._requests[seq.request_id], "preempted for KV room, which a pipeline stage cannot "
                                                           "recompute", outputs)
        self.starved = not plan.scheduled and not outputs and self.scheduler.awaiting_input()
        if not plan.scheduled:
            return outputs
        hook = None
        if self.layer_hook is not None:
            held = len(self.runner.model.layers)
            info = [StepSeq(s.seq.request_id, list(s.seq.block_table), s.seq.num_computed_tokens, s.num_new_tokens,
                            s.samples and not s.seq.output_token_ids,
                            (s.seq.layers[1] if s.seq.layers is not None else held) - 1) for s in plan.scheduled]
            user_hook = self.layer_hook
            hook = lambda layer, meta: user_hook(layer, info)  # noqa: E731
        for s in plan.scheduled:  # a grammar's state, before its first sampled token
            if s.samples and s.seq.params.grammar is not None and self.runner.samples(s.seq.layers):
                self._constraint(s.seq)
        try:
            hidden_in = self._stage_inputs(plan.scheduled)
            result = self.runner.run(plan.scheduled, hook, hidden_in=hidden_in)
            if self.hidden_sink is not None and not self.runner.samples(plan.scheduled[0].seq.layers):
                for s in plan.scheduled:
                    self.hidden_sink(s.seq.request_id, s.seq.num_computed_tokens, result.hidden_out[s.seq.request_id])
        except Exception as e:
            # a model run that raised (out of memory, a layer hook's push failing, a bug) fails the
            # requests it ran, not the engine: their blocks go back and the next step runs
            log.exception("model run failed for %d requests", len(plan.scheduled))
            for s in plan.scheduled:
                self._fail(self._requests[s.seq.request_id], f"the model run failed: {e!r}", outputs)
            return outputs
        self._steps += 1
        self._record(plan.scheduled, result.seconds)
        for s in plan.scheduled:
            rid = s.seq.request_id
            if rid in result.errors:
                log.error("request %s failed: %s", rid, result.errors[rid])
                self._fail(self._requests[rid], result.errors[rid], outputs)
                continue
            scores = result.prompt_scores.get(rid)
            if scores is not None:
                keep_scores(s.seq, scores)
            self._apply(s, result.tokens.get(rid), result.logprobs.get(rid), result.top_logprobs.get(rid), outputs)
        return outputs

    def _stage_inputs(self, scheduled: list[ScheduledSeq]) -> dict[str, torch.Tensor] | None:
        if self.runner.takes_tokens(scheduled[0].seq.layers):
            return None
        if self.hidden_source is None:
            raise RuntimeError(f"stage {self.stage} has no source of input hidden states")
        return {s.seq.request_id: self.hidden_source(s.seq.request_id, s.seq.num_computed_tokens, s.num_new_tokens)
                for s in scheduled}

    def _fail(self, req: _Request, why: str, outputs: list[Output]) -> None:
        """End one request with finish_reason "error"; its blocks go back (its KV is not published)."""
        self.scheduler.finish(req.seq, "error")
        outputs.append(self._emit(req, [], error=why))

    def _fail_all(self, why: str) -> list[Output]:
        outputs: list[Output] = []
        self._inbox.clear()
        self._aborts.clear()
        for req in list(self._requests.values()):
            if not req.seq.finished:
                self._fail(req, why, outputs)
        return outputs

    def _record(self, scheduled: list[ScheduledSeq], seconds: float) -> None:
        prefill = decodes = context = 0
        for s in scheduled:
            s.seq.compute_s += seconds
            if s.num_new_tokens == 1 and s.seq.output_token_ids:
                decodes += 1
                context += s.seq.num_computed_tokens + 1
            else:
                prefill += s.num_new_tokens
        self.step_log.append(StepRecord(prefill, decodes, context, seconds))

    def drain_step_log(self) -> list[StepRecord]:
        """The steps recorded since the last call (thread-safe: deque pops are atomic)."""
        out = []
        while self.step_log:
            out.append(self.step_log.popleft())
        return out

    def _apply(self, s: ScheduledSeq, token: int | None, logprob: float | None, top: TopLogprobs | None,
               outputs: list[Output]) -> None:
        seq = s.seq
        prompt_left = max(0, len(seq.prompt_token_ids) - seq.num_computed_tokens)
        self._prefill_tokens += min(prompt_left, s.num_new_tokens)
        seq.num_computed_tokens += s.num_new_tokens
        self.scheduler.commit_full_blocks(seq)
        if token is None:
            if not self.runner.samples(seq.layers) and seq.num_computed_tokens >= len(seq.prompt_token_ids):
                self._finish_stage(self._requests[seq.request_id], outputs)
            return
        req = self._requests[seq.request_id]
        if not seq.output_token_ids:
            self._cached_tokens += seq.num_cached_tokens
        self._append_token(req, token, logprob, top, outputs)

    def _finish_stage(self, req: _Request, outputs: list[Output]) -> None:
        """A pipeline stage (not the last) computed its layers of the whole prompt: the request ends
        here with no token (the last stage samples it), its blocks held while its KV is pushed."""
        seq = req.seq
        self._cached_tokens += seq.num_cached_tokens
        self.scheduler.finish(seq, PREFILLED)
        if seq.hold_blocks and seq.block_table:
            self._held[seq.request_id] = seq
        outputs.append(self._emit(req, []))

    async def constraint_for(self, params: SamplingParams) -> Constraint | None:
        """A new request's grammar state (None without a grammar), made in a worker thread, for ``add_request``
        / ``add_prefilled``: it takes ms (tens for a wide schema; llguidance releases the GIL), and made by the
        engine thread it would hold up the step the request joins, every other request's too."""
        if not params.grammar:
            return None
        params.validate()  # a bad grammar is a RequestError, as add_request's
        return await asyncio.get_running_loop().run_in_executor(None, self._new_constraint, params.grammar, [])

    def _new_constraint(self, grammar: str, tokens: list[int]) -> Constraint:
        return Constraint.for_request(self.model_dir, self.eos_token_ids, self.model_config.vocab_size, grammar, tokens)

    def _constraint(self, seq: Sequence) -> Constraint:
        """The request's grammar state: the one handed in (``constraint_for``), else made here on first use from
        the tokens it already has (an engine stepped by its caller: ``generate``)."""
        if seq.constraint is None:
            seq.constraint = self._new_constraint(seq.params.grammar or "", seq.output_token_ids)
        return seq.constraint

    def _append_token(self, req: _Request, token: int, logprob: float | None, top: TopLogprobs | None,
                      outputs: list[Output]) -> None:
        seq = req.seq
        constraint = self._constraint(seq) if seq.params.grammar is not None else None
        if constraint is not None:
            constraint.accept(token)
            if constraint.error is not None:
                self._fail(req, f"token {token} does not keep to the grammar: {constraint.error}", outputs)
                return
        seq.output_token_ids.append(token)
        self._decode_tokens += 1
        if logprob is not None:
            seq.logprobs.append(logprob)
        if top is not None:
            seq.top_logprobs.append(top)
        reason = None
        hit_stop = req.detok.add(seq.output_token_ids)
        if token in seq.stop_ids or hit_stop or (constraint is not None and constraint.done):
            reason = "stop"
        elif len(seq.output_token_ids) >= seq.params.max_tokens or seq.num_tokens >= self.max_model_len:
            reason = "length"
        if reason is not None:
            self.scheduler.finish(seq, reason)
            if seq.hold_blocks and seq.block_table:
                self._held[seq.request_id] = seq
        outputs.append(self._emit(req, [token]))

    def _emit(self, req: _Request, new_ids: list[int], error: str | None = None) -> Output:
        seq = req.seq
        out = Output(
            request_id=seq.request_id,
            prompt_token_ids=seq.prompt_token_ids,
            token_ids=list(seq.output_token_ids),
            text=req.detok.text,
            finish_reason=seq.finish_reason,
            num_cached_tokens=seq.num_cached_tokens,
            logprobs=list(seq.logprobs) if seq.params.logprobs else None,
            top_logprobs=list(seq.top_logprobs) if seq.params.top_logprobs else None,
            prompt_logprobs=list(seq.prompt_logprobs) if seq.params.scored else None,
            prompt_top_logprobs=list(seq.prompt_top_logprobs) if seq.params.prompt_logprobs else None,
            compute_s=seq.compute_s,
            new_token_ids=new_ids,
            new_text=req.detok.take_delta(final=seq.finished),
            error=error,
        )
        if seq.finished:
            self._requests.pop(seq.request_id, None)
        try:
            req.sink(out)
        except Exception:  # a broken consumer must not take the engine down
            log.exception("output sink for %s failed", seq.request_id)
        return out

    # -- blocking API ---------------------------------------------------------------------
    def generate(self, prompts: list[Prompt] | Prompt,
                 params: SamplingParams | list[SamplingParams] | None = None) -> list[Output]:
        """Run prompts to completion; outputs in the order of ``prompts``."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(plist) != len(prompts):
            raise RequestError(f"got {len(plist)} SamplingParams for {len(prompts)} prompts")
        finals: dict[str, Output] = {}

        def keep(out: Output) -> None:
            if out.finished:
                finals[out.request_id] = out

        ids = [self.add_request(p, sp, sink=keep) for p, sp in zip(prompts, plist)]
        while len(finals) < len(ids):
            self.step()
        return [finals[i] for i in ids]

    @torch.inference_mode()
    def score(self, prompt: Prompt, chunk_size: int | None = None) -> torch.Tensor:
        """Logits [n, vocab] at every position of ``prompt`` (perplexity, tests), computed in
        chunks of ``chunk_size`` through the paged cache; no prefix cache is used or filled."""
        ids = self.tokenize(prompt)
        with self._step_lock:
            seq = Sequence(f"score-{uuid.uuid4().hex}", ids, SamplingParams(max_tokens=1))
            blocks = self.block_manager.allocate(self.block_manager.blocks_needed(len(ids)))
            if blocks is None:
                raise RequestError("not enough free KV blocks to score this prompt now")
            seq.block_table = blocks
            try:
                parts = []
                step = chunk_size or len(ids)
                while seq.num_computed_tokens < len(ids):
                    n = min(step, len(ids) - seq.num_computed_tokens)
                    res = self.runner.run([ScheduledSeq(seq, n)], all_logits=True)
                    parts.append(res.all_logits[seq.request_id])
                    seq.num_computed_tokens += n
                return torch.cat(parts)
            finally:
                self.block_manager.release(blocks)

    # -- async API ------------------------------------------------------------------------
    async def stream(self, prompt: Prompt, params: SamplingParams | None = None,
                     request_id: str | None = None) -> AsyncIterator[Output]:
        """Yield an Output per new token (``new_text`` holds the delta); the last has finish_reason.

        Leaving the loop early aborts the request and frees its blocks.
        """
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Output] = asyncio.Queue()
        self.start_driver(loop)
        constraint = await self.constraint_for(params) if params is not None else None
        rid = self.add_request(prompt, params, request_id, constraint=constraint,
                               sink=lambda out: loop.call_soon_threadsafe(queue.put_nowait, out))
        finished = False
        try:
            while True:
                out = await queue.get()
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            if not finished:
                self.abort(rid)

    def start_driver(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Step the engine in a background thread for as long as ``loop`` runs (daemons call this once;
        ``stream`` and ``call`` do it on demand: driver.py)."""
        loop = loop or asyncio.get_running_loop()
        if self.driver_failure is not None:
            return  # a dead engine stays dead: its owner restarts the process (``call`` still runs)
        self._driver.start(loop)

    def _driver_died(self, exc: BaseException) -> None:
        """The driver died (a bug the step's own error handling did not catch): fail every waiter."""
        self.driver_failure = exc
        log.critical("the engine driver died (%r); failing %d requests", exc, len(self._requests))
        why = f"the engine stopped: {exc!r}"
        for req in list(self._requests.values()):
            # the scheduler may be what broke: tell the waiters without touching it
            self._requests.pop(req.seq.request_id, None)
            try:
                req.sink(Output(request_id=req.seq.request_id, prompt_token_ids=req.seq.prompt_token_ids,
                                token_ids=list(req.seq.output_token_ids), finish_reason="error", error=why))
            except Exception:
                log.exception("output sink for %s failed", req.seq.request_id)
        if self.on_driver_death is not None:
            self.on_driver_death(exc)

    def close(self) -> None:
        self._driver.close()

    # -- introspection --------------------------------------------------------------------
    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting) + len(self._inbox),
            num_free_blocks=bm.num_free_blocks,
            num_blocks=bm.num_blocks,
            num_cached_blocks=bm.num_cached_blocks,
            prefix_hit_blocks=bm.hits,
            prefix_query_blocks=bm.queries,
            prefill_tokens_computed=self._prefill_tokens,
            prompt_tokens_cached=self._cached_tokens,
            decode_tokens=self._decode_tokens,
            num_preemptions=self.scheduler.num_preemptions,
            steps=self._steps,
        )
