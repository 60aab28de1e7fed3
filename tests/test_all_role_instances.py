"""`mooncaked --role all --prefill-instances 2 --decode-instances 2`: a bigger embedded cluster on one
machine, each engine a process of its own (its own ports and name), ready only once all four serve."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import grpc
import pytest

from cluster import free_port
from mooncaked.config import AllConfig, DecodeConfig, HostPort, PrefillConfig
from mooncaked.proto.mooncake.v1 import common_pb2, conductor_pb2, conductor_pb2_grpc
from mooncaked.roles.all_role import child_configs, engine_threads

STORE = HostPort("127.0.0.1", 50099)  # where the embedded store said it listens

pytestmark = pytest.mark.timeout(300)


def _start_all(folder, tmp_path, *flags: str):
    """`mooncaked --role all` on a tiny model with these flags: (process, its log file, the log's path, the
    conductor's address)."""
    conductor = f"127.0.0.1:{free_port()}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOONCAKED_") and k != "NOTIFY_SOCKET"}
    env.update(MOONCAKED_BLOCK_SIZE="4", MOONCAKED_KV_CACHE_BYTES="8MiB", MOONCAKED_HEARTBEAT_INTERVAL_S="0.3",
               MOONCAKED_STORE_DRAM_BYTES="4MiB")
    log_path = tmp_path / "all.log"
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "mooncaked.cli", "--role", "all", "--model", str(folder),
                             "--listen", conductor, "--http", "127.0.0.1:0", *flags], env=env, stdout=log,
                            stderr=subprocess.STDOUT)
    return proc, log, log_path, conductor


def _wait_ready(proc, log_path) -> None:
    deadline = time.monotonic() + 240
    while not re.search(r"mooncaked all: cluster ready", log_path.read_text()):
        assert proc.poll() is None, f"exited with {proc.returncode}: {log_path.read_text()[-3000:]}"
        assert time.monotonic() < deadline, log_path.read_text()[-3000:]
        time.sleep(0.1)


def test_child_configs_give_each_engine_its_own_ports_and_lmdb_folder(tmp_path):
    """An LMDB folder each, for the engines that lend DRAM (an LMDB tier's objects are served through it):
    the prefills by default, every engine once --store-dram-bytes is set."""
    cfg = AllConfig(prefill_instances=3, decode_instances=2, store_lmdb_path=str(tmp_path), store_lmdb_bytes=1 << 26)
    children = child_configs(cfg, STORE)
    assert [c.role for c in children] == ["conductor", "prefill", "prefill", "prefill", "decode", "decode"]
    assert all(c.store == STORE for c in children)
    engines = [c for c in children if isinstance(c, (PrefillConfig, DecodeConfig))]
    assert all(c.listen.port == 0 and c.transfer_listen.port == 0 and not c.name for c in engines)
    assert all(c.store_dram_bytes > 0 for c in engines if c.role == "prefill")
    assert sorted(os.path.basename(c.store_lmdb_path) for c in engines if c.store_lmdb_path) == \
        ["prefill", "prefill-1", "prefill-2"]
    assert [(c.store_lmdb_path, c.store_lmdb_bytes) for c in engines if c.role == "decode"] == [(None, 0)] * 2
    lending = AllConfig(prefill_instances=3, decode_instances=2, store_lmdb_path=str(tmp_path),
                        store_lmdb_bytes=1 << 26, store_dram_bytes=1 << 26)
    engines = [c for c in child_configs(lending, STORE) if isinstance(c, (PrefillConfig, DecodeConfig))]
    assert sorted(os.path.basename(c.store_lmdb_path) for c in engines) == \
        ["decode", "decode-1", "prefill", "prefill-1", "prefill-2"]
    assert {c.store_lmdb_bytes for c in engines} == {1 << 26}


def test_the_cores_are_shared_out_among_the_engines_unless_the_user_says(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert [engine_threads(n, cores=8) for n in (1, 2, 3, 8, 9)] == [8, 4, 2, 1, 1]
    cores = len(os.sched_getaffinity(0))
    cfg = AllConfig(prefill_instances=2, decode_instances=1)
    engines = [c for c in child_configs(cfg, STORE) if isinstance(c, (PrefillConfig, DecodeConfig))]
    assert [c.threads for c in engines] == [max(1, cores // 3)] * 3
    explicit = AllConfig(prefill_instances=2, decode_instances=1, threads=5)
    assert {c.threads for c in child_configs(explicit, STORE) if isinstance(c, (PrefillConfig, DecodeConfig))} == {5}
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # torch reads it in each engine process
    assert engine_threads(2, cores=8) == 0
    assert {c.threads for c in child_configs(cfg, STORE) if isinstance(c, (PrefillConfig, DecodeConfig))} == {0}


def test_two_prefills_and_two_decodes_start_and_serve(tiny_model_factory, tmp_path):
    _, folder = tiny_model_factory("llama")
    proc, log, log_path, conductor = _start_all(folder, tmp_path, "--prefill-instances", "2", "--decode-instances", "2")
    try:
        _wait_ready(proc, log_path)
        with grpc.insecure_channel(conductor) as ch:
            stub = conductor_pb2_grpc.ConductorStub(ch)
            st = stub.Status(conductor_pb2.StatusRequest(without_pool_stats=True), timeout=10)
            assert sorted(i.role for i in st.instances) == [common_pb2.ROLE_PREFILL] * 2 + [common_pb2.ROLE_DECODE] * 2
            assert all(i.state == common_pb2.INSTANCE_STATE_SERVING for i in st.instances)
            assert len({i.name for i in st.instances}) == 4 and len({i.address for i in st.instances}) == 4
            req = conductor_pb2.GenerateRequest(prompt="t1 t2 t3 t4 t5", raw=True,
                                                sampling=common_pb2.SamplingParams(max_tokens=4, ignore_eos=True))
            chunks = list(stub.Generate(req, timeout=120))
        assert sum(len(c.token_ids) for c in chunks) == 4
        assert chunks[0].prefill_instance in {i.name for i in st.instances}
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(90) == 0
    except BaseException:
        log.flush()
        print("--- the `all` process's log (tail) ---\n" + log_path.read_text()[-6000:])
        raise
    finally:
        if proc.poll() is None:
            proc.kill()


def test_pipeline_stages_make_each_prefill_instance_a_group(tmp_path):
    cfg = AllConfig(prefill_instances=2, decode_instances=1, pipeline_stages=3, cpp_chunk_tokens=64)
    prefills = [c for c in child_configs(cfg, STORE) if isinstance(c, PrefillConfig)]
    assert [(c.pipeline_group, c.pipeline_stage) for c in prefills] == \
        [("group-0", (k, 3)) for k in range(3)] + [("group-1", (k, 3)) for k in range(3)]
    assert all(c.cpp_chunk_tokens == 64 for c in prefills)
    assert prefills[1].engine_config().pipeline_stage == (1, 3)
    assert prefills[1].engine_config().max_num_batched_tokens == 64  # the chunk is the stage's step budget


def test_one_machine_serves_through_a_pipeline_group(tiny_model_factory, tmp_path):
    """`--role all --pipeline-stages 2`: ready once both stages and the decode serve; a request goes
    through the group's head and answers as one engine does; status shows the stages."""
    from mooncaked.engine import Engine, SamplingParams

    _, folder = tiny_model_factory("llama")
    proc, log, log_path, conductor = _start_all(folder, tmp_path, "--pipeline-stages", "2", "--cpp-chunk-tokens", "8")
    try:
        _wait_ready(proc, log_path)
        prompt = list(range(10, 50))  # five chunks
        with grpc.insecure_channel(conductor) as ch:
            stub = conductor_pb2_grpc.ConductorStub(ch)
            st = stub.Status(conductor_pb2.StatusRequest(without_pool_stats=True), timeout=10)
            stages = sorted((i.pipeline.stage, i.name) for i in st.instances if i.HasField("pipeline"))
            assert [k for k, _ in stages] == [0, 1]
            assert {i.pipeline.group for i in st.instances if i.HasField("pipeline")} == {"group-0"}
            req = conductor_pb2.GenerateRequest(token_ids=conductor_pb2.TokenIds(ids=prompt),
                                                sampling=common_pb2.SamplingParams(max_tokens=6, ignore_eos=True))
            chunks = list(stub.Generate(req, timeout=120))
        ref = Engine.from_pretrained(folder, block_size=4, kv_cache_bytes=8 << 20)
        want = ref.generate(prompt, SamplingParams(max_tokens=6, ignore_eos=True))[0].token_ids
        assert [t for c in chunks for t in c.token_ids] == want
        assert chunks[0].prefill_instance == stages[0][1]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(90) == 0
    except BaseException:
        log.flush()
        print("--- the `all` process's log (tail) ---\n" + log_path.read_text()[-6000:])
        raise
    finally:
        if proc.poll() is None:
            proc.kill()


async def test_the_parent_hears_only_its_children_each_for_itself(capsys):
    """The children's socket is in the abstract namespace, where any local process can send: a port report
    or error line from a process that is not a child (here: the test itself), or a child's report for
    another pid, is dropped; a child's own report is taken."""
    import asyncio

    from mooncaked.roles.all_role import ChildPorts, _hear_children, _parent_socket
    from mooncaked.startup import _send_parent, tell_parent

    sock, _ = _parent_socket()
    ports, ready = ChildPorts(), asyncio.get_running_loop().create_future()
    pids: set[int] = set()
    hearing = asyncio.ensure_future(_hear_children(sock, ready, ports, lambda: pids))
    try:
        child = subprocess.Popen([sys.executable, "-c", (
            "import sys, time\n"
            "from mooncaked.startup import _send_parent, tell_parent_port\n"
            "parent = int(sys.argv[1])\n"
            "_send_parent(parent, f'MOONCAKED_PORT=store {parent} 7777')\n"  # for another pid: dropped
            "time.sleep(0.3)\n"
            "assert tell_parent_port(parent, 'store', 1234)\n"), str(os.getpid())])
        pids.add(child.pid)
        # forged by a process that is not a child (this one), in the child's name, before the child speaks
        assert _send_parent(os.getpid(), f"MOONCAKED_PORT=store {child.pid} 6666")
        assert tell_parent(os.getpid(), "a forged error line")
        forged_for_parent = ports.future("store", os.getpid())
        assert await asyncio.wait_for(ports.future("store", child.pid), 30) == 1234
        assert child.wait(30) == 0
        assert not forged_for_parent.done()
        assert "forged" not in capsys.readouterr().err
    finally:
        hearing.cancel()
        await asyncio.gather(hearing, return_exceptions=True)
        sock.close()
