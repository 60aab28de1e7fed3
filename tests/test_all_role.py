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


def _running(pid: int) -> bool:
    """Alive and not a zombie (an exited child waits for a reaper that a container may lack)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


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
        children = [int(pid) for pid in subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True,
                                                       text=True).stdout.split()]
        assert len(children) >= 3, f"expected the store master, prefill and decode as children: {children}"
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
