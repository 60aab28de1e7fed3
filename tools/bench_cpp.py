"""TTFT of a long prompt on a chunked-pipeline (CPP) prefill group against one prefill instance.

Starts real processes on loopback (a conductor, a decode and the prefill side), each engine with one
torch thread (OMP_NUM_THREADS=1), prefix caching off, and measures in the same run:
  ttft_single_s  one prefill instance computes the whole prompt
  ttft_cpp_s     a group of --stages stage processes, each holding its range of the layers, computes
                 it chunk by chunk (--chunk tokens), hidden states crossing between stages
and checks the first tokens are the same. The bubble fraction is read off the stages' Prometheus
counters (mooncaked_cpp_stage_busy/bubble_seconds); the ideal is T_single/N plus one chunk's fill and
drain, (N-1)/N of one chunk's share of T_single.

With --elastic the prefill side is N whole-model prefill instances (each with the chunk as its step
budget) under a conductor with --policy mooncaked, which lends the idle ones to the prompt: an
elastic group formed for the request, not a static one (ttft_elastic_s; elastic_stages_seen: the
stages whose counters moved, so a run where the policy did not lend says so).

    python tools/bench_cpp.py [--quick] [--json] [--model PATH] [--prompt-len N] [--stages 2 3] [--chunk N]
                              [--elastic]

--json prints one JSON object: the first --stages figure's fields at the top level
(prompt_tokens, ttft_single_s, ttft_cpp_s, ratio, same_tokens, stages), every stage count under "runs".
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from bench_pd import MiniCluster, _median, _prompts
from ports import free_port
from mooncaked.proto.mooncake.v1 import conductor_pb2, conductor_pb2_grpc

ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def _stage_flags(stages: int, chunk: int, metrics: list[int]) -> list[list[str]]:
    return [["--pipeline-group", "bench", "--pipeline-stage", f"{k}/{stages}", "--cpp-chunk-tokens", str(chunk),
             "--metrics", f"127.0.0.1:{metrics[k]}"] for k in range(stages)]


def _elastic_flags(instances: int, chunk: int, metrics: list[int]) -> list[list[str]]:
    return [["--max-num-batched-tokens", str(chunk), "--metrics", f"127.0.0.1:{metrics[k]}"] for k in range(instances)]


def _warm_each(cluster: MiniCluster, instances: int, prompts: list[list[int]]) -> None:
    """These prompts on each prefill instance alone (the others drained), so the conductor has fitted every
    instance's prefill time over more than one length (slope, not only a constant) before the policy
    compares a lead alone with a pipeline of it and its would-be helpers."""
    names = ["prefill"] + [f"prefill-{i}" for i in range(1, instances)]
    with cluster.security.sync_channel(cluster.conductor) as ch:
        stub = conductor_pb2_grpc.ConductorStub(ch)

        def drain(name: str, on: bool) -> None:
            stub.SetDrain(conductor_pb2.SetDrainRequest(name=name, drain=on), timeout=10)

        for name in names:
            for other in names:
                drain(other, other != name)
            for prompt in prompts:
                cluster.ttft(prompt)
        for name in names:
            drain(name, False)
    time.sleep(2.0)  # a few heartbeats (0.5 s): the conductor's view of each instance's queue is current again


def _counter(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return sum(float(v) for v in re.findall(rf"^{name}_total{{[^}}]*}} ([0-9.e+-]+)$", text, re.M))


def _stages_seen(ports: list[int]) -> list[str]:
    """The "K/N" stage labels whose busy counters are above zero on these instances."""
    seen = set()
    for port in ports:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        seen |= {m for m, v in re.findall(r'^mooncaked_cpp_stage_busy_seconds_total{stage="([^"]+)"} ([0-9.e+-]+)$',
                                            text, re.M) if float(v) > 0}
    return sorted(seen)


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
    ap.add_argument("--elastic", action="store_true",
                    help="whole-model prefill instances under --policy mooncaked instead of static groups")
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
        # elastic: the single instance has the same step budget as the instances it is compared with
        single_flags = [["--max-num-batched-tokens", str(args.chunk)]] if args.elastic else [[]]
        single, single_first = run(model, Path(tmp), prompts, single_flags)
        t_single = _median(single)
        for n in args.stages:
            metrics = [free_port() for _ in range(n)]
            flags = (_elastic_flags if args.elastic else _stage_flags)(n, args.chunk, metrics)
            env = {**ONE_THREAD, "MOONCAKED_POLICY": "mooncaked"} if args.elastic else ONE_THREAD
            cluster = MiniCluster(model, Path(tmp), env, flags)
            try:
                cluster.wait_ready(600)
                if args.elastic:
                    _warm_each(cluster, n, [prompts[0][-128:], prompts[0][-768:]])
                else:
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
                seen = _stages_seen(metrics)
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
                **({"elastic_stages_seen": seen} if args.elastic else {}),
            }
    main_run = runs[str(args.stages[0])]
    result = {"prompt_tokens": args.prompt_len, "ttft_single_s": round(t_single, 3),
              "ttft_cpp_s": main_run["ttft_cpp_s"], "ratio": main_run["ratio"],
              "same_tokens": all(r["same_tokens"] for r in runs.values()), "stages": args.stages[0],
              "chunk_tokens": args.chunk, "model": Path(model).name, "torch_threads_per_process": 1,
              "elastic": args.elastic, "runs": runs}
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
