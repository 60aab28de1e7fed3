"""`mooncaked --role all` as a user runs it, driven by `mooncakectl`, with systemd's notify socket."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cluster import free_port
from mooncaked.proto.mooncake.v1 import common_pb2, conductor_pb2, conductor_pb2_grpc

pytestmark = pytest.mark.timeout(300)


def _ctl(conductor: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mooncaked.ctl", "--conductor", conductor, *args],
                          capture_output=True, text=True, timeout=timeout)


def _running(pid: int) -> bool:
    """Alive and not a zombie (an exited child waits for a reaper that a container may lack)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _printed(log_path, proc, pattern: str, timeout_s: float = 120) -> re.Match:
    """Wait until the process's output holds ``pattern``: what a user reads before acting."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        m = re.search(pattern, log_path.read_text())
        if m:
            return m
        assert proc.poll() is None, f"exited with {proc.returncode}: {log_path.read_text()[-3000:]}"
        time.sleep(0.05)
    raise TimeoutError(f"no /{pattern}/ in {timeout_s}s: {log_path.read_text()[-3000:]}")


def _grpc_generate(conductor: str) -> list[int]:
    req = conductor_pb2.GenerateRequest(prompt="t1 t2 t3", raw=True,
                                        sampling=common_pb2.SamplingParams(max_tokens=4, ignore_eos=True))
    with grpc.insecure_channel(conductor) as ch:
        return [t for c in conductor_pb2_grpc.ConductorStub(ch).Generate(req, timeout=120) for t in c.token_ids]


def _http_complete(http: str, model: str) -> tuple[int, dict]:
    body = json.dumps({"model": model, "prompt": "t4 t5 t6", "max_tokens": 4, "ignore_eos": True}).encode()
    req = urllib.request.Request(f"http://{http}/v1/completions", data=body,
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return r.status, json.loads(r.read())


def test_all_role_serves_mooncakectl_and_notifies_systemd(tiny_model_factory, tmp_path):
    _, folder = tiny_model_factory("llama")
    notify_path = tmp_path / "notify.sock"
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(notify_path))
    notify.settimeout(120)
    port = free_port()
    conductor = f"127.0.0.1:{port}"
    metrics = f"127.0.0.1:{free_port()}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOONCAKED_")}
    env.update(NOTIFY_SOCKET=str(notify_path), MOONCAKED_BLOCK_SIZE="4", MOONCAKED_KV_CACHE_BYTES="8MiB",
               MOONCAKED_HEARTBEAT_INTERVAL_S="0.3")
    log = open(tmp_path / "all.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "mooncaked.cli", "--role", "all", "--model", str(folder),
                             "--listen", conductor, "--http", "127.0.0.1:0", "--metrics", metrics],
                            env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        # ready means ready: requests sent the moment it says where it listens complete (they wait for
        # the engines), on both fronts
        m = _printed(tmp_path / "all.log", proc, r"mooncaked all: conductor on (\S+), HTTP on (\S+) ")
        assert m.group(1) == conductor
        with ThreadPoolExecutor(2) as pool:
            tokens = pool.submit(_grpc_generate, conductor)
            completion = pool.submit(_http_complete, m.group(2), folder.name)
            assert len(tokens.result()) == 4
            status, body = completion.result()
            assert status == 200 and body["usage"]["completion_tokens"] == 4
        assert notify.recv(256) == b"READY=1"  # sent once the conductor sees a serving prefill and decode
        children = [int(pid) for pid in subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True,
                                                       text=True).stdout.split()]
        assert len(children) >= 3, f"expected the store master, prefill and decode as children: {children}"
        titles = {}  # what ps shows: each child says what it is and whose (proc_title.py)
        for pid in children:
            title = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
            if "resource_tracker" not in title:  # multiprocessing's own helper
                titles[title.split()[1]] = title
        assert sorted(titles) == ["conductor", "decode", "prefill", "store"], titles
        for role, title in titles.items():
            assert re.fullmatch(rf"mooncaked {role} {role}-127\.0\.0\.1-\d+ \(of pid {proc.pid}\)", title), title
        # `pkill -f 'mooncaked --role all'` must reach the parent alone, which stops the children in order
        matching = {int(p) for p in subprocess.run(["pgrep", "-f", "mooncaked.* --role all"], capture_output=True,
                                                   text=True).stdout.split()}
        assert proc.pid in matching and not matching & set(children), (matching, titles)
        status = _ctl(conductor, "status", "--json")
        assert status.returncode == 0, status.stderr
        instances = json.loads(status.stdout)["instances"]
        assert sorted(i["role"] for i in instances) == ["decode", "prefill"]
        ready_line = _printed(tmp_path / "all.log", proc, r"mooncaked all: cluster ready \((.*)\)").group(1)
        for i in instances:  # one naming rule: ROLE-HOST-PORT with the port the engine bound, as printed
            assert i["name"] == f"{i['role']}-{i['address'].replace(':', '-')}"
            assert f"{i['name']} at {i['address']}" in ready_line
        table = _ctl(conductor, "status")
        assert "prefill" in table.stdout and "serving" in table.stdout
        gen = _ctl(conductor, "generate", "t7 t8 t9", "--raw", "--max-tokens", "6")
        assert gen.returncode == 0, gen.stderr
        assert len(gen.stdout.split()) >= 1 and "finish=" in gen.stderr
        # --metrics: every process's series on one page, each labelled with its process (roles/all_metrics.py)
        page = urllib.request.urlopen(f"http://{metrics}/metrics", timeout=30).read().decode()
        samples = {(s.name, s.labels.get("mooncaked_process")): s.value
                   for f in text_string_to_metric_families(page) for s in f.samples}
        assert {p: samples.get(("mooncaked_all_process_up", p)) for p in ("conductor", "store", "prefill", "decode")} \
            == {"conductor": 1.0, "store": 1.0, "prefill": 1.0, "decode": 1.0}
        assert samples[("mooncaked_conductor_generated_tokens_total", "conductor")] >= 8  # the two requests above
        assert ("process_resident_memory_bytes", "prefill") in samples
        assert ("mooncaked_store_objects", "store") in samples
        strangers = {(name, p) for name, p in samples if p != "conductor" and name.startswith("mooncaked_conductor_")}
        strangers |= {(name, p) for name, p in samples if p != "store" and name == "mooncaked_store_is_leader"}
        assert not strangers, "a process showing another role's series (at 0)"  # role_metrics.py
        bad = _ctl(conductor, "drain", "no-such-instance")
        assert bad.returncode == 1 and "NOT_FOUND" in bad.stderr and "Traceback" not in bad.stderr
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        assert notify.recv(256) == b"STOPPING=1"
    except BaseException:
        log.flush()
        print("--- the `all` process's log (tail) ---\n" + (tmp_path / "all.log").read_text()[-6000:])
        raise
    finally:
        if proc.poll() is None:
            proc.kill()
        notify.close()
    time.sleep(0.5)
    leftovers = [pid for pid in children if _running(pid)]
    assert not leftovers, f"children outlived the `all` process: {leftovers}"


def test_ctrl_c_stops_the_cluster_in_order_and_quietly(tiny_model_factory, tmp_path):
    """A terminal's Ctrl-C sends SIGINT to the whole foreground process group, every child and the engines'
    transfer I/O processes included. Only the parent may act on it: engines drain and deregister while the
    conductor and the store still answer, then those stop; nothing prints a traceback or a warning."""
    _, folder = tiny_model_factory("llama")
    conductor = f"127.0.0.1:{free_port()}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOONCAKED_") and k != "NOTIFY_SOCKET"}
    env.update(MOONCAKED_BLOCK_SIZE="4", MOONCAKED_KV_CACHE_BYTES="8MiB", MOONCAKED_HEARTBEAT_INTERVAL_S="0.3")
    log_path = tmp_path / "all.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "mooncaked.cli", "--role", "all", "--model", str(folder),
                                 "--listen", conductor, "--http", "127.0.0.1:0", "--log-level", "INFO"],
                                env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _printed(log_path, proc, r"mooncaked all: cluster ready")
        assert len(_grpc_generate(conductor)) == 4  # a request's KV went through the transfer I/O processes
        os.killpg(proc.pid, signal.SIGINT)  # as the terminal does: the process group, not the parent alone
        assert proc.wait(90) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = log_path.read_text()
    lines = text.splitlines()
    bad = [ln for ln in lines if "Traceback" in ln or " WARNING " in ln or " ERROR " in ln]
    assert not bad, "stopping was not quiet:\n" + "\n".join(bad) + "\n--- log tail ---\n" + text[-4000:]

    def at(pattern: str) -> int:
        return next(i for i, ln in enumerate(lines) if re.search(pattern, ln))

    engines_stopped = max(at(r"prefill-\S+ stopped"), at(r"decode-\S+ stopped"))
    assert engines_stopped < at(r"store-\S+ stopping"), text[-4000:]
