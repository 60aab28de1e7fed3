"""`mooncaked --role all` as a user runs it, driven by `mooncakectl`, with systemd's notify socket."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from cluster import free_port

pytestmark = pytest.mark.timeout(300)


def _ctl(conductor: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mooncaked.ctl", "--conductor", conductor, *args],
                          capture_output=True, text=True, timeout=timeout)


def test_all_role_serves_mooncakectl_and_notifies_systemd(tiny_model_factory, tmp_path):
    _, folder = tiny_model_factory("llama")
    notify_path = tmp_path / "notify.sock"
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(notify_path))
    notify.settimeout(120)
    port = free_port()
    conductor = f"127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOONCAKED_")}
    env.update(NOTIFY_SOCKET=str(notify_path), MOONCAKED_BLOCK_SIZE="4", MOONCAKED_KV_CACHE_BYTES="8MiB",
               MOONCAKED_HEARTBEAT_INTERVAL_S="0.3")
    log = open(tmp_path / "all.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "mooncaked.cli", "--role", "all", "--model", str(folder),
                             "--listen", conductor, "--http", f"127.0.0.1:{free_port()}"],
                            env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        assert notify.recv(256) == b"READY=1"  # sent once the conductor sees a serving prefill and decode
        status = _ctl(conductor, "status", "--json")
        assert status.returncode == 0, status.stderr
        instances = json.loads(status.stdout)["instances"]
        assert sorted(i["role"] for i in instances) == ["ROLE_DECODE", "ROLE_PREFILL"]
        table = _ctl(conductor, "status")
        assert "prefill" in table.stdout and "serving" in table.stdout
        gen = _ctl(conductor, "generate", "t7 t8 t9", "--raw", "--max-tokens", "6")
        assert gen.returncode == 0, gen.stderr
        assert len(gen.stdout.split()) >= 1 and "finish=" in gen.stderr
        bad = _ctl(conductor, "drain", "no-such-instance")
        assert bad.returncode == 1 and "NOT_FOUND" in bad.stderr
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        assert notify.recv(256) == b"STOPPING=1"
    finally:
        if proc.poll() is None:
            proc.kill()
        notify.close()
    time.sleep(0.5)
    leftovers = subprocess.run(["pgrep", "-f", f"mooncaked.*{port}"], capture_output=True, text=True).stdout
    assert leftovers.strip() == "", "children outlived the `all` process"
