"""The systemd units verify, say what deployment relies on, and the example configs load."""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mooncaked.config import ROLES, add_config_args, load_config

ROOT = Path(__file__).resolve().parent.parent
UNITS = ROOT / "systemd"
SERVICE = UNITS / "mooncaked@.service"
TARGET = UNITS / "mooncaked.target"
EXAMPLES = UNITS / "examples"
STATE_DIR = "/var/lib/mooncaked"
_INSTALL_HINT = "install it with `apt-get install -y systemd` (CI: add it to .ci/setup)"


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is not on PATH; {_INSTALL_HINT}")
    return path


def _directives(path: Path) -> dict[str, list[str]]:
    """KEY -> values, in order (systemd allows a key more than once)."""
    out: dict[str, list[str]] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith(("#", ";", "[")):
            key, _, value = line.partition("=")
            out.setdefault(key.strip(), []).append(value.strip())
    return out


def test_units_pass_systemd_analyze_verify(tmp_path):
    """verify checks the ExecStart binary exists, so point it at this Python for the check."""
    analyze = _tool("systemd-analyze")
    text = SERVICE.read_text()
    assert "ExecStart=/usr/local/bin/mooncaked " in text
    (tmp_path / SERVICE.name).write_text(text.replace("/usr/local/bin/mooncaked", str(Path(sys.executable))))
    shutil.copy(TARGET, tmp_path / TARGET.name)
    units = [str(tmp_path / f"mooncaked@{role}.service") for role in ROLES] + [str(tmp_path / TARGET.name)]
    proc = subprocess.run([analyze, "verify", "--man=no", *units], capture_output=True, text=True,
                          cwd=tmp_path, timeout=120)
    output = proc.stdout + proc.stderr
    # verify exits 0 on unknown keys and bad values but prints them: any line about our units fails
    ours = [line for line in output.splitlines() if "mooncaked" in line or str(tmp_path) in line]
    assert proc.returncode == 0 and not ours, f"systemd-analyze verify (rc {proc.returncode}):\n{output}"


def test_service_says_what_deployment_relies_on():
    d = _directives(SERVICE)
    expected = {
        "ExecStart": "/usr/local/bin/mooncaked --role %i --config /etc/mooncaked/%i.toml",
        "Type": "notify", "NotifyAccess": "main", "Restart": "on-failure", "RestartSec": "2",
        "User": "mooncaked", "Group": "mooncaked", "DynamicUser": "no", "StateDirectory": "mooncaked",
        "NoNewPrivileges": "yes", "ProtectSystem": "strict", "ReadWritePaths": STATE_DIR, "PrivateTmp": "yes",
        "ProtectHome": "yes", "ProtectKernelTunables": "yes", "ProtectControlGroups": "yes",
        "RestrictSUIDSGID": "yes", "LockPersonality": "yes", "TimeoutStopSec": "60", "KillSignal": "SIGTERM",
        "PartOf": "mooncaked.target", "WantedBy": "mooncaked.target",
    }
    for key, value in expected.items():
        assert d.get(key) == [value], f"{SERVICE.name}: expected {key}={value}, found {d.get(key)}"
    assert f"MOONCAKED_CACHE_DIR={STATE_DIR}/cache" in d["Environment"]
    # engines need the GPU device nodes
    assert "PrivateDevices" not in d
    assert _directives(TARGET)["WantedBy"] == ["multi-user.target"]


def _load_example(role: str):
    parser = argparse.ArgumentParser()
    add_config_args(parser)
    args = parser.parse_args(["--role", role, "--config", str(EXAMPLES / f"{role}.toml")])
    # what the unit's Environment= gives every role
    return load_config(args, {"MOONCAKED_CACHE_DIR": f"{STATE_DIR}/cache"})


@pytest.mark.parametrize("role", ["conductor", "prefill", "decode", "store"])
def test_example_configs_load_and_fit_the_unit(role):
    cfg = _load_example(role)
    assert cfg.role == role
    timeout_stop = float(_directives(SERVICE)["TimeoutStopSec"][0])
    assert cfg.drain_timeout_s < timeout_stop, "systemd would SIGKILL a drain still in progress"
    # ProtectSystem=strict: every path the role writes must lie under the state directory
    for key in ("store_lmdb_path", "cache_dir"):
        path = getattr(cfg, key, None)
        if path is not None:
            assert Path(path).is_relative_to(STATE_DIR), f"{role}.toml: {key}={path} is outside {STATE_DIR}"
    assert cfg.listen.host == "0.0.0.0", f"{role}.toml: a cluster role must listen beyond loopback"


def test_example_configs_agree_on_the_cluster():
    cfgs = {role: _load_example(role) for role in ("conductor", "prefill", "decode", "store")}
    assert len({(c.model, c.block_size, c.hash_seed) for r, c in cfgs.items() if r != "store"}) == 1
    conductor, store = cfgs["conductor"], cfgs["store"]
    for role in ("prefill", "decode"):
        assert [c.port for c in cfgs[role].conductor] == [conductor.listen.port]
        assert cfgs[role].store.port == store.listen.port
    assert conductor.store.port == store.listen.port
    ports = [conductor.listen.port, conductor.http.port, store.listen.port]
    for role in ("prefill", "decode"):  # prefill and decode may share a node
        ports += [cfgs[role].listen.port, cfgs[role].transfer_listen.port]
    assert len(ports) == len(set(ports)), f"example ports collide: {ports}"
    assert cfgs["prefill"].store_lmdb_path != cfgs["decode"].store_lmdb_path


def test_sysusers_entry_is_valid(tmp_path):
    sysusers = _tool("systemd-sysusers")
    conf = UNITS / "sysusers.d" / "mooncaked.conf"
    (tmp_path / "etc").mkdir()
    proc = subprocess.run([sysusers, "--dry-run", f"--root={tmp_path}", str(conf)],
                          capture_output=True, text=True, timeout=60)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    assert re.search(r"Creating user '?mooncaked'?", output), output


def test_the_unit_is_hardened(tmp_path, capsys):
    """`systemd-analyze security` scores the unit (0 safe .. 10 exposed); the aim is 3.0 or less."""
    analyze = _tool("systemd-analyze")
    d = _directives(SERVICE)
    for key, value in {"CapabilityBoundingSet": "", "SystemCallFilter": "@system-service", "RestrictNamespaces": "yes",
                       "ProtectClock": "yes", "ProtectHostname": "yes", "ProtectKernelLogs": "yes",
                       "ProtectProc": "invisible", "TasksMax": "4096",
                       "RestrictAddressFamilies": "AF_UNIX AF_INET AF_INET6 AF_NETLINK"}.items():
        assert d.get(key) == [value], f"{SERVICE.name}: expected {key}={value}, found {d.get(key)}"
    # ProtectClock= implies a device allow-list: the GPU's device nodes must be on it
    assert "char-nvidia-frontend rw" in d["DeviceAllow"] and "char-nvidia-uvm rw" in d["DeviceAllow"]
    unit = tmp_path / "mooncaked@prefill.service"
    unit.write_text(SERVICE.read_text().replace("/usr/local/bin/mooncaked", str(Path(sys.executable))))
    proc = subprocess.run([analyze, "security", "--offline=true", "--no-pager", str(unit)], capture_output=True,
                          text=True, cwd=tmp_path, timeout=120)
    output = proc.stdout + proc.stderr
    with capsys.disabled():
        print("\n" + output)
    m = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", output)
    assert m, f"no exposure level in systemd-analyze security's output (rc {proc.returncode}):\n{output}"
    assert float(m.group(1)) <= 3.0, output
