"""A real etcd on loopback ports with a temporary data dir, for the store-master HA tests.

Started with a short election timeout (500 ms, heartbeat 50 ms) so that etcd grants 1-second
leases (its minimum TTL is 1.5 election timeouts): the tests' masters use them, which keeps
a failover near a second. Where `etcd` is not installed the tests that need it fail, naming it
(`.ci/setup` installs Debian's etcd-server): a skipped fail-over check is not a passing one.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from cluster import free_port

ETCD = shutil.which("etcd")


class Etcd:
    """One etcd member; `start()`, `kill()`, `start()` again on the same data dir and ports."""

    def __init__(self, data_dir: Path, log_path: Path) -> None:
        self.data_dir = data_dir
        self.log_path = log_path
        self.client_port = free_port()
        self.peer_port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    def start(self, timeout_s: float = 30.0) -> Etcd:
        assert ETCD is not None
        peer = f"http://127.0.0.1:{self.peer_port}"
        client = f"http://{self.endpoint}"
        cmd = [ETCD, "--name", "default", "--data-dir", str(self.data_dir),
               "--listen-client-urls", client, "--advertise-client-urls", client,
               "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
               "--initial-cluster", f"default={peer}", "--heartbeat-interval", "50", "--election-timeout", "500"]
        log = open(self.log_path, "a")
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {self.proc.returncode}: {self.log_path.read_text()[-3000:]}")
            if self.healthy():
                return self
            time.sleep(0.1)
        raise TimeoutError(f"etcd not healthy within {timeout_s}s: {self.log_path.read_text()[-3000:]}")

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.endpoint}/health", timeout=1) as r:
                return json.loads(r.read()).get("health") == "true"
        except (OSError, ValueError, urllib.error.URLError):
            return False

    def post(self, path: str, body: dict) -> dict:
        req = urllib.request.Request(f"http://{self.endpoint}{path}", data=json.dumps(body).encode(), method="POST")
        with urllib.request.urlopen(req, timeout=5) as r:
            return json.loads(r.read())

    def get(self, key: str) -> bytes | None:
        import base64

        kvs = self.post("/v3/kv/range", {"key": base64.b64encode(key.encode()).decode()}).get("kvs") or []
        return base64.b64decode(kvs[0]["value"]) if kvs else None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)
        if sig == signal.SIGKILL:
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[Etcd]:
    if ETCD is None:
        pytest.fail("etcd is not installed (Debian: apt-get install etcd-server; .ci/setup installs it)")
    server = Etcd(tmp_path / "etcd-data", tmp_path / "etcd.log").start()
    try:
        yield server
    finally:
        server.stop()
