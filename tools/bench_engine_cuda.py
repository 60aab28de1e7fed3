"""The GPU path of tools/bench_engine.py (``--device cuda``): tokens/s and the fraction of the HBM roofline.

Why a roofline: a decode step reads every weight once plus each sequence's KV cache, so on a GPU it
is bound by memory bandwidth, and tokens/s alone does not say how far from the hardware we are.
bytes read per step / step time / peak bandwidth does. Step times are the engine's own decode-only
steps (``Engine.drain_step_log``), so prefill and Python between requests are not in them.
Both run in bf16. Baseline in the same run: ``transformers.generate`` on the same GPU. Our decode steps
replay CUDA graphs (engine/cuda_graphs.py) unless ``--no-cuda-graphs``: run both to see what they buy,
which the roofline fraction at batch 1 shows.
"""

from __future__ import annotations

import json
import statistics
import time

import torch

# peak HBM bandwidth (GB/s) by a substring of torch.cuda.get_device_name(); the first match wins
PEAK_GBPS: tuple[tuple[str, float], ...] = (
    ("H200", 4800), ("H100 NVL", 3900), ("H100 PCIe", 2000), ("H100", 3350), ("GH200", 4000),
    ("A100-SXM4-80GB", 2039), ("A100 80GB PCIe", 1935), ("A100", 1555), ("L40S", 864), ("L4", 300),
    ("A10", 600), ("RTX 4090", 1008),
)


def peak_gbps(name: str, override: float | None) -> float | None:
    if override:
        return override
    return next((gbps for key, gbps in PEAK_GBPS if key in name), None)


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes a decode step reads of the model: every parameter once (a tied head counts once), except
    an untied embedding, of which it reads one row per token."""
    head = getattr(model, "lm_head", None)
    tied = head is not None and head.weight is getattr(model, "embed_tokens", head).weight
    total = 0
    for name, p in model.named_parameters():  # shared tensors are listed once
        if name == "embed_tokens.weight" and not tied:
            continue
        total += p.numel() * p.element_size()
    return total


def bench_cuda(args) -> int:
    from transformers import AutoModelForCausalLM

    from bench_engine import _prompts, bench_ours
    from mooncaked.engine import Engine
    from mooncaked.engine.attention import flash_unavailable_reason
    from mooncaked.engine.config import check_device

    device = check_device(args.device)  # a clear error on a machine without one
    name = torch.cuda.get_device_name(device)
    batches = args.batches or [1, 16, 64]
    block = 256 if flash_unavailable_reason(device, 256) is None else 16
    engine = Engine.from_pretrained(args.model, device=args.device, dtype="bfloat16", block_size=block,
                                    max_num_seqs=max(64, *batches),
                                    max_num_batched_tokens=max(2048, args.prompt_len * max(batches)),
                                    cuda_graphs=not args.no_cuda_graphs)
    cfg = engine.model_config
    kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * engine.dtype.itemsize
    wbytes = weight_bytes(engine.runner.model)
    peak = peak_gbps(name, args.peak_gbps)
    hf = AutoModelForCausalLM.from_pretrained(str(engine.model_dir), dtype=engine.dtype).to(device).eval()
    warm = _prompts(2, 16, cfg.vocab_size, 0)
    bench_ours(engine, warm, 4)
    bench_hf_cuda(hf, warm, 4)
    results = {"model": engine.model_dir.name, "device": name, "dtype": str(engine.dtype).removeprefix("torch."),
               "attention": engine.runner.backend.name, "block_size": block, "weight_bytes": wbytes,
               "peak_gbps": peak, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
               "cuda_graphs": engine.runner.graphs is not None, "runs": []}
    for batch in batches:
        prompts = _prompts(batch, args.prompt_len, cfg.vocab_size, seed=batch)
        n = batch * args.new_tokens
        hf_secs = bench_hf_cuda(hf, prompts, args.new_tokens)
        engine.drain_step_log()
        secs, _ = bench_ours(engine, prompts, args.new_tokens)
        steps = [s for s in engine.drain_step_log() if s.prefill_tokens == 0 and s.decodes == batch]
        run = {"batch": batch, "tok_s": round(n / secs, 1), "hf_tok_s": round(n / hf_secs, 1),
               "vs_hf": round(hf_secs / secs, 3), "decode_steps": len(steps)}
        if steps:
            step_s = statistics.median(s.seconds for s in steps)
            read = wbytes + statistics.median(s.decode_context for s in steps) * kv_per_token
            run.update(decode_step_ms=round(step_s * 1e3, 3), bytes_per_step=int(read),
                       achieved_gbps=round(read / step_s / 1e9, 1),
                       roofline_fraction=round(read / step_s / (peak * 1e9), 3) if peak else None)
        results["runs"].append(run)
    if not peak:
        results["roofline_note"] = f"peak bandwidth of {name!r} unknown: pass --peak-gbps"
    if args.json:
        print(json.dumps(results))
    else:
        print(f"{results['model']} on {name} ({results['dtype']}, attention {results['attention']}), "
              f"weights {wbytes / 1e6:.0f} MB, peak {peak} GB/s")
        for r in results["runs"]:
            print(f"batch {r['batch']}: {r['tok_s']} tok/s ({r['vs_hf']}x transformers {r['hf_tok_s']}); decode step "
                  f"{r.get('decode_step_ms')} ms, {r.get('achieved_gbps')} GB/s, roofline {r.get('roofline_fraction')}")
    return 0


def bench_hf_cuda(hf, prompts: list[list[int]], new_tokens: int) -> float:
    """transformers.generate on the GPU: its inputs moved there, timed to the last kernel."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    x = torch.tensor(prompts, device=hf.device)
    with torch.no_grad():
        hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                    do_sample=False, pad_token_id=0)
    torch.cuda.synchronize()
    return time.perf_counter() - t0
