"""`mooncakectl`: the operator's CLI, talking to the conductor over gRPC.

    mooncakectl [--conductor HOST:PORT] status [--json]
    mooncakectl generate "PROMPT" [--raw] [--max-tokens N] [--temperature T]
    mooncakectl drain|undrain INSTANCE
    mooncakectl --store HOST:PORT store [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import grpc
from google.protobuf.json_format import MessageToDict

from mooncaked.proto.mooncake.v1 import common_pb2, conductor_pb2, conductor_pb2_grpc, store_pb2, store_pb2_grpc

TIMEOUT_S = 10.0
_STATES = {common_pb2.INSTANCE_STATE_STARTING: "starting", common_pb2.INSTANCE_STATE_SERVING: "serving",
           common_pb2.INSTANCE_STATE_DRAINING: "draining", common_pb2.INSTANCE_STATE_DEAD: "dead"}
_ROLES = {common_pb2.ROLE_PREFILL: "prefill", common_pb2.ROLE_DECODE: "decode",
          common_pb2.ROLE_CONDUCTOR: "conductor", common_pb2.ROLE_STORE: "store"}


def _uptime(s: float) -> str:
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def cmd_status(stub, args) -> int:
    reply = stub.Status(conductor_pb2.StatusRequest(), timeout=TIMEOUT_S)
    if args.json:
        print(json.dumps(MessageToDict(reply, preserving_proto_field_name=True)))
        return 0
    print(f"model {reply.model_id}, conductor up {_uptime(reply.uptime_s)}, {len(reply.instances)} instances")
    head = f"{'NAME':<28} {'ROLE':<8} {'ADDRESS':<22} {'STATE':<9} {'RUN':>4} {'WAIT':>4} {'QUEUED':>7} " \
           f"{'KV USE':>7} {'HIT':>6} {'UPTIME':>7}"
    print(head)
    for i in reply.instances:
        ld = i.load
        kv = 1 - ld.free_kv_blocks / ld.total_kv_blocks if ld.total_kv_blocks else 0.0
        hit = ld.prefix_hit_blocks / ld.prefix_query_blocks if ld.prefix_query_blocks else 0.0
        print(f"{i.name:<28} {_ROLES.get(i.role, '?'):<8} {i.address:<22} {_STATES.get(i.state, '?'):<9} "
              f"{ld.running_requests:>4} {ld.waiting_requests:>4} {ld.queued_prefill_tokens:>7} "
              f"{kv:>6.1%} {hit:>6.1%} {_uptime(i.uptime_s):>7}")
    return 0


def cmd_generate(stub, args) -> int:
    sampling = common_pb2.SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    req = conductor_pb2.GenerateRequest(prompt=args.prompt, raw=args.raw, sampling=sampling)
    start = time.perf_counter()
    first = None
    n = 0
    for chunk in stub.Generate(req, timeout=args.timeout):
        first = first if first is not None else time.perf_counter() - start
        n += len(chunk.token_ids)
        sys.stdout.write(chunk.text)
        sys.stdout.flush()
        if chunk.finish_reason:
            sys.stdout.write("\n")
            print(f"[{n} tokens, first after {first:.2f}s, finish={chunk.finish_reason}]", file=sys.stderr)
    return 0


def cmd_drain(stub, args, drain: bool) -> int:
    reply = stub.SetDrain(conductor_pb2.SetDrainRequest(name=args.instance, drain=drain), timeout=TIMEOUT_S)
    print(f"{args.instance}: {_STATES.get(reply.state, '?')}")
    return 0


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f}MiB"


def cmd_store(args) -> int:
    with grpc.insecure_channel(args.store) as channel:
        reply = store_pb2_grpc.StoreMasterStub(channel).PoolStats(store_pb2.PoolStatsRequest(), timeout=TIMEOUT_S)
    if args.json:
        print(json.dumps(MessageToDict(reply, preserving_proto_field_name=True)))
        return 0
    lookups = reply.hits + reply.misses
    print(f"{reply.objects} objects, hit rate {reply.hits / lookups if lookups else 0:.1%} ({reply.hits}/{lookups}), "
          f"{reply.evictions} evictions, {reply.demotions} demotions, {reply.promotions} promotions")
    print(f"{'SEGMENT':<40} {'OWNER':<28} {'TIER':<6} {'USED':>10} {'CAPACITY':>10} {'USE':>6} {'OBJECTS':>8}")
    for seg in reply.segments:
        use = seg.used / seg.capacity if seg.capacity else 0.0
        print(f"{seg.name:<40} {seg.owner:<28} {seg.medium:<6} {_mib(seg.used):>10} {_mib(seg.capacity):>10} "
              f"{use:>6.1%} {seg.objects:>8}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="mooncakectl", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--conductor", default=os.environ.get("MOONCAKED_CONDUCTOR", "127.0.0.1:50051"),
                   help="HOST:PORT of the conductor's gRPC (env MOONCAKED_CONDUCTOR)")
    sub = p.add_subparsers(dest="command", required=True)
    st = sub.add_parser("status", help="a table of the cluster's instances")
    st.add_argument("--json", action="store_true")
    g = sub.add_parser("generate", help="stream tokens for a prompt")
    g.add_argument("prompt")
    g.add_argument("--raw", action="store_true", help="plain completion, no chat template")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--store", default=os.environ.get("MOONCAKED_STORE", "127.0.0.1:50052"),
                   help="HOST:PORT of the store master (env MOONCAKED_STORE), for `store`")
    s = sub.add_parser("store", help="KV pool use per segment and tier, objects, hit rate, evictions")
    s.add_argument("--json", action="store_true")
    for name in ("drain", "undrain"):
        d = sub.add_parser(name, help=f"{name} an instance (by name, see status)")
        d.add_argument("instance")
    args = p.parse_args(argv)
    if args.command == "store":
        try:
            return cmd_store(args)
        except grpc.RpcError as e:
            print(f"mooncakectl: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    with grpc.insecure_channel(args.conductor) as channel:
        stub = conductor_pb2_grpc.ConductorStub(channel)
        try:
            if args.command == "status":
                return cmd_status(stub, args)
            if args.command == "generate":
                return cmd_generate(stub, args)
            return cmd_drain(stub, args, args.command == "drain")
        except grpc.RpcError as e:
            print(f"mooncakectl: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1


if __name__ == "__main__":
    sys.exit(main())
