"""TTFT of the disaggregated path with layer-wise KV push against push-after-prefill.

Starts a real conductor, one prefill and one decode instance (separate processes) on
loopback, with the data plane capped to a rate at which moving a prompt's KV takes about
as long as computing it. Measures, in the same run:
  compute  = prefill time of the prompt on the prefill instance (uncapped run, from its Stats)
  transfer = KV bytes / rate cap
  TTFT with kv_push=layerwise and with kv_push=after_prefill.
Aim: TTFT(layerwise) <= 1.25 x max(compute, transfer); push-after-prefill pays compute + transfer.
The uncapped runs take the engines' default, their transfer I/O processes (tcp shares of 16 MiB or more a
peer go through them, io_transport.MIN_SHARE_BYTES; a rate cap turns them off: they do not pace).
``--io-process`` also runs the uncapped layer-wise cluster with ``--no-transfer-io-process``: what the I/O
process costs a push (a layer of the default model's fp32 KV is 1.5 KiB a token: 16 MiB at 10,923 tokens).

    python tools/bench_pd.py [--quick] [--json] [--model PATH] [--prompt-len N] [--io-process]

With MOONCAKED_TLS_CERT/_TLS_KEY/_TLS_CA and/or MOONCAKED_CLUSTER_TOKEN_FILE set, the cluster
runs secured (mutual TLS, the cluster token) and the bench dials it so: what security costs.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc

from mooncaked.proto.mooncake.v1 import common_pb2, conductor_pb2, conductor_pb2_grpc
from mooncaked.security import Security
from ports import free_port

SECURITY_ENV = ("MOONCAKED_TLS_CERT", "MOONCAKED_TLS_KEY", "MOONCAKED_TLS_CA", "MOONCAKED_CLUSTER_TOKEN_FILE")


class MiniCluster:
    """A conductor, one decode and prefill instances as processes on loopback. ``prefills``: the extra
    flags of each prefill process (default: one plain prefill), e.g. one CPP stage's each."""

    def __init__(self, model: str, log_dir: Path, env: dict[str, str],
                 prefills: list[list[str]] | None = None) -> None:
        self.procs: list[subprocess.Popen] = []
        self.conductor = f"127.0.0.1:{free_port()}"
        base = {k: v for k, v in os.environ.items() if not k.startswith("MOONCAKED_") or k in SECURITY_ENV}
        self.security = Security.load(*(os.environ.get(k) for k in SECURITY_ENV))
        base.update({"MOONCAKED_MODEL": model, "MOONCAKED_ENABLE_PREFIX_CACHING": "false",
                     "MOONCAKED_HEARTBEAT_INTERVAL_S": "0.5", "MOONCAKED_LOG_LEVEL": "WARNING", **env})
        prefills = prefills if prefills is not None else [[]]
        self.instances = len(prefills) + 1
        roles = [("conductor", "conductor", []), ("decode", "decode", [])]
        roles += [(f"prefill-{i}" if i else "prefill", "prefill", extra) for i, extra in enumerate(prefills)]
        for name, role, extra in roles:
            listen = self.conductor if role == "conductor" else f"127.0.0.1:{free_port()}"
            cmd = [sys.executable, "-m", "mooncaked.cli", "--role", role, "--listen", listen, "--name", name, *extra]
            if role != "conductor":
                cmd += ["--conductor", self.conductor]
            else:
                cmd += ["--http", "127.0.0.1:0"]
            log = open(log_dir / f"{name}.log", "w")
            self.procs.append(subprocess.Popen(cmd, env=base, stdout=log, stderr=subprocess.STDOUT))

    def wait_ready(self, timeout_s: float = 180) -> None:
        deadline = time.monotonic() + timeout_s
        with self.security.sync_channel(self.conductor) as ch:
            stub = conductor_pb2_grpc.ConductorStub(ch)
            while time.monotonic() < deadline:
                if any(p.poll() is not None for p in self.procs):
                    raise RuntimeError("a mooncaked process exited during start")
                try:
                    st = stub.Status(conductor_pb2.StatusRequest(), timeout=2)
                    if sum(i.state == 2 for i in st.instances) == self.instances:
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.3)
        raise TimeoutError("cluster did not become ready")

    def ttft(self, prompt: list[int]) -> tuple[float, conductor_pb2.GenerateChunk]:
        with self.security.sync_channel(self.conductor) as ch:
            stub = conductor_pb2_grpc.ConductorStub(ch)
            req = conductor_pb2.GenerateRequest(token_ids=conductor_pb2.TokenIds(ids=prompt),
                                                sampling=common_pb2.SamplingParams(max_tokens=2, ignore_eos=True))
            t0 = time.perf_counter()
            stream = stub.Generate(req, timeout=600)
            first = next(stream)
            ttft = time.perf_counter() - t0
            for _ in stream:
                pass
        return ttft, first

    def stop(self) -> None:
        for p in self.procs:
            p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(length)] for _ in range(n)]


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def run_mode(model: str, env: dict[str, str], prompts: list[list[int]], log_dir: Path) -> list[float]:
    cluster = MiniCluster(model, log_dir, env)
    try:
        cluster.wait_ready()
        cluster.ttft(prompts[0][:32])  # warm up
        return [cluster.ttft(p)[0] for p in prompts]
    finally:
        cluster.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="prompt 512, one repeat (< 1 min after the model is cached)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--io-process", action="store_true",
                    help="also the uncapped layer-wise TTFT without the engines' transfer I/O processes")
    args = ap.parse_args()
    if args.quick:
        args.prompt_len, args.repeats = 512, 1
    from mooncaked.engine.loader import read_model_config, resolve_model_dir

    model_dir = resolve_model_dir(args.model)
    cfg, _ = read_model_config(model_dir)
    kv_bytes = 2 * cfg.num_layers * args.prompt_len * cfg.num_kv_heads * cfg.head_dim * 4  # fp32 on CPU
    prompts = _prompts(args.repeats, args.prompt_len, 0)
    with tempfile.TemporaryDirectory() as tmp:
        log_dir = Path(tmp)
        # 1. compute alone: no cap, so the push costs ~nothing next to the prefill
        uncapped = run_mode(str(model_dir), {"MOONCAKED_KV_PUSH": "layerwise"}, prompts, log_dir)
        compute = _median(uncapped)
        rate = max(1, int(kv_bytes / compute))  # transfer time ~= compute time
        capped = {"MOONCAKED_TRANSFER_RATE_LIMIT": str(rate)}
        layerwise = run_mode(str(model_dir), {**capped, "MOONCAKED_KV_PUSH": "layerwise"}, prompts, log_dir)
        after = run_mode(str(model_dir), {**capped, "MOONCAKED_KV_PUSH": "after_prefill"}, prompts, log_dir)
        # the uncapped runs above went through the I/O process (the default); the same without it
        plain = {"MOONCAKED_KV_PUSH": "layerwise", "MOONCAKED_TRANSFER_IO_PROCESS": "false"}
        in_process = run_mode(str(model_dir), plain, prompts, log_dir) if args.io_process else None
    transfer = kv_bytes / rate
    bound = max(compute, transfer)
    result = {
        "model": model_dir.name, "prompt_len": args.prompt_len, "kv_bytes": kv_bytes,
        "rate_cap_MBps": round(rate / 1e6, 2),
        "compute_s": round(compute, 3), "transfer_s": round(transfer, 3),
        "ttft_layerwise_s": round(_median(layerwise), 3), "ttft_after_prefill_s": round(_median(after), 3),
        "layerwise_over_bound": round(_median(layerwise) / bound, 3),
        "after_prefill_over_bound": round(_median(after) / bound, 3),
        "speedup_layerwise_vs_after": round(_median(after) / _median(layerwise), 3),
    }
    if in_process is not None:
        result.update({"kv_bytes_per_layer": kv_bytes // cfg.num_layers,
                       "ttft_uncapped_io_process_s": [round(t, 3) for t in uncapped],
                       "ttft_uncapped_in_process_s": [round(t, 3) for t in in_process],
                       "io_process_over_in_process": round(compute / _median(in_process), 3)})
    if args.json:
        print(json.dumps(result))
    else:
        for k, v in result.items():
            print(f"{k:>26}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
