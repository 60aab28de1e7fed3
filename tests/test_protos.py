"""The wire: generated code is fresh, imports as a package, round-trips, and serves over real gRPC."""

from __future__ import annotations

import importlib
import importlib.util
import pkgutil
import sys
from pathlib import Path

import grpc
import pytest

ROOT = Path(__file__).resolve().parent.parent


def _gen_protos():
    spec = importlib.util.spec_from_file_location("gen_protos", ROOT / "tools" / "gen_protos.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("gen_protos", module)
    spec.loader.exec_module(module)
    return module


def test_generated_code_is_fresh():
    stale = _gen_protos().stale_files()
    assert not stale, (
        "mooncaked/proto/ is stale; run `python tools/gen_protos.py` and commit the result:\n  "
        + "\n  ".join(stale)
    )


def test_check_mode_reports_stale_files(tmp_path):
    gen = _gen_protos()
    out = tmp_path / "proto"
    out.mkdir()
    gen.write(out)
    assert gen.stale_files(out) == []
    (out / "mooncake" / "v1" / "engine_pb2.py").write_text("# edited by hand\n")
    (out / "mooncake" / "v1" / "gone_pb2.py").write_text("")
    assert gen.stale_files(out) == [
        "mooncake/v1/engine_pb2.py (differs)",
        "mooncake/v1/gone_pb2.py (orphaned: no .proto produces it)",
    ]
    gen.write(out)
    assert gen.stale_files(out) == []
    assert not (out / "mooncake" / "v1" / "gone_pb2.py").exists()


def test_every_module_imports_as_a_package():
    import mooncaked.proto as root

    names = [m.name for m in pkgutil.walk_packages(root.__path__, root.__name__ + ".")]
    for service in ("common", "engine", "conductor", "transfer", "store"):
        assert f"mooncaked.proto.mooncake.v1.{service}_pb2" in names
        assert f"mooncaked.proto.mooncake.v1.{service}_pb2_grpc" in names
    for name in names:
        importlib.import_module(name)
    # the generated code must never need protos/'s output on sys.path (`mooncake` is also the
    # name of Mooncake's own Transfer Engine package, so a bare import could even find that)
    for path in (ROOT / "mooncaked" / "proto").rglob("*_pb2*.py*"):
        for line in path.read_text().splitlines():
            assert not line.startswith(("from mooncake.", "import mooncake.")), f"{path.name}: {line}"


def test_round_trip_each_service():
    from mooncaked.proto.mooncake.v1 import common_pb2 as c
    from mooncaked.proto.mooncake.v1 import conductor_pb2 as cd
    from mooncaked.proto.mooncake.v1 import engine_pb2 as e
    from mooncaked.proto.mooncake.v1 import store_pb2 as s
    from mooncaked.proto.mooncake.v1 import transfer_pb2 as t

    endpoint = c.TransferEndpoint(address="10.0.0.2:7001", backend="tcp", region="kv", same_host_id="h1")
    layout = c.KVLayout(num_layers=2, block_size=16, num_kv_heads=2, head_dim=64, dtype="float32",
                        element_size=4, num_blocks=10, bytes_per_block=16 * 2 * 64 * 4)
    sampling = c.SamplingParams(max_tokens=8, temperature=0.7, top_p=0.9, seed=0, stop=["\n"],
                                stop_token_ids=[2])
    messages = [
        e.PrefillRequest(request_id="r1", prompt_token_ids=[1, 2, 3], sampling=sampling,
                         decode_endpoint=endpoint, decode_block_ids=[4, 5], decode_layout=layout),
        e.TokenChunk(token_ids=[7, 8], text="hi", logprobs=[-0.5, -1.0], finish_reason="stop"),
        cd.GenerateRequest(request_id="r2", messages=cd.ChatMessages(
            messages=[cd.ChatMessage(role="user", content="hello")]), sampling=sampling),
        cd.HeartbeatRequest(name="prefill-a", state=c.INSTANCE_STATE_SERVING,
                            load=c.InstanceLoad(running_requests=3, free_kv_blocks=100),
                            events=[c.KVEvent(kind=c.KVEvent.KIND_STORED, block_hashes=[2**64 - 1, 1],
                                              medium="hbm", instance="prefill-a")]),
        cd.RegisterRequest(name="decode-a", role=c.ROLE_DECODE, address="10.0.0.2:50061",
                           layout=layout, transfer=endpoint),
        t.SegmentInfo(name="dram-0", owner="prefill-a", endpoint=endpoint, nbytes=1 << 30, medium="dram"),
        s.BatchGetReplicasReply(objects=[s.ObjectReplicas(
            key="default/123", replicas=[s.Replica(segment="dram-0", offset=4096, size=8192,
                                                   endpoint=endpoint, medium="dram")])], lease_s=5.0),
    ]
    for msg in messages:
        again = type(msg).FromString(msg.SerializeToString())
        assert again == msg

    # presence: seed=0 is a choice, an unset seed is not
    assert sampling.HasField("seed") and sampling.seed == 0
    assert not c.SamplingParams().HasField("seed")
    assert not c.SamplingParams().HasField("top_p")
    req = cd.GenerateRequest(prompt="hi")
    assert req.WhichOneof("input") == "prompt"


class _Engine:
    """The smallest Engine that proves the generated servicer and stub agree."""

    async def Reserve(self, request, context):
        from mooncaked.proto.mooncake.v1 import common_pb2, engine_pb2

        n = -(-len(request.prompt_token_ids) // 4)
        return engine_pb2.ReserveReply(block_ids=list(range(n)),
                                       endpoint=common_pb2.TransferEndpoint(address="127.0.0.1:1"))

    async def Decode(self, request, context):
        from mooncaked.proto.mooncake.v1 import engine_pb2

        for i in range(3):
            yield engine_pb2.TokenChunk(token_ids=[request.first_token_id + i],
                                        finish_reason="length" if i == 2 else "")

    async def Abort(self, request, context):
        await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown request {request.request_id!r}")


async def test_engine_stub_over_loopback():
    from mooncaked.proto.mooncake.v1 import engine_pb2, engine_pb2_grpc

    servicer_cls = type("Servicer", (_Engine, engine_pb2_grpc.EngineServicer), {})
    server = grpc.aio.server()
    engine_pb2_grpc.add_EngineServicer_to_server(servicer_cls(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    assert port > 0
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = engine_pb2_grpc.EngineStub(channel)
            reply = await stub.Reserve(engine_pb2.ReserveRequest(request_id="r", prompt_token_ids=range(9)),
                                       timeout=5)
            assert list(reply.block_ids) == [0, 1, 2]
            assert reply.endpoint.address == "127.0.0.1:1"

            chunks = [c async for c in stub.Decode(engine_pb2.DecodeRequest(request_id="r", first_token_id=10),
                                                   timeout=5)]
            assert [list(c.token_ids) for c in chunks] == [[10], [11], [12]]
            assert chunks[-1].finish_reason == "length"

            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Abort(engine_pb2.AbortRequest(request_id="x"), timeout=5)
            assert err.value.code() == grpc.StatusCode.NOT_FOUND

            # a method the servicer leaves to the generated base says so, not hangs
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Stats(engine_pb2.StatsRequest(), timeout=5)
            assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        await server.stop(grace=None)
