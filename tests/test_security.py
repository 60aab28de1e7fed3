"""Mutual TLS, the cluster secret and the API key on a real cluster (conductor, store master,
prefill, decode as processes, certificates from a CA made with `openssl`): a peer without a
certificate the CA signed reaches no method of any role; one with a certificate but not the
secret cannot register, drain, reserve or touch the store; a live name cannot be taken over;
mooncakectl and the `openai` client with the right files work. Without security, a daemon
refuses to listen beyond loopback unless --insecure."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import openai
import pytest

from cluster import Cluster, free_port
from mooncaked.config import ConfigError, load_config
from mooncaked.proto.mooncake.v1 import (common_pb2, conductor_pb2, conductor_pb2_grpc, engine_pb2, engine_pb2_grpc,
                                         store_pb2, store_pb2_grpc)
from mooncaked.security import TOKEN_HEADER, Security, read_token
from mooncaked.startup import StartupError
from tls_helpers import Pki, make_pki, make_token

pytestmark = pytest.mark.timeout(300)

API_KEY = "sk-test-key-0123456789"
UNAUTH = grpc.StatusCode.UNAUTHENTICATED
Health = "/grpc.health.v1.Health/Check"


# -- the files ------------------------------------------------------------------------------------

def test_token_file_is_read_once_stripped_and_must_not_be_world_readable(tmp_path):
    path = make_token(tmp_path / "token", "  abcdefabcdefabcdef01  ")
    assert read_token(str(path)) == b"abcdefabcdefabcdef01"
    os.chmod(path, 0o644)
    with pytest.raises(StartupError, match=r"world-readable; run `chmod 0640") as e:
        read_token(str(path))
    assert "\n" not in str(e.value)
    short = make_token(tmp_path / "short", "abc")
    with pytest.raises(StartupError, match="shorter than 16"):
        read_token(str(short))
    with pytest.raises(StartupError, match="cannot read"):
        read_token(str(tmp_path / "missing"))


def test_tls_settings_come_together_and_a_mismatched_key_is_refused(tmp_path):
    import argparse

    args = argparse.Namespace(role="store", tls_cert="/x/cert.pem")
    with pytest.raises(ConfigError, match="tls_cert, tls_key and tls_ca together; missing tls_key, tls_ca"):
        load_config(args, {})
    a, b = make_pki(tmp_path / "a"), make_pki(tmp_path / "b")
    with pytest.raises(StartupError, match="does not fit"):
        Security.load(str(a.cert), str(b.key), str(a.ca))
    os.chmod(a.key, 0o644)
    with pytest.raises(StartupError, match="world-readable"):
        Security.load(str(a.cert), str(a.key), str(a.ca))


# -- loopback only without security ----------------------------------------------------------------

def _store_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "mooncaked.cli", "--role", "store", "--store-fast-path-port", "-1", *args]


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("MOONCAKED_")}


@pytest.mark.parametrize("flag", ["--listen", "--metrics"])
def test_listening_beyond_loopback_without_security_is_one_line_unless_insecure(flag, tmp_path):
    wild = f"0.0.0.0:{free_port()}"
    extra = [flag, wild] + (["--listen", "127.0.0.1:0"] if flag != "--listen" else [])
    out = subprocess.run(_store_cmd(*extra), env=_clean_env(), capture_output=True, text=True, timeout=60)
    assert out.returncode == 1, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"mooncaked: {flag} {wild} is reachable beyond this machine")
    assert "--insecure" in lines[0] and "--cluster-token-file" in lines[0]
    print(lines[0])
    for how in (["--insecure"], ["--cluster-token-file", str(make_token(tmp_path / "t"))]):
        proc = subprocess.Popen(_store_cmd(*extra, *how), env=_clean_env(), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        killer = threading.Timer(60, proc.kill)  # a daemon that never says where it listens fails, not hangs
        killer.start()
        try:
            seen = []
            for line in proc.stdout:
                seen.append(line)
                if "gRPC on" in line:
                    break
            assert "gRPC on" in seen[-1], "".join(seen)
            mode = "cluster token, no TLS" if "--cluster-token-file" in how else "insecure"
            assert f"security: {mode}" in seen[-1]
        finally:
            killer.cancel()
            proc.send_signal(signal.SIGTERM)
            proc.wait(20)


# -- a secured cluster -----------------------------------------------------------------------------

class SecureCluster(Cluster):
    """tests/cluster.py's processes, with TLS, the cluster token and an API key in their environment."""

    pki: Pki
    token: Path
    security: Security

    def status(self, conductor: str | None = None) -> conductor_pb2.StatusReply:
        with self.security.sync_channel(conductor or self.conductor) as ch:
            return conductor_pb2_grpc.ConductorStub(ch).Status(conductor_pb2.StatusRequest(), timeout=5)


@pytest.fixture(scope="module")
def secure(tiny_model_factory, tmp_path_factory):
    _, folder = tiny_model_factory("llama")
    files = tmp_path_factory.mktemp("pki")
    pki = make_pki(files / "cluster")
    token = make_token(files / "cluster-token")
    env = {**pki.env(), "MOONCAKED_CLUSTER_TOKEN_FILE": str(token), "MOONCAKED_API_KEY": API_KEY,
           "MOONCAKED_STORE_DRAM_BYTES": "4MiB"}
    c = SecureCluster(folder, tmp_path_factory.mktemp("secure-logs"), extra_env=env)
    c.pki, c.token = pki, token
    c.security = Security.load(str(pki.cert), str(pki.key), str(pki.ca), str(token))
    c.other = make_pki(files / "other")  # a CA the cluster does not trust, and its certificate
    try:
        store = f"127.0.0.1:{c.start('store', 'store')}"
        c.extra_env["MOONCAKED_STORE"] = store
        yield c.start_serving(scheme="https")
    finally:
        c.stop()


def _targets(c: SecureCluster) -> dict[str, str]:
    return {"conductor": c.conductor, "store": f"127.0.0.1:{c.ports['store']}", "p1": f"127.0.0.1:{c.ports['p1']}",
            "d1": f"127.0.0.1:{c.ports['d1']}"}


SERVICES = {"conductor": "mooncake.v1.Conductor", "store": "mooncake.v1.StoreMaster", "p1": "mooncake.v1.Engine",
            "d1": "mooncake.v1.Engine"}


def _every_method(role: str) -> list[tuple[str, bool]]:
    """(full method name, whether the server streams) of every method of the role's service."""
    from google.protobuf import descriptor_pool

    service = descriptor_pool.Default().FindServiceByName(SERVICES[role])
    return [(f"/{service.full_name}/{m.name}", m.server_streaming) for m in service.methods]


async def _raw_any(channel: grpc.aio.Channel, method: str, streaming: bool) -> None:
    """Call ``method`` with an empty request, reading a streamed answer through."""
    if streaming:
        call = channel.unary_stream(method, request_serializer=None, response_deserializer=None)
        async for _ in call(b"", timeout=5):
            pass
    else:
        await channel.unary_unary(method, request_serializer=None, response_deserializer=None)(b"", timeout=5)


def _calls(role: str) -> list[tuple[str, bytes]]:
    """(method, serialized request) a client might try on a role: its service's and health."""
    if role == "conductor":
        calls = [("/mooncake.v1.Conductor/Status", conductor_pb2.StatusRequest()),
                 ("/mooncake.v1.Conductor/Register", conductor_pb2.RegisterRequest(name="x"))]
    elif role == "store":
        calls = [("/mooncake.v1.StoreMaster/PoolStats", store_pb2.PoolStatsRequest()),
                 ("/mooncake.v1.StoreMaster/Remove", store_pb2.RemoveRequest(keys=["k"]))]
    else:
        calls = [("/mooncake.v1.Engine/Stats", engine_pb2.StatsRequest()),
                 ("/mooncake.v1.Engine/Drain", engine_pb2.DrainRequest(drain=True))]
    return [(m, r.SerializeToString()) for m, r in calls] + [(Health, b"")]


async def _raw_call(channel: grpc.aio.Channel, method: str, body: bytes) -> bytes:
    call = channel.unary_unary(method, request_serializer=None, response_deserializer=None)
    return await call(body, timeout=5)


async def test_no_method_of_any_role_answers_without_a_certificate_the_ca_signed(secure):
    other = Security.load(str(secure.other.cert), str(secure.other.key), str(secure.pki.ca),
                          str(secure.token))  # the right CA to check the server, a certificate it did not sign
    for role, address in _targets(secure).items():
        no_cert = grpc.ssl_channel_credentials(root_certificates=secure.pki.ca.read_bytes())  # TLS, no client cert
        for label, channel in (("plaintext", grpc.aio.insecure_channel(address)),
                               ("foreign certificate", other.channel(address)),
                               ("no client certificate", grpc.aio.secure_channel(address, no_cert))):
            async with channel:
                for method, body in _calls(role):
                    with pytest.raises(grpc.aio.AioRpcError) as e:
                        await _raw_call(channel, method, body)
                    assert e.value.code() == grpc.StatusCode.UNAVAILABLE, (role, label, method, e.value)
                for method, streaming in _every_method(role):  # every other method of the service too
                    with pytest.raises(grpc.aio.AioRpcError) as e:
                        await _raw_any(channel, method, streaming)
                    assert e.value.code() == grpc.StatusCode.UNAVAILABLE, (role, label, method, e.value)
        # the same calls with the cluster's certificate and token are answered (the open ones at least)
        async with secure.security.channel(address) as ch:
            await _raw_call(ch, Health, b"")


async def test_a_certificate_without_the_secret_cannot_register_drain_reserve_or_touch_the_store(secure):
    certified = Security.load(str(secure.pki.cert), str(secure.pki.key), str(secure.pki.ca))  # no token
    t = _targets(secure)
    # every method of every role but the client's Generate is refused, before its request is parsed
    for role, address in t.items():
        async with certified.channel(address) as ch:
            for method, streaming in _every_method(role):
                if method == "/mooncake.v1.Conductor/Generate":
                    continue
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await _raw_any(ch, method, streaming)
                assert e.value.code() == UNAUTH, (role, method, e.value)
    async with certified.channel(t["conductor"]) as ch:
        stub = conductor_pb2_grpc.ConductorStub(ch)
        for name, req in (("Status", conductor_pb2.StatusRequest()),  # it lists every address in the cluster
                          ("Register", conductor_pb2.RegisterRequest(name="p1", role=common_pb2.ROLE_PREFILL,
                                                                      address="127.0.0.1:1")),
                          ("Heartbeat", conductor_pb2.HeartbeatRequest(name="p1")),
                          ("Deregister", conductor_pb2.DeregisterRequest(name="p1")),
                          ("SetDrain", conductor_pb2.SetDrainRequest(name="p1", drain=True))):
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await getattr(stub, name)(req, timeout=5)
            assert e.value.code() == UNAUTH, name
            assert "--cluster-token-file" in e.value.details()
    for engine in ("p1", "d1"):
        async with certified.channel(t[engine]) as ch:
            stub = engine_pb2_grpc.EngineStub(ch)
            for name, req in (("Drain", engine_pb2.DrainRequest(drain=True)),
                              ("Reserve", engine_pb2.ReserveRequest(request_id="r", prompt_token_ids=[5] * 8)),
                              ("Prefill", engine_pb2.PrefillRequest(request_id="r")),
                              ("Abort", engine_pb2.AbortRequest(request_id="r")),
                              ("Stats", engine_pb2.StatsRequest())):
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await getattr(stub, name)(req, timeout=5)
                assert e.value.code() == UNAUTH, (engine, name)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                [x async for x in stub.Decode(engine_pb2.DecodeRequest(request_id="r"), timeout=5)]
            assert e.value.code() == UNAUTH
    async with certified.channel(t["store"]) as ch:
        stub = store_pb2_grpc.StoreMasterStub(ch)
        for name, req in (("Remove", store_pb2.RemoveRequest(keys=["k"])),
                          ("UnmountSegment", store_pb2.UnmountSegmentRequest(client_id="p1", segment="p1/dram")),
                          ("PutStart", store_pb2.PutStartRequest(key="k")),
                          ("ReservePlaces", store_pb2.ReservePlacesRequest()),
                          ("PoolStats", store_pb2.PoolStatsRequest())):
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await getattr(stub, name)(req, timeout=5)
            assert e.value.code() == UNAUTH, name
        for name, req in (("WatchPool", store_pb2.WatchPoolRequest()), ("Tasks", store_pb2.TasksRequest())):
            with pytest.raises(grpc.aio.AioRpcError) as e:
                [x async for x in getattr(stub, name)(req, timeout=5)]
            assert e.value.code() == UNAUTH, name
    # nothing changed: both engines still serve, neither is draining
    st = secure.status()
    assert {(i.name, i.state) for i in st.instances} == {("p1", 2), ("d1", 2)}


class _FakePrefill(engine_pb2_grpc.EngineServicer):
    """An engine that keeps every prompt it is sent: what an attacker's registered instance would."""

    def __init__(self) -> None:
        self.captured: list[list[int]] = []

    async def Reserve(self, request, context):
        self.captured.append(list(request.prompt_token_ids))
        return engine_pb2.ReserveReply()

    async def Prefill(self, request, context):
        self.captured.append(list(request.prompt_token_ids))
        return engine_pb2.PrefillReply(first_token_id=5)

    async def Stats(self, request, context):
        return engine_pb2.StatsReply()


async def test_a_fake_prefill_cannot_register_or_take_over_a_live_name_and_captures_nothing(secure):
    from mooncaked.rpc import RoleServer

    fake = _FakePrefill()
    # the fake even holds a certificate of the cluster's CA: all it lacks is the secret
    certified = Security.load(str(secure.pki.cert), str(secure.pki.key), str(secure.pki.ca))
    server = RoleServer("127.0.0.1:0", ["mooncake.v1.Engine"], security=certified)
    engine_pb2_grpc.add_EngineServicer_to_server(fake, server.server)
    port = await server.start()
    layout = secure.status()  # the real instances, to copy their layout and model from
    real = {i.name: i for i in layout.instances}
    try:
        async with certified.channel(secure.conductor) as ch:
            stub = conductor_pb2_grpc.ConductorStub(ch)
            for name in ("p1", "fake-prefill"):
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await stub.Register(conductor_pb2.RegisterRequest(
                        name=name, role=common_pb2.ROLE_PREFILL, address=f"127.0.0.1:{port}",
                        model_id=real["p1"].model_id), timeout=5)
                assert e.value.code() == UNAUTH
        # a cluster member (it has the secret) still cannot take over a name that is alive elsewhere
        async with secure.security.channel(secure.conductor) as ch:
            stub = conductor_pb2_grpc.ConductorStub(ch)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Register(conductor_pb2.RegisterRequest(
                    name="p1", role=common_pb2.ROLE_PREFILL, address=f"127.0.0.1:{port}",
                    model_id=real["p1"].model_id), timeout=5)
            assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS and "taken over" in e.value.details()
        # real prompts flow as usual, and none reaches the fake
        with openai.OpenAI(base_url=f"{secure.http}/v1", api_key=API_KEY, timeout=60, max_retries=0,
                           http_client=_verifying(secure)) as client:
            for i in range(20):
                out = client.completions.create(model=real["p1"].model_id, prompt=f"t{10 + i} t11",
                                                max_tokens=2)
                assert out.choices[0].text is not None
        assert fake.captured == []
        st = secure.status()
        assert {i.name: i.address for i in st.instances} == {n: i.address for n, i in real.items()}
    finally:
        await server.stop(0)


async def test_generate_needs_the_api_key_and_https_serves_the_openai_client(secure):
    req = conductor_pb2.GenerateRequest(prompt="t5 t6", raw=True, sampling=common_pb2.SamplingParams(max_tokens=2))
    async with secure.security.channel(secure.conductor) as ch:
        stub = conductor_pb2_grpc.ConductorStub(ch)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            [x async for x in stub.Generate(req, timeout=30)]
        assert e.value.code() == UNAUTH and "API key" in e.value.details()
        wrong = [("authorization", "Bearer nope")]
        with pytest.raises(grpc.aio.AioRpcError) as e:
            [x async for x in stub.Generate(req, timeout=30, metadata=wrong)]
        assert e.value.code() == UNAUTH
        chunks = [x async for x in stub.Generate(req, timeout=60, metadata=[("authorization", f"Bearer {API_KEY}")])]
        assert sum(len(c.token_ids) for c in chunks) == 2
    verify = _verifying(secure)
    with openai.OpenAI(base_url=f"{secure.http}/v1", api_key=API_KEY, timeout=60, max_retries=0,
                       http_client=verify) as client:
        messages = [{"role": "user", "content": "t7 t8"}]
        out = client.chat.completions.create(model=secure.status().model_id, messages=messages, max_tokens=3,
                                             extra_body={"ignore_eos": True})  # the tiny model may draw EOS
        assert out.usage.completion_tokens == 3
    with openai.OpenAI(base_url=f"{secure.http}/v1", api_key="wrong", timeout=60, max_retries=0,
                       http_client=_verifying(secure)) as client:
        with pytest.raises(openai.AuthenticationError):
            client.models.list()
    with openai.OpenAI(base_url=f"{secure.http}/v1", api_key=API_KEY, timeout=10, max_retries=0) as client:
        with pytest.raises(openai.APIConnectionError):  # the system's CAs do not know ours
            client.models.list()


async def test_http_routes_need_the_key_but_health_and_indexer_writes_need_the_secret(secure):
    import ssl

    import aiohttp

    ctx = ssl.create_default_context(cafile=str(secure.pki.ca))
    key = {"Authorization": f"Bearer {API_KEY}"}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ctx)) as s:
        async with s.get(f"{secure.http}/health") as r:
            assert r.status == 200
        async with s.get(f"{secure.http}/metrics") as r:
            assert r.status == 200  # open unless --metrics-require-key
        for path in ("/v1/models", "/query"):
            async with s.request("GET" if path == "/v1/models" else "POST", f"{secure.http}{path}", json={}) as r:
                assert r.status == 401, path
        body = {"instance_id": "evil", "endpoint": "http://10.0.0.1:1", "type": "prefill"}
        async with s.post(f"{secure.http}/register", json=body, headers=key) as r:
            assert r.status == 401 and (await r.json())["error"]["code"] == "invalid_cluster_token"
        async with s.post(f"{secure.http}/unregister", json=body,
                          headers={**key, TOKEN_HEADER: "0" * 32}) as r:
            assert r.status == 401
        async with s.post(f"{secure.http}/unregister", json=body,
                          headers={**key, TOKEN_HEADER: secure.token.read_text().strip()}) as r:
            assert r.status != 401, await r.text()


def _verifying(secure: SecureCluster):
    """An HTTP client for the openai package that trusts the cluster's CA (and only it)."""
    import ssl

    return openai.DefaultHttpxClient(verify=ssl.create_default_context(cafile=str(secure.pki.ca)))


def _ctl(secure: SecureCluster, *args: str, files: bool = True) -> subprocess.CompletedProcess:
    flags = (["--tls-cert", str(secure.pki.cert), "--tls-key", str(secure.pki.key), "--tls-ca", str(secure.pki.ca),
              "--cluster-token-file", str(secure.token), "--api-key", API_KEY] if files else [])
    return subprocess.run([sys.executable, "-m", "mooncaked.ctl", "--conductor", secure.conductor, *flags, *args],
                          env=_clean_env(), capture_output=True, text=True, timeout=60)


def test_mooncakectl_works_with_the_files_and_says_why_without_them(secure):
    out = _ctl(secure, "status", "--json")
    assert out.returncode == 0, out.stderr
    st = json.loads(out.stdout)
    assert {i["name"] for i in st["instances"]} == {"p1", "d1"} and st["store"]["reachable"]
    out = _ctl(secure, "store", "--json")
    assert out.returncode == 0, out.stderr
    assert any(s["owner"] == "p1" for s in json.loads(out.stdout)["segments"])
    out = _ctl(secure, "generate", "t3 t4", "--raw", "--max-tokens", "2")
    assert out.returncode == 0, out.stderr
    for cmd in ("drain", "undrain"):
        out = _ctl(secure, cmd, "p1")
        assert out.returncode == 0, out.stderr
    # at once: a heartbeat p1 composed before the undrain, arriving after its answer, no longer undoes it
    assert {(i.name, i.state) for i in secure.status().instances} == {("p1", 2), ("d1", 2)}
    out = _ctl(secure, "status", files=False)
    assert out.returncode == 1 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    print(out.stderr.strip())


@pytest.mark.parametrize("role", ["conductor", "prefill", "decode", "store"])
def test_the_example_configs_run_secured_beyond_loopback(role):
    import argparse

    from mooncaked.config import add_config_args
    from mooncaked.preflight import listen_addresses
    from mooncaked.security import check_exposure

    parser = argparse.ArgumentParser()
    add_config_args(parser)
    example = Path(__file__).parent.parent / "systemd" / "examples" / f"{role}.toml"
    cfg = load_config(parser.parse_args(["--role", role, "--config", str(example)]), {})
    assert cfg.tls_cert and cfg.tls_key and cfg.tls_ca and cfg.cluster_token_file and not cfg.insecure
    for path in (cfg.tls_cert, cfg.tls_key, cfg.tls_ca, cfg.cluster_token_file):
        assert Path(path).is_relative_to("/etc/mooncaked"), path
    check_exposure(listen_addresses(cfg), secured=True, insecure=False)
    with pytest.raises(StartupError, match="reachable beyond this machine"):  # what the same file does unguarded
        check_exposure(listen_addresses(cfg), secured=False, insecure=False)


def test_role_all_hands_tls_and_the_secret_to_every_child(tiny_model_factory, tmp_path):
    """`--role all` with TLS and a token: each child reads the files itself, and the cluster serves."""
    _, folder = tiny_model_factory("llama")
    pki, token = make_pki(tmp_path / "pki"), make_token(tmp_path / "token")
    conductor = f"127.0.0.1:{free_port()}"
    env = {**_clean_env(), **pki.env(), "MOONCAKED_CLUSTER_TOKEN_FILE": str(token), "MOONCAKED_BLOCK_SIZE": "4",
           "MOONCAKED_KV_CACHE_BYTES": "8MiB", "MOONCAKED_HEARTBEAT_INTERVAL_S": "0.3"}
    log_path = tmp_path / "all.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "mooncaked.cli", "--role", "all", "--model", str(folder),
                                 "--listen", conductor, "--http", "127.0.0.1:0"],
                                env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180
        while "cluster ready" not in log_path.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.2)
        text = log_path.read_text()
        assert "security: mTLS + cluster token" in text and f"--tls-ca {pki.ca}" in text
        ctl = [sys.executable, "-m", "mooncaked.ctl", "--conductor", conductor]
        files = ["--tls-cert", str(pki.cert), "--tls-key", str(pki.key), "--tls-ca", str(pki.ca)]
        out = subprocess.run([*ctl, *files, "--cluster-token-file", str(token), "generate", "t1 t2", "--raw",
                              "--max-tokens", "2"], env=_clean_env(), capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        out = subprocess.run([*ctl, *files, "drain", "nobody"], env=_clean_env(), capture_output=True, text=True,
                             timeout=60)  # a certificate but no secret: drain is refused
        assert out.returncode == 1 and "UNAUTHENTICATED" in out.stderr, out.stderr
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
