"""Engine throughput against `transformers.generate` on the same weights, in the same run.

Default: the bundled SmolLM2-135M-Instruct on the CPU, prompts of 512 random token ids,
128 new tokens (no early stop), batch 1 and batch 16. Prints tokens/s of both and the ratio.

    python tools/bench_engine.py [--quick] [--json] [--model PATH] [--batches 1 16]
"""

from __future__ import annotations

import argparse
import json
import logging
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--shared-prefix", type=int, default=0,
                    help="also run the largest batch with prompts sharing this many leading tokens, already "
                         "cached by earlier traffic (our target workload; generate recomputes them per prompt)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--quick", action="store_true", help="prompt 128, 32 new tokens, batch 1 and 4 (< 1 min)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args()
    if args.quick:
        args.prompt_len, args.new_tokens, args.batches = 128, 32, [1, 4]
        args.shared_prefix = min(args.shared_prefix, 96)
    if args.threads:
        torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.WARNING)

    from transformers import AutoModelForCausalLM

    from mooncaked.engine import Engine

    max_batch = max(args.batches)
    engine = Engine.from_pretrained(args.model, max_num_seqs=max(64, max_batch),
                                    max_num_batched_tokens=max(2048, args.prompt_len))
    hf = AutoModelForCausalLM.from_pretrained(str(engine.model_dir), dtype=torch.float32).eval()
    vocab = engine.model_config.vocab_size
    warm = _prompts(1, 16, vocab, 0)
    bench_ours(engine, warm, 4)
    bench_hf(hf, warm, 4)

    results = {"model": str(engine.model_dir.name), "device": "cpu", "threads": torch.get_num_threads(),
               "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "runs": []}
    runs = [(b, 0) for b in args.batches]
    if args.shared_prefix:
        runs.append((max_batch, args.shared_prefix))
    for batch, shared in runs:
        prompts = _prompts(batch, args.prompt_len, vocab, seed=batch, shared=shared)
        if shared:
            # steady state of a shared system prompt: earlier traffic left it in the prefix cache
            bench_ours(engine, [prompts[0][:shared] + [100]], 1)
        ours_s, ours_ids = bench_ours(engine, prompts, args.new_tokens)
        hf_s, hf_ids = bench_hf(hf, prompts, args.new_tokens)
        n = batch * args.new_tokens
        same = sum(a == b for a, b in zip(ours_ids, hf_ids))
        results["runs"].append({
            "batch": batch, "shared_prefix": shared,
            "ours_s": round(ours_s, 3), "hf_s": round(hf_s, 3),
            "ours_tok_s": round(n / ours_s, 2), "hf_tok_s": round(n / hf_s, 2),
            "ratio": round(hf_s / ours_s, 3),
            "same_tokens_as_hf": f"{same}/{batch}",
        })
    if args.json:
        print(json.dumps(results))
    else:
        print(f"model {results['model']}, prompt {args.prompt_len}, {args.new_tokens} new tokens, "
              f"{results['threads']} threads")
        print(f"{'batch':>5} {'shared':>6} {'ours tok/s':>11} {'hf tok/s':>9} {'ratio':>6} {'same as hf':>10}")
        for r in results["runs"]:
            print(f"{r['batch']:>5} {r['shared_prefix']:>6} {r['ours_tok_s']:>11} {r['hf_tok_s']:>9} {r['ratio']:>6} "
                  f"{r['same_tokens_as_hf']:>10}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
