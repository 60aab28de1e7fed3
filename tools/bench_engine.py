"""Engine throughput against `transformers.generate` on the same weights, in the same run.

Default: the bundled SmolLM2-135M-Instruct on the CPU, prompts of 128 random token ids,
32 new tokens (no early stop), batch 1 and batch 16. Each engine path (``--paths``) against
transformers.generate in fp32 and bf16, all in the same run (best of ``--reps`` interleaved
repetitions on fresh prompts; every time is in the JSON), plus each path's quality against our
fp32: perplexity on a fixed paragraph and greedy agreement over 32 tokens on 16 prompts. Paths:

- ``default``: what the engine picks with no --dtype (engine/precision.py; named in the output);
- ``fp32``: ``--dtype float32``, the exact path (its tokens are compared with transformers');
- ``bf16``: fp32 activations with bf16 weights and a bf16 head rechecked in fp32 (``--quantize bf16``);
- ``bf16_full``: the whole model in bf16 (``--dtype bfloat16``), as transformers bf16 runs;
- ``fp16``: fp16 weights under fp32 activations (fbgemm; the default on an AVX2 CPU without native bf16);
- ``int8``, ``int4``: weight-only quantized linear layers (bf16 activations into their kernels).

Every non-fp32 path's head rescores its best 16 candidates in fp32. A path this CPU cannot run (bf16
weights without AVX512 BW/VL/DQ or AVX-NE-CONVERT) is skipped, the reason in the JSON's ``skipped``.

Greedy agreement (the issue's figure) is the lower of two runs of the 16 prompts, all in one batch
(``agreement_batched``) and one at a time (``agreement_one_by_one``: batch-1 decode steps, where
weights on a 4-bit grid are read as 4 bits). It is position-wise over free-running generation: once one
near-tied token flips, the two continuations differ and later positions rarely agree, so it is
harsh on a 135M model. ``agreement_prefix`` counts only up to the first divergence;
``top1_teacher_forced`` (an extra figure, not a substitute) scores fp32's greedy continuations with
each path and with fp32, in one forward each, and counts the positions where the two top-1 tokens are
the same: both see the same context, so one flip does not spoil the rest.

``--device cuda`` measures the GPU path instead (tools/bench_engine_cuda.py): tokens/s at batch 1,
16 and 64 and the fraction of the HBM roofline.

    python tools/bench_engine.py [--quick] [--json] [--model PATH] [--batches 1 16] [--paths default fp32 int8]
    python tools/bench_engine.py --profile default [--batches 16]   # where batch 16's time goes
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time

import torch


def _prompts(batch: int, length: int, vocab: int, seed: int, shared: int = 0) -> list[list[int]]:
    """Random prompts; the first ``shared`` tokens are the same in all (a common system prompt)."""
    g = torch.Generator().manual_seed(seed)
    # skip the first ids: small ids are special tokens in most vocabularies
    prefix = torch.randint(100, vocab, (shared,), generator=g).tolist()
    return [prefix + torch.randint(100, vocab, (length - shared,), generator=g).tolist() for _ in range(batch)]


def bench_ours(engine, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
    from mooncaked.engine import SamplingParams

    # min_tokens suppresses EOS like generate's min_new_tokens, so both decode the same tokens
    params = SamplingParams(max_tokens=new_tokens, min_tokens=new_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    return time.perf_counter() - t0, [o.token_ids for o in outs]


def bench_hf(model, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
    x = torch.tensor(prompts)
    t0 = time.perf_counter()
    with torch.no_grad():
        y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new_tokens,
                           min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return time.perf_counter() - t0, y[:, x.shape[1]:].tolist()


PARAGRAPH = ("The history of the city begins in the early middle ages, when a small settlement grew around a "
             "river crossing. Merchants came to trade wool and salt, and by the twelfth century the town had "
             "walls, a market square and a church whose tower still stands. In the centuries that followed, "
             "fires, wars and floods reshaped the streets, but the old plan can still be traced in the narrow "
             "lanes that lead down to the water.")
# a path's Engine.from_pretrained arguments
PATHS: dict[str, dict] = {
    "default": {},
    "fp32": {"dtype": "float32"},
    "bf16": {"dtype": "float32", "quantize": "bf16"},
    "bf16_full": {"dtype": "bfloat16"},
    "int8": {"dtype": "float32", "quantize": "int8"},
    "int4": {"dtype": "float32", "quantize": "int4"},
    "fp16": {"dtype": "float32", "quantize": "fp16"},
}


def quality(engines: dict, new_tokens: int = 32, num_prompts: int = 16) -> dict[str, dict]:
    """Each path's perplexity on PARAGRAPH (and its ratio to fp32's) and greedy agreement with fp32."""
    from mooncaked.engine import SamplingParams
    from mooncaked.engine.quant import greedy_agreement, perplexity

    base = engines["fp32"]
    ids = base.tokenize(PARAGRAPH)
    prompts = [base.tokenize(f"Question {i}: write a few sentences about topic number {i}.")
               for i in range(num_prompts)]
    params = SamplingParams(max_tokens=new_tokens, min_tokens=new_tokens, ignore_eos=True)
    ref_ppl = perplexity(base.score(ids), ids)
    ref = [o.token_ids for o in base.generate(prompts, params)]
    ref_tops = teacher_forced_tops(base, prompts, ref)
    out = {}
    for name, eng in engines.items():
        ppl = perplexity(eng.score(ids), ids)
        got = ref if eng is base else [o.token_ids for o in eng.generate(prompts, params)]
        # one prompt at a time too: a one-row decode step may read other weights (engine/four_bit.py)
        alone = ref if eng is base else [eng.generate([p], params)[0].token_ids for p in prompts]
        out[name] = {"perplexity": round(ppl, 3), "ppl_ratio": round(ppl / ref_ppl, 4),
                     "agreement": round(min(greedy_agreement(ref, got), greedy_agreement(ref, alone)), 3),
                     "agreement_batched": round(greedy_agreement(ref, got), 3),
                     "agreement_one_by_one": round(greedy_agreement(ref, alone), 3),
                     "agreement_prefix": round(greedy_agreement(ref, got, prefix=True), 3),
                     "top1_teacher_forced": round(greedy_agreement(ref_tops, teacher_forced_tops(eng, prompts, ref)),
                                                  3)}
    return out


def teacher_forced_tops(engine, prompts: list[list[int]], continuations: list[list[int]]) -> list[list[int]]:
    """``engine``'s top-1 token at each position of each continuation, given the prompt and the
    continuation's earlier tokens (one forward over prompt + continuation)."""
    tops = []
    for p, c in zip(prompts, continuations, strict=True):
        logits = engine.score(p + c)
        tops.append(logits[len(p) - 1 : len(p) - 1 + len(c)].argmax(-1).tolist())
    return tops


def _one_step_batch(args) -> dict:
    """Engine settings that prefill the whole batch in one step, as ``transformers.generate`` does (a
    serving engine on CPU prefills prompts one after another: engine/config.py DEFAULT_PACK_TOKENS)."""
    budget = max(2048, args.prompt_len * max(args.batches))
    return {"max_num_batched_tokens": budget, "prefill_pack_tokens": budget}


def profile(args) -> int:
    """Top ops of one request batch on one path: the prefill (with its first token) and the whole request."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from mooncaked.engine import Engine

    batch = max(args.batches)
    eng = Engine.from_pretrained(args.model, max_num_seqs=max(64, batch),
                                 **_one_step_batch(args), **PATHS[args.profile])
    vocab = eng.model_config.vocab_size
    bench_ours(eng, _prompts(1, 16, vocab, 0), 4)
    print(f"path {args.profile}: {_describe(eng.precision)}; batch {batch}, prompt {args.prompt_len}, "
          f"{args.new_tokens} new tokens, {torch.get_num_threads()} threads")
    for label, new_tokens, seed in (("prefill + first token", 1, 7), ("whole request", args.new_tokens, 8)):
        prompts = _prompts(batch, args.prompt_len, vocab, seed)
        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            secs, _ = bench_ours(eng, prompts, new_tokens)
        print(f"\n{label}: {secs:.3f} s")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=48))
    return 0


def _describe(precision) -> dict:
    return {"dtype": str(precision.dtype).removeprefix("torch."), "weights": precision.weights,
            "reason": precision.reason}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--paths", nargs="+", default=["default", "fp32"], choices=list(PATHS),
                    help="engine paths to measure (fp32, the exact path, always runs: it is the quality reference)")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda: the GPU path (tools/bench_engine_cuda.py)")
    ap.add_argument("--peak-gbps", type=float, default=None,
                    help="cuda: the GPU's peak memory bandwidth in GB/s (default: from its name, if known)")
    ap.add_argument("--batches", type=int, nargs="+", default=None, help="default: 1 16 (cuda: 1 16 64)")
    ap.add_argument("--no-cuda-graphs", action="store_true", help="cuda: every decode step eager (to compare)")
    ap.add_argument("--shared-prefix", type=int, default=0,
                    help="also run the largest batch with prompts sharing this many leading tokens, already "
                         "cached by earlier traffic (our target workload; generate recomputes them per prompt)")
    ap.add_argument("--reps", type=int, default=3,
                    help="interleaved repetitions per batch, each on fresh prompts; tok/s is the best, the JSON "
                         "also has every time and the median ratio (default 3; --quick: 1)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--quick", action="store_true", help="prompt 64, 16 new tokens, batch 1 and 4, no quality (< 1 min)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--profile", choices=list(PATHS), default=None,
                    help="instead: where one path's time goes at the largest batch (torch.profiler, the prefill "
                         "step and the whole request, top ops by self time)")
    args = ap.parse_args()
    if args.quick:
        args.prompt_len, args.new_tokens, args.batches, args.reps = 64, 16, [1, 4], 1
        args.shared_prefix = min(args.shared_prefix, 96)
    if args.threads:
        torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.WARNING)
    if args.device != "cpu":
        from bench_engine_cuda import bench_cuda

        from mooncaked.engine.config import ConfigError
        try:
            return bench_cuda(args)
        except ConfigError as e:  # no such device here: say so, not a traceback
            print(f"bench_engine: {e}", file=sys.stderr)
            return 2
    args.batches = args.batches or [1, 16]
    if args.profile:
        return profile(args)

    from transformers import AutoModelForCausalLM

    from mooncaked.engine import Engine
    from mooncaked.engine.config import ConfigError
    from mooncaked.engine.precision import cpu_flags, native_bf16

    max_batch = max(args.batches)
    paths = list(dict.fromkeys(["fp32", *args.paths]))
    engines, skipped = {}, {}
    for p in paths:
        try:
            engines[p] = Engine.from_pretrained(args.model, max_num_seqs=max(64, max_batch),
                                                **_one_step_batch(args), **PATHS[p])
        except ConfigError as e:  # a path this machine cannot run (e.g. bf16 weights without AVX512/AVX-NE-CONVERT)
            if p == "fp32":
                raise
            skipped[p] = str(e)
    paths = list(engines)
    model_dir = str(engines["fp32"].model_dir)
    hfs = {"hf_fp32": AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval(),
           "hf_bf16": AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()}
    vocab = engines["fp32"].model_config.vocab_size
    warm = _prompts(1, 16, vocab, 0)
    for eng in engines.values():
        bench_ours(eng, warm, 4)
    for hf in hfs.values():
        bench_hf(hf, warm, 4)

    results = {"model": engines["fp32"].model_dir.name, "device": "cpu", "threads": torch.get_num_threads(),
               "cpu": torch.backends.cpu.get_cpu_capability(),
               "cpu_native_bf16": native_bf16(cpu_flags()),
               "default_path": _describe(engines["default"].precision) if "default" in engines else None,
               "skipped": skipped, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "runs": []}
    runs = [(b, 0) for b in args.batches]
    if args.shared_prefix:
        runs.append((max_batch, args.shared_prefix))
    for batch, shared in runs:
        n = batch * args.new_tokens
        run: dict = {"batch": batch, "shared_prefix": shared}
        secs: dict[str, list[float]] = {name: [] for name in [*hfs, *engines]}
        same = 0
        for rep in range(args.reps):
            # fresh prompts each repetition: a repeated prompt would hit our prefix cache
            prompts = _prompts(batch, args.prompt_len, vocab, seed=batch + 1000 * rep, shared=shared)
            hf_ids = None
            for name, hf in hfs.items():
                t, ids = bench_hf(hf, prompts, args.new_tokens)
                secs[name].append(t)
                hf_ids = hf_ids if name != "hf_fp32" else ids
            for name, eng in engines.items():
                if shared:
                    # steady state of a shared system prompt: earlier traffic left it in the prefix cache
                    bench_ours(eng, [prompts[0][:shared] + [100]], 1)
                t, ids = bench_ours(eng, prompts, args.new_tokens)
                secs[name].append(t)
                if name == "fp32":
                    same += sum(a == b for a, b in zip(ids, hf_ids))
        for name, times in secs.items():
            # best of the interleaved repetitions: what the machine gives each side when others leave it be
            run[f"{name}_tok_s"] = round(n / min(times), 2)
            run[f"{name}_seconds"] = [round(t, 3) for t in times]
        for name in engines:
            run[f"{name}_vs_hf_fp32"] = round(run[f"{name}_tok_s"] / run["hf_fp32_tok_s"], 3)
            run[f"{name}_vs_hf_bf16"] = round(run[f"{name}_tok_s"] / run["hf_bf16_tok_s"], 3)
            run[f"{name}_vs_hf_fp32_median"] = round(statistics.median(secs["hf_fp32"]) / statistics.median(secs[name]), 3)
        run["fp32_same_tokens_as_hf"] = f"{same}/{batch * args.reps}"
        results["runs"].append(run)
    if not args.quick:
        results["quality"] = quality(engines)
    if args.json:
        print(json.dumps(results))
    else:
        print(f"model {results['model']}, prompt {args.prompt_len}, {args.new_tokens} new tokens, "
              f"{results['threads']} threads, {results['cpu']}, native bf16: {results['cpu_native_bf16']}")
        for p, why in skipped.items():
            print(f"skipped {p}: {why}")
        if results["default_path"]:
            print(f"default path: {results['default_path']}")
        for r in results["runs"]:
            print(f"batch {r['batch']} shared {r['shared_prefix']}: hf fp32 {r['hf_fp32_tok_s']} tok/s, "
                  f"hf bf16 {r['hf_bf16_tok_s']} tok/s; fp32 same as hf {r['fp32_same_tokens_as_hf']}")
            for p in paths:
                print(f"  {p:>9}: {r[p + '_tok_s']:>8} tok/s  {r[p + '_vs_hf_fp32']:>6}x hf fp32  "
                      f"{r[p + '_vs_hf_bf16']:>6}x hf bf16")
        for p, q in results.get("quality", {}).items():
            print(f"quality {p}: perplexity {q['perplexity']} ({q['ppl_ratio']}x fp32), greedy agreement "
                  f"{q['agreement']} (batched {q['agreement_batched']}, one by one {q['agreement_one_by_one']}; "
                  f"prefix {q['agreement_prefix']}; teacher-forced top-1 {q['top1_teacher_forced']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
