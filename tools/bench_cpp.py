"""TTFT of a long prompt on a chunked-pipeline (CPP) prefill group against one prefill instance.

Starts real processes on loopback (a conductor, a decode and the prefill side), each engine with one
torch thread (OMP_NUM_THREADS=1), prefix caching off, and measures in the same run:
  ttft_single_s  one prefill instance computes the whole prompt
  ttft_cpp_s     a group of --stages stage processes, each holding its range of the layers, computes
                 it chunk by chunk (--chunk tokens), hidden states crossing between stages
and checks the first tokens are the same. The bubble fraction is read off the stages' Prometheus
counters (mooncaked_cpp_stage_busy/bubble_seconds); the ideal is T_single/N plus one chunk's fill and
drain, (N-1)/N of one chunk's share of T_single.

    python tools/bench_cpp.py [--quick] [--json] [--model PATH] [--prompt-len N] [--stages 2 3] [--chunk N]

--json prints one JSON object: the first --stages figure's fields at the top level
(prompt_tokens, ttft_single_s, ttft_cpp_s, ratio, same_tokens, stages), every stage count under "runs".
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import urllib.request
from pathlib import Path

from bench_pd import MiniCluster, _free_port, _median, _prompts

ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def _stage_flags(stages: int, chunk: int, metrics: list[int]) -> list[list[str]]:
    return [["--pipeline-group", "bench", "--pipeline-stage", f"{k}/{stages}", "--cpp-chunk-tokens", str(chunk),
             "--metrics", f"127.0.0.1:{metrics[k]}"] for k in range(stages)]


def _counter(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return sum(float(v) for v in re.findall(rf"^{name}_total{{[^}}]*}} ([0-9.e+-]+)$", text, re.M))


def run(model: str, log_dir: Path, prompts: list[list[int]], prefills: list[list[str]]) -> tuple[list[float], list[int]]:
    cluster = MiniCluster(model, log_dir, ONE_THREAD, prefills)
    try:
        cluster.wait_ready(600)
        cluster.ttft(prompts[0][:64])  # warm up
        times, firsts = [], []
        for p in prompts:
            t, first = cluster.ttft(p)
            times.append(t)
            firsts.append(first.token_ids[0])
        return times, firsts
    finally:
        cluster.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--prompt-len", type=int, default=6144)
    ap.add_argument("--stages", type=int, nargs="+", default=[2, 3])
    ap.add_argument("--chunk", type=int, default=512, help="--cpp-chunk-tokens of the stages")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="a 1,536-token prompt, 2 stages (< 1 min)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.prompt_len, args.stages, args.chunk = 1536, [2], 256
    from mooncaked.engine.loader import resolve_model_dir

    model = str(resolve_model_dir(args.model))
    prompts = _prompts(args.repeats, args.prompt_len, 0)
    runs: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        single, single_first = run(model, Path(tmp), prompts, [[]])
        t_single = _median(single)
        for n in args.stages:
            metrics = [_free_port() for _ in range(n)]
            flags = _stage_flags(n, args.chunk, metrics)
            cluster = MiniCluster(model, Path(tmp), ONE_THREAD, flags)
            try:
                cluster.wait_ready(600)
                cluster.ttft(prompts[0][:64])
                busy0 = [_counter(m, "mooncaked_cpp_stage_busy_seconds") for m in metrics]
                bubble0 = [_counter(m, "mooncaked_cpp_stage_bubble_seconds") for m in metrics]
                times, firsts = [], []
                for p in prompts:
                    t, first = cluster.ttft(p)
                    times.append(t)
                    firsts.append(first.token_ids[0])
                busy = sum(_counter(m, "mooncaked_cpp_stage_busy_seconds") for m in metrics) - sum(busy0)
                bubble = sum(_counter(m, "mooncaked_cpp_stage_bubble_seconds") for m in metrics) - sum(bubble0)
            finally:
                cluster.stop()
            t_cpp = _median(times)
            chunks = -(-args.prompt_len // args.chunk)
            ideal = t_single / n + (n - 1) / n * t_single / chunks
            runs[str(n)] = {
                "stages": n, "ttft_cpp_s": round(t_cpp, 3), "ratio": round(t_cpp / t_single, 3),
                "ideal_s": round(ideal, 3), "ideal_ratio": round(ideal / t_single, 3),
                "bubble_fraction": round(bubble / (busy + bubble), 3) if busy + bubble else None,
                "same_tokens": firsts == single_first,
            }
    main_run = runs[str(args.stages[0])]
    result = {"prompt_tokens": args.prompt_len, "ttft_single_s": round(t_single, 3),
              "ttft_cpp_s": main_run["ttft_cpp_s"], "ratio": main_run["ratio"],
              "same_tokens": all(r["same_tokens"] for r in runs.values()), "stages": args.stages[0],
              "chunk_tokens": args.chunk, "model": Path(model).name, "torch_threads_per_process": 1, "runs": runs}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"prompt {args.prompt_len} tokens, chunk {args.chunk}: one prefill {t_single:.2f} s")
        for r in runs.values():
            print(f"  {r['stages']} stages: {r['ttft_cpp_s']:.2f} s = {r['ratio']:.3f}x (ideal {r['ideal_ratio']:.3f}x), "
                  f"bubbles {r['bubble_fraction']}, same first token: {r['same_tokens']}")
    return 0 if result["same_tokens"] else 1


if __name__ == "__main__":
    sys.exit(main())
