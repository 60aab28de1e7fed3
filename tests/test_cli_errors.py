"""What a user sees when `mooncaked` cannot start: one port is one daemon, and every failure a user
can cause is a line or two on stderr (no traceback) and a non-zero exit. Real processes, real ports."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
from pathlib import Path

import grpc
import gguf
import numpy as np
import pytest

from cluster import free_port
from mooncaked.rpc import RoleServer
from mooncaked.startup import StartupError

pytestmark = pytest.mark.timeout(300)

REPO = Path(__file__).resolve().parents[1]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOONCAKED_")}
    env.update(extra)
    return env


def _mooncaked(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mooncaked.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env or _env(), cwd=REPO)


def _start(*args: str, until: str, log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """A daemon, once it has printed a line containing `until` (its stdout goes on to `log`)."""
    proc = subprocess.Popen([sys.executable, "-m", "mooncaked.cli", *args], stdout=subprocess.PIPE,
                            stderr=open(log, "w"), text=True, env=env or _env(), cwd=REPO)
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if until in line:
            return proc
    proc.kill()
    raise AssertionError(f"{args} exited before printing {until!r}: {''.join(seen)}{log.read_text()[-3000:]}")


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _one_line(result: subprocess.CompletedProcess, *needles: str, most: int = 1) -> str:
    """The failure printed at most `most` lines, with no traceback, each needle in them, and exit 1 or 2."""
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode in (1, 2), (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    assert 1 <= len(lines) <= most, result.stderr
    for needle in needles:
        assert needle in result.stderr, (needle, result.stderr)
    return result.stderr


# ---------------------------------------------------------------------------------------------
# one port, one daemon


def test_grpc_servers_do_not_share_a_port():
    """gRPC's default SO_REUSEPORT would let a second server bind too; ours refuse, naming the flag."""
    async def run() -> None:
        first = RoleServer("127.0.0.1:0", [])
        port = await first.start()
        try:
            plain = grpc.aio.server()  # SO_REUSEPORT on: it would share the port of a server that allowed it
            with pytest.raises(RuntimeError):
                plain.add_insecure_port(f"127.0.0.1:{port}")
            with pytest.raises(StartupError, match=rf"--listen 127\.0\.0\.1:{port} is already in use"):
                await RoleServer(f"127.0.0.1:{port}", []).start()
        finally:
            await first.stop(0)

    asyncio.run(run())


def test_a_second_store_on_a_port_exits_with_one_line(tmp_path):
    port = free_port()
    first = _start("--role", "store", "--listen", f"127.0.0.1:{port}", until="gRPC on", log=tmp_path / "1.log")
    try:
        second = _mooncaked("--role", "store", "--listen", f"127.0.0.1:{port}", timeout=60)
        _one_line(second, f"--listen 127.0.0.1:{port} is already in use", "another mooncaked")
        assert second.returncode == 1
        # the fast path's port is exclusive as well
        fast = _mooncaked("--role", "store", "--listen", f"127.0.0.1:{free_port()}", "--store-fast-path-port",
                          str(port), timeout=60)
        _one_line(fast, f"--store-fast-path-port 127.0.0.1:{port} is already in use")
        assert first.poll() is None, "the first store master must keep running"
    finally:
        _stop(first)


def test_a_second_conductor_on_a_port_exits_with_one_line(tiny_model_factory, tmp_path):
    _, folder = tiny_model_factory("llama")
    port, http = free_port(), free_port()
    args = ["--role", "conductor", "--model", str(folder), "--listen", f"127.0.0.1:{port}"]
    first = _start(*args, "--http", f"127.0.0.1:{http}", until="HTTP on", log=tmp_path / "1.log")
    try:
        _one_line(_mooncaked(*args, "--http", f"127.0.0.1:{free_port()}", timeout=60),
                  f"--listen 127.0.0.1:{port} is already in use")
        _one_line(_mooncaked("--role", "conductor", "--model", str(folder), "--listen", f"127.0.0.1:{free_port()}",
                             "--http", f"127.0.0.1:{http}", timeout=60),
                  f"--http 127.0.0.1:{http} is already in use")
        _one_line(_mooncaked("--role", "conductor", "--model", str(folder), "--listen", f"127.0.0.1:{free_port()}",
                             "--http", f"127.0.0.1:{free_port()}", "--metrics", f"127.0.0.1:{http}", timeout=60),
                  f"--metrics 127.0.0.1:{http} is already in use")
        assert first.poll() is None
    finally:
        _stop(first)


def test_an_engine_names_a_busy_transfer_port(tiny_model_factory):
    _, folder = tiny_model_factory("llama")
    with socket.create_server(("127.0.0.1", 0)) as held:
        port = held.getsockname()[1]
        result = _mooncaked("--role", "prefill", "--model", str(folder), "--listen", f"127.0.0.1:{free_port()}",
                            "--conductor", f"127.0.0.1:{free_port()}", "--transfer-listen", f"127.0.0.1:{port}",
                            timeout=60)
    _one_line(result, f"--transfer-listen 127.0.0.1:{port} is already in use")


def test_an_engine_whose_conductor_never_answers_exits_with_one_line(tiny_model_factory):
    """No conductor at --conductor: within --join-timeout-s the engine says so, naming the flag, and
    exits 1 (an engine that serves nobody is a startup failure; systemd restarts it later). At
    --log-level WARNING: the daemon's INFO progress lines (model loaded, ports) come before the
    failure at the default level; what the failure itself adds is the line (the retry warning comes
    only after `STARTUP_GRACE_S`, past this 2 s wait)."""
    _, folder = tiny_model_factory("llama")
    conductor = f"127.0.0.1:{free_port()}"
    result = _mooncaked("--role", "prefill", "--model", str(folder), "--listen", f"127.0.0.1:{free_port()}",
                        "--conductor", conductor, "--join-timeout-s", "2", "--kv-cache-bytes", "4MiB",
                        "--log-level", "WARNING", timeout=60)
    _one_line(result, "no conductor accepted this engine within 2s", f"--conductor: {conductor}", "UNAVAILABLE",
              most=2)
    assert result.returncode == 1


def test_an_engine_whose_store_never_answers_exits_with_one_line(tiny_model_factory):
    _, folder = tiny_model_factory("llama")
    store = f"127.0.0.1:{free_port()}"
    result = _mooncaked("--role", "decode", "--model", str(folder), "--listen", f"127.0.0.1:{free_port()}",
                        "--conductor", f"127.0.0.1:{free_port()}", "--store", store, "--join-timeout-s", "2",
                        "--kv-cache-bytes", "4MiB", "--log-level", "WARNING", timeout=60)
    _one_line(result, f"the store master {store} (--store) did not take this engine within 2s", most=2)
    assert result.returncode == 1


def test_an_engine_whose_lmdb_folder_is_not_an_lmdb_one_exits_with_one_line(tiny_model_factory, tmp_path):
    """--store-lmdb-path at a folder whose data.mdb is something else (another program's, a cut copy): one
    line naming the folder and the flag, not a traceback (and no retrying as if the master were away)."""
    _, folder = tiny_model_factory("llama")
    lmdb_dir = tmp_path / "lmdb"
    lmdb_dir.mkdir()
    (lmdb_dir / "data.mdb").write_bytes(os.urandom(64 * 1024))
    result = _mooncaked("--role", "decode", "--model", str(folder), "--listen", f"127.0.0.1:{free_port()}",
                        "--conductor", f"127.0.0.1:{free_port()}", "--store", f"127.0.0.1:{free_port()}",
                        "--store-dram-bytes", "4MiB", "--store-lmdb-path", str(lmdb_dir), "--store-lmdb-bytes", "16MiB",
                        "--join-timeout-s", "30",
                        "--kv-cache-bytes", "4MiB", "--log-level", "WARNING", timeout=60)
    _one_line(result, f"the LMDB tier at {lmdb_dir} (--store-lmdb-path) cannot be opened", "not an LMDB file", most=2)
    assert result.returncode == 1


def test_a_bad_config_file_is_one_line_naming_the_key_and_file(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('role = "store"\nheartbeat_timeout_s = "soon"\n')
    result = _mooncaked("--config", str(bad), timeout=60)
    _one_line(result, "heartbeat_timeout_s", str(bad))
    unknown = tmp_path / "unknown.toml"
    unknown.write_text('role = "store"\nno_such_setting = 1\n')
    _one_line(_mooncaked("--config", str(unknown), timeout=60), "no_such_setting", str(unknown))
    broken = tmp_path / "broken.toml"
    broken.write_text('role = "store\n')
    _one_line(_mooncaked("--config", str(broken), timeout=60), str(broken))


def test_a_second_all_role_on_a_port_exits_with_one_line(tiny_model_factory, tmp_path):
    _, folder = tiny_model_factory("llama")
    port = free_port()
    env = _env(MOONCAKED_BLOCK_SIZE="4", MOONCAKED_KV_CACHE_BYTES="8MiB", MOONCAKED_HEARTBEAT_INTERVAL_S="0.3")
    first = _start("--role", "all", "--model", str(folder), "--listen", f"127.0.0.1:{port}", "--http",
                   f"127.0.0.1:{free_port()}", until="cluster ready", log=tmp_path / "1.log", env=env)
    try:
        second = _mooncaked("--role", "all", "--model", str(folder), "--listen", f"127.0.0.1:{port}", "--http",
                            f"127.0.0.1:{free_port()}", env=env, timeout=60)
        _one_line(second, f"--listen 127.0.0.1:{port} is already in use")
        assert second.returncode == 1
        # nothing of the second cluster joined the first: still one prefill and one decode
        status = subprocess.run([sys.executable, "-m", "mooncaked.ctl", "--conductor", f"127.0.0.1:{port}",
                                 "status"], capture_output=True, text=True, timeout=60, cwd=REPO)
        assert status.returncode == 0, status.stderr
        rows = [line for line in status.stdout.splitlines() if line.startswith(("prefill", "decode"))]
        assert len(rows) == 2, status.stdout
        assert first.poll() is None
    finally:
        _stop(first)


# ---------------------------------------------------------------------------------------------
# errors for people


def _truncated_gguf(path: Path) -> Path:
    """A real GGUF header and metadata from gguf's own writer, with its tensor data cut off."""
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(2)
    writer.add_context_length(64)
    writer.add_tensor("token_embd.weight", np.ones((16, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 200])
    return path


def test_generate_model_errors_are_one_line(tmp_path):
    cache = str(tmp_path / "cache")
    missing = _mooncaked("generate", "--model", "/no/such/dir", "hi")
    _one_line(missing, "/no/such/dir", "not found", most=2)
    not_a_model = _mooncaked("generate", "--model", "README.md", "hi")
    _one_line(not_a_model, "README.md", "not a .gguf model", most=2)
    folder = tmp_path / "empty"
    folder.mkdir()
    _one_line(_mooncaked("generate", "--model", str(folder), "hi"), "has no config.json", most=2)
    cut = _truncated_gguf(tmp_path / "cut.gguf")
    truncated = _mooncaked("generate", "--model", str(cut), "--", "hi", env=_env(MOONCAKED_CACHE_DIR=cache))
    _one_line(truncated, str(cut), "truncated", most=2)
    not_gguf = tmp_path / "fake.gguf"
    not_gguf.write_text("hello")
    _one_line(_mooncaked("generate", "--model", str(not_gguf), "hi"), str(not_gguf), "not a GGUF file", most=2)
    # --log-level DEBUG is where the traceback goes
    debug = _mooncaked("generate", "--model", str(cut), "--log-level", "DEBUG", "hi",
                       env=_env(MOONCAKED_CACHE_DIR=cache))
    assert debug.returncode == 1 and "Traceback" in debug.stderr and "truncated" in debug.stderr.splitlines()[-1]


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without CUDA")
def test_generate_on_cuda_without_cuda_is_one_line(tiny_model_factory):
    _, folder = tiny_model_factory("llama")
    result = _mooncaked("generate", "--model", str(folder), "--device", "cuda", "hi")
    _one_line(result, "--device cpu", most=2)


def test_generate_takes_the_engine_settings_as_the_roles_do(tiny_model_factory):
    """A size like 8MiB and --quantize, as `--role prefill` takes them; a bad value is argparse's one line."""
    _, folder = tiny_model_factory("llama")
    ok = _mooncaked("generate", "--model", str(folder), "--kv-cache-bytes", "8MiB", "--quantize", "int8", "--raw",
                    "--max-tokens", "3", "t1 t2")
    assert ok.returncode == 0 and "finish=" in ok.stderr, ok.stderr
    _one_line(_mooncaked("generate", "--kv-cache-bytes", "2Gx", "hi"), "--kv-cache-bytes", "'2Gx'")
    _one_line(_mooncaked("generate", "--quantize", "int3", "hi"), "--quantize", "'int3'")
    _one_line(_mooncaked("generate", "--dtype", "fp8", "hi"), "--dtype", "'fp8'")


def test_a_role_with_a_missing_model_is_one_line(tmp_path):
    for role in ("conductor", "prefill"):
        result = _mooncaked("--role", role, "--model", "/no/such/dir", "--listen", f"127.0.0.1:{free_port()}",
                            timeout=60)
        _one_line(result, "/no/such/dir", most=2)


def test_all_role_with_a_missing_model_is_one_line():
    """The parent checks the model once: no child is started, so none floods stderr."""
    result = _mooncaked("--role", "all", "--model", "/no/such/dir", "--listen", f"127.0.0.1:{free_port()}",
                        "--http", f"127.0.0.1:{free_port()}", timeout=60)
    _one_line(result, "/no/such/dir", most=2)


def test_all_role_shows_the_first_failing_childs_line_only(tiny_model_factory):
    """Both engines fail alike (no room for one KV block); the user sees one of their lines, and the
    parent's line saying which process it was, not one line per child."""
    _, folder = tiny_model_factory("llama")
    result = _mooncaked("--role", "all", "--model", str(folder), "--listen", f"127.0.0.1:{free_port()}",
                        "--http", f"127.0.0.1:{free_port()}", "--log-level", "WARNING",
                        env=_env(MOONCAKED_KV_CACHE_BYTES="1", MOONCAKED_BLOCK_SIZE="4"), timeout=120)
    text = _one_line(result, "holds no block", "stopping the cluster", most=2)
    assert text.count("holds no block") == 1, text
    assert result.returncode == 1


def test_unknown_flag_is_one_line_with_a_hint():
    result = _mooncaked("--role", "conductor", "--polcy", "random")
    _one_line(result, "unknown flag --polcy", "did you mean --policy?", "mooncaked --role conductor --help")
    assert result.returncode == 2
    abbreviated = _mooncaked("--rol", "store")  # no abbreviations: they start the wrong thing silently
    _one_line(abbreviated, "unknown flag --rol", "did you mean --role?")
    _one_line(_mooncaked("generate", "--modle", "x", "hi"), "unknown flag --modle", "did you mean --model?")
    # a flag of another role is named as such
    _one_line(_mooncaked("--role", "prefill", "--policy", "random"), "--policy is a setting of role(s) conductor")


# ---------------------------------------------------------------------------------------------
# help that teaches


def test_role_help_lists_that_roles_flags_only():
    wide = _env(COLUMNS="400")  # one help text per line, whatever the terminal
    prefill = _mooncaked("--role", "prefill", "--help", env=wide)
    assert prefill.returncode == 0
    for flag in ("--kv-push", "--device", "--transfer-listen", "--listen", "--store-dram-bytes"):
        assert flag in prefill.stdout, flag
    assert "--policy" not in prefill.stdout and "--http " not in prefill.stdout
    assert "layerwise:" in prefill.stdout and "after_prefill:" in prefill.stdout
    assert "(default 127.0.0.1:50061)" in prefill.stdout
    conductor = _mooncaked("--role", "conductor", "--help", env=wide)
    for policy in ("random:", "round_robin:", "load_balance:", "cache_aware_local:", "mooncake:", "mooncaked:"):
        assert policy in conductor.stdout, policy
    assert "--kv-push" not in conductor.stdout and "(default mooncake)" in conductor.stdout
    store = _mooncaked("--role", "store", "--help", env=wide)
    assert "--store-fast-path-port" in store.stdout and "--device" not in store.stdout


def test_help_without_a_role_lists_roles_and_says_how_to_see_a_roles_flags():
    result = _mooncaked("--help")
    assert result.returncode == 0
    for role in ("conductor:", "prefill:", "decode:", "store:", "all:"):
        assert role in result.stdout, role
    assert "mooncaked --role ROLE --help" in result.stdout
    assert "--listen" in result.stdout and "--policy" not in result.stdout and "--device" not in result.stdout


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("flags, needles", [
    (("--attention-backend", "flash"), ("--attention-backend flash", "needs a CUDA device")),
    (("--transfer-backend", "rdma"), ("--transfer-backend rdma", "use tcp, shm or auto")),
])
def test_a_backend_this_host_cannot_run_is_one_line_before_any_child_starts(tiny_model_factory, flags, needles):
    """Under `all` these failed in each engine child after its model loaded, with a traceback (the flash
    backend raised RuntimeError; rdma's BackendUnavailableError was not a user's error)."""
    if flags[0] == "--transfer-backend" and __import__("mooncaked.transfer.rdma").transfer.rdma.rdma_devices():
        pytest.skip("this host has an RDMA device")
    _, folder = tiny_model_factory("llama")
    for role, more in (("all", ("--http", f"127.0.0.1:{free_port()}")), ("prefill", ())):
        result = _mooncaked("--role", role, "--model", str(folder), "--listen", f"127.0.0.1:{free_port()}", *more,
                            *flags, timeout=120)
        _one_line(result, *needles, most=2)


def test_two_flags_naming_one_port_is_one_line_naming_both():
    """Before, the second bind failed and the line asked whether another mooncaked was running."""
    port = free_port()
    conductor = _mooncaked("--role", "conductor", "--listen", f"127.0.0.1:{port}", "--http", f"127.0.0.1:{port}",
                           timeout=60)
    _one_line(conductor, f"--listen 127.0.0.1:{port} and --http 127.0.0.1:{port} name the same port")
    all_role = _mooncaked("--role", "all", "--listen", f"127.0.0.1:{free_port()}", "--http", f"127.0.0.1:{port}",
                          "--metrics", f"0.0.0.0:{port}", "--insecure", timeout=60)
    text = _one_line(all_role, f"--http 127.0.0.1:{port} and --metrics 0.0.0.0:{port} name the same port")
    assert "another mooncaked" not in text
