"""Start real `mooncaked` processes on loopback ports for the cluster tests."""

from __future__ import annotations

import itertools
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from mooncaked.proto.mooncake.v1 import conductor_pb2, conductor_pb2_grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from ports import free_port  # noqa: E402  (one walk of this process's ports, shared with the tools)

__all__ = ["Cluster", "free_port"]


@dataclass
class Cluster:
    model: Path
    log_dir: Path
    extra_env: dict[str, str] = field(default_factory=dict)
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    ports: dict[str, int] = field(default_factory=dict)
    conductor_port: int = 0
    http: str = ""  # the conductor's HTTP base URL, once start_serving has run
    also_conductors: list[str] = field(default_factory=list)  # beside the first (start_conductor): engines use all

    @property
    def conductor(self) -> str:
        return f"127.0.0.1:{self.conductor_port}"

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("MOONCAKED_")}
        env.update({
            "MOONCAKED_MODEL": str(self.model),
            "MOONCAKED_BLOCK_SIZE": "4",
            "MOONCAKED_KV_CACHE_BYTES": "8MiB",
            "MOONCAKED_HEARTBEAT_INTERVAL_S": "0.3",
            "MOONCAKED_HEARTBEAT_TIMEOUT_S": "2",
            "MOONCAKED_DRAIN_TIMEOUT_S": "5",
            "MOONCAKED_LOG_LEVEL": "INFO",
            "PYTHONUNBUFFERED": "1",
        })
        env.update(self.extra_env)
        return env

    def start(self, name: str, role: str, *args: str, wait: bool = True) -> int:
        """Start one role listening on a port it picks itself (port 0: nothing can take it between
        pick and bind); returns that port once the process has printed it (``wait=False``: returns 0 at
        once, for a role that cannot serve yet, such as an engine whose conductor is not up)."""
        cmd = [sys.executable, "-m", "mooncaked.cli", "--role", role, "--listen", "127.0.0.1:0", "--name", name,
               *args]
        if role in ("prefill", "decode"):
            cmd += ["--conductor", ",".join([self.conductor, *self.also_conductors])]
        elif role == "conductor" and "--http" not in args:
            cmd += ["--http", "127.0.0.1:0"]  # any free port: parallel runs must not fight over 8000
        path = self.log_dir / f"{name}.log"
        if path.exists():  # a restart: log() reads the new process's, the old one's stays for a post-mortem
            path.rename(next(p for k in itertools.count(1) if not (p := self.log_dir / f"{name}.{k}.log").exists()))
        log = open(path, "w")
        self.procs[name] = subprocess.Popen(cmd, env=self.env(), stdout=log, stderr=subprocess.STDOUT)
        if not wait:
            return 0
        port = self._printed_port(name, r"gRPC on [^ ]*:(\d+)")
        self.ports[name] = port
        if role == "conductor":
            self.conductor_port = port
        return port

    def start_conductor(self, name: str, *args: str, port: int = 0) -> str:
        """One more conductor beside the first (``self.conductor`` stays the first); engines started after
        it register with every one. ``port``: restart one on the port it had. Returns its gRPC address."""
        first = self.conductor_port
        listen = ("--listen", f"127.0.0.1:{port}") if port else ()
        address = f"127.0.0.1:{self.start(name, 'conductor', *listen, *args)}"
        if first:
            self.conductor_port = first
            if address != self.conductor and address not in self.also_conductors:
                self.also_conductors.append(address)
        return address

    def start_serving(self, prefills: tuple[str, ...] = ("p1",), decodes: tuple[str, ...] = ("d1",),
                      scheme: str = "http") -> "Cluster":
        """The usual shape: a conductor with its HTTP front (``self.http``), then prefill and decode
        instances; returns once they all serve."""
        self.start("conductor", "conductor")
        self.http = f"{scheme}://127.0.0.1:{self.http_port('conductor')}"
        for name in prefills:
            self.start(name, "prefill")
        for name in decodes:
            self.start(name, "decode")
        self.wait_serving([*prefills, *decodes])
        return self

    def printed(self, name: str, pattern: str, timeout_s: float = 120) -> re.Match:
        """Wait until ``name``'s log holds ``pattern`` (its first match); an exit meanwhile is an error."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            m = re.search(pattern, self.log(name))
            if m:
                return m
            if self.procs[name].poll() is not None:
                raise RuntimeError(f"{name} exited with {self.procs[name].returncode}: {self.log(name)[-3000:]}")
            time.sleep(0.1)
        raise TimeoutError(f"{name} did not print /{pattern}/ in {timeout_s}s: {self.log(name)[-3000:]}")

    def _printed_port(self, name: str, pattern: str, timeout_s: float = 120) -> int:
        return int(self.printed(name, pattern, timeout_s).group(1))

    def http_port(self, name: str) -> int:
        return self._printed_port(name, r"HTTP on [^ ]*:(\d+)")

    def metrics_port(self, name: str) -> int:
        return self._printed_port(name, r"metrics on http://[^ ]*:(\d+)/metrics")

    def status(self, conductor: str | None = None) -> conductor_pb2.StatusReply:
        with grpc.insecure_channel(conductor or self.conductor) as ch:
            return conductor_pb2_grpc.ConductorStub(ch).Status(conductor_pb2.StatusRequest(), timeout=5)

    def wait_serving(self, names: list[str], timeout_s: float = 120, conductor: str | None = None) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for n, p in self.procs.items():
                if p.poll() is not None:
                    raise RuntimeError(f"{n} exited with {p.returncode}: {self.log(n)[-3000:]}")
            try:
                st = self.status(conductor)
                serving = {i.name for i in st.instances if i.state == 2}
                if set(names) <= serving:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.3)
        raise TimeoutError(f"{names} not serving after {timeout_s}s")

    def log(self, name: str) -> str:
        return (self.log_dir / f"{name}.log").read_text()

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        self.procs[name].send_signal(sig)

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
