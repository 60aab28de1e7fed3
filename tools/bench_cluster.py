"""The embedded cluster against the engine alone: what serving through it costs, same machine, same run.

``mooncaked --role all`` (conductor, store master, 1 prefill + 1 decode, the cores shared out among the
engines) is measured over its OpenAI HTTP front; then the baseline, one ``Engine`` in this process with
every core, runs the same work. Figures, both ways:

- ``tok_s_cN``: N concurrent completions of ``--tokens`` tokens each (EOS ignored, greedy), tokens/s over
  the whole batch, best of ``--reps`` rounds;
- ``ttft_short_s``: first token of a short question after a system prompt already cached (median);
- ``ttft_long_s``: first token of a cold prompt of ``--long-words`` words, ~1000 tokens (median).

Ratios: ``cluster_vs_engine_tok_s_cN`` (cluster tok/s ÷ engine tok/s) and ``engine_vs_cluster_ttft_*``
(engine TTFT ÷ cluster TTFT): 1.0 would mean the cluster costs nothing over the engine alone; the
prefill → decode hop, HTTP, gRPC and two engines sharing the cores are what it pays.

    python tools/bench_cluster.py [--quick] [--json] [--model PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from replay_vs_sim import all_role_cluster, cluster_env  # noqa: E402

SYSTEM = "You are a helpful assistant. Answer briefly and precisely. " * 3
WORDS = "river city market tower wool salt church street flood fire war plan trade bridge".split()
REQUEST_TIMEOUT_S = 300.0


def workload(quick: bool, long_words: int) -> dict[str, Any]:
    rnd = random.Random(1)
    return {"concurrency": [1, 2] if quick else [1, 2, 4],
            "questions": [f"Question {i}: what is {i} plus {i}?" for i in range(3 if quick else 8)],
            "long": [" ".join(rnd.choice(WORDS) for _ in range(long_words)) for _ in range(1 if quick else 3)]}


def batch_prompts(n: int, rep: int) -> list[str]:
    return [f"Story number {100 * n + 10 * rep + i}: once upon a time in a small town" for i in range(n)]


# -- the cluster, over HTTP ----------------------------------------------------------------------------
async def cluster_figures(url: str, work: dict[str, Any], tokens: int, reps: int) -> dict[str, float]:
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout) as s:
        async with s.get(f"{url}/v1/models") as r:
            model = (await r.json())["data"][0]["id"]

        async def complete(prompt: str, max_tokens: int) -> int:
            body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
                    "temperature": 0}
            async with s.post(f"{url}/v1/completions", json=body) as r:
                if r.status != 200:
                    raise RuntimeError(f"completion failed: HTTP {r.status}: {await r.text()}")
                return (await r.json())["usage"]["completion_tokens"]

        async def first_token(prompt: str) -> float:
            body = {"model": model, "prompt": prompt, "max_tokens": 2, "stream": True, "temperature": 0}
            t = time.perf_counter()
            async with s.post(f"{url}/v1/completions", json=body) as r:
                if r.status != 200:
                    raise RuntimeError(f"completion failed: HTTP {r.status}: {await r.text()}")
                async for line in r.content:
                    if line.startswith(b"data:") and b"[DONE]" not in line:
                        return time.perf_counter() - t
            raise RuntimeError("the stream ended without a token")

        await complete(SYSTEM + "warm up", 4)
        out: dict[str, float] = {}
        for n in work["concurrency"]:
            best = 0.0
            for rep in range(reps):
                t = time.perf_counter()
                done = await asyncio.gather(*(complete(p, tokens) for p in batch_prompts(n, rep)))
                best = max(best, sum(done) / (time.perf_counter() - t))
            out[f"tok_s_c{n}"] = best
        out["ttft_short_s"] = statistics.median([await first_token(SYSTEM + q) for q in work["questions"]])
        out["ttft_long_s"] = statistics.median([await first_token(p) for p in work["long"]])
        return out


def run_cluster(model: str, work: dict[str, Any], tokens: int, reps: int, kv_cache_bytes: int) -> dict[str, float]:
    env = cluster_env(model, block_size=16, kv_cache_bytes=kv_cache_bytes, heartbeat_s=1.0)
    with tempfile.TemporaryDirectory(prefix="bench-cluster-") as logs:
        with all_role_cluster(env, Path(logs), "mooncake", prefills=1, decodes=1) as url:
            return asyncio.run(cluster_figures(url, work, tokens, reps))


# -- the engine alone, in this process -------------------------------------------------------------------
def run_engine(model: str, work: dict[str, Any], tokens: int, reps: int, kv_cache_bytes: int) -> dict[str, float]:
    from mooncaked.engine import Engine, SamplingParams

    eng = Engine.from_pretrained(model, block_size=16, kv_cache_bytes=kv_cache_bytes)
    try:
        first = SamplingParams(max_tokens=1, temperature=0.0)
        eng.generate([SYSTEM + "warm up"], SamplingParams(max_tokens=4, temperature=0.0))
        out: dict[str, float] = {}
        for n in work["concurrency"]:
            best = 0.0
            params = SamplingParams(max_tokens=tokens, min_tokens=tokens, ignore_eos=True, temperature=0.0)
            for rep in range(reps):
                t = time.perf_counter()
                done = eng.generate(batch_prompts(n, rep), params)
                best = max(best, sum(len(o.token_ids) for o in done) / (time.perf_counter() - t))
            out[f"tok_s_c{n}"] = best

        def ttft(prompt: str) -> float:
            t = time.perf_counter()
            eng.generate([prompt], first)
            return time.perf_counter() - t

        out["ttft_short_s"] = statistics.median([ttft(SYSTEM + q) for q in work["questions"]])
        out["ttft_long_s"] = statistics.median([ttft(p) for p in work["long"]])
        return out
    finally:
        eng.close()


def ratios(cluster: dict[str, float], engine: dict[str, float]) -> dict[str, float]:
    out = {f"cluster_vs_engine_{k}": round(cluster[k] / engine[k], 4) for k in cluster if k.startswith("tok_s")}
    out.update({f"engine_vs_cluster_{k}": round(engine[k] / cluster[k], 4) for k in cluster if k.startswith("ttft")})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--tokens", type=int, default=64, help="tokens per completion in the throughput rows")
    ap.add_argument("--reps", type=int, default=3, help="rounds per throughput row, the best kept")
    ap.add_argument("--kv-cache-bytes", type=int, default=1 << 30)
    ap.add_argument("--long-words", type=int, default=700, help="words of the cold prompt (~1000 tokens)")
    ap.add_argument("--quick", action="store_true", help="concurrency 1 and 2, 32 tokens, one round (< 1 min)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args()
    if args.quick:
        args.tokens, args.reps = 32, 1
    logging.basicConfig(level=logging.WARNING)
    work = workload(args.quick, args.long_words)
    cluster = run_cluster(args.model, work, args.tokens, args.reps, args.kv_cache_bytes)
    engine = run_engine(args.model, work, args.tokens, args.reps, args.kv_cache_bytes)
    result = {"model": args.model, "tokens": args.tokens, "reps": args.reps,
              "cluster": {k: round(v, 6) for k, v in cluster.items()},
              "engine": {k: round(v, 6) for k, v in engine.items()}, "ratios": ratios(cluster, engine)}
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{'figure':16} {'cluster':>10} {'engine':>10}")
    for k in cluster:
        print(f"{k:16} {cluster[k]:10.3f} {engine[k]:10.3f}")
    for k, v in result["ratios"].items():
        print(f"{k}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
