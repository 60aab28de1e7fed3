"""Config: precedence (flag > env > TOML > default), rejection with the key and source named, sizes."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from mooncaked.config import (
    AllConfig,
    ConductorConfig,
    ConfigError,
    DecodeConfig,
    HostPort,
    PrefillConfig,
    StoreConfig,
    WorkerConfig,
    add_config_args,
    load_config,
    parse_hostport,
    parse_size,
)


def _load(argv: list[str], environ: dict[str, str] | None = None):
    parser = argparse.ArgumentParser()
    add_config_args(parser)
    return load_config(parser.parse_args(argv), environ or {})


def _toml(tmp_path, text: str) -> str:
    path = tmp_path / "role.toml"
    path.write_text(text)
    return str(path)


def test_defaults_per_role():
    cfg = _load(["--role", "prefill"])
    assert isinstance(cfg, PrefillConfig) and isinstance(cfg, WorkerConfig)
    assert cfg.role == "prefill"
    assert cfg.block_size == 16 and cfg.kv_cache_bytes is None and cfg.device == "cpu" and cfg.dtype is None
    assert cfg.heartbeat_interval_s == 1.0 and cfg.heartbeat_timeout_s == 5.0 and cfg.drain_timeout_s == 30
    assert cfg.listen == HostPort("127.0.0.1", 50061)
    assert cfg.transfer_listen == HostPort("127.0.0.1", 0)
    assert cfg.name == "prefill-127.0.0.1-50061"
    assert str(cfg.conductor) == "127.0.0.1:50051"
    assert isinstance(_load(["--role", "decode"]), DecodeConfig)
    assert isinstance(_load(["--role", "store"]), StoreConfig)
    conductor = _load(["--role", "conductor"])
    assert isinstance(conductor, ConductorConfig) and conductor.policy == "mooncake" and conductor.api_key is None
    everything = _load(["--role", "all"])
    assert isinstance(everything, ConductorConfig) and isinstance(everything, WorkerConfig)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.block_size = 32  # type: ignore[misc]


def test_precedence_flag_over_env_over_toml_over_default(tmp_path):
    path = _toml(tmp_path, 'block_size = 32\nmax_num_seqs = 8\nkv_cache_bytes = "1GiB"\nmodel = "/m"\n')
    env = {"MOONCAKED_MAX_NUM_SEQS": "4", "MOONCAKED_KV_CACHE_BYTES": "512MiB"}
    cfg = _load(["--role", "decode", "--config", path, "--kv-cache-bytes", "256MiB"], env)
    assert cfg.kv_cache_bytes == 256 << 20  # flag
    assert cfg.max_num_seqs == 4  # env over TOML
    assert cfg.block_size == 32 and cfg.model == "/m"  # TOML over default
    assert cfg.max_num_batched_tokens is None  # default: by device (engine/config.py DEFAULT_STEP_TOKENS)
    assert cfg.engine_config().step_tokens == 256  # on CPU

    # the config file and the role can come from the environment and the file too
    path = _toml(tmp_path, 'role = "store"\n')
    cfg = _load([], {"MOONCAKED_CONFIG": path})
    assert cfg.role == "store"
    assert _load(["--role", "prefill"], {"MOONCAKED_ROLE": "decode"}).role == "prefill"
    with pytest.raises(ConfigError, match=rf"config file {path} is for role 'store' but --role says 'decode'"):
        _load(["--role", "decode", "--config", path])


def test_other_roles_env_is_ignored_but_their_flags_and_keys_are_not(tmp_path):
    cfg = _load(["--role", "prefill"], {"MOONCAKED_POLICY": "round_robin", "MOONCAKED_CACHE_DIR": "/c"})
    assert cfg.cache_dir == "/c" and not hasattr(cfg, "policy")
    with pytest.raises(ConfigError, match=r"--policy is a setting of role\(s\) conductor, all, not of role 'prefill'"):
        _load(["--role", "prefill", "--policy", "round_robin"])
    path = _toml(tmp_path, 'http = "0.0.0.0:8000"\n')
    with pytest.raises(ConfigError, match=rf"config file {path}: key 'http' is a setting of role\(s\) conductor"):
        _load(["--role", "decode", "--config", path])


def test_unknown_toml_key_is_rejected_with_a_suggestion(tmp_path):
    path = _toml(tmp_path, "block_sise = 32\n")
    with pytest.raises(ConfigError, match=rf"config file {path}: unknown key 'block_sise'; did you mean 'block_size'"):
        _load(["--role", "prefill", "--config", path])


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ('kv_cache_bytes = "lots"', r"key 'kv_cache_bytes': expected a size"),
        ("kv_cache_bytes = 1.5", r"key 'kv_cache_bytes': expected a size"),
        ('listen = "localhost"', r"key 'listen': expected HOST:PORT, got 'localhost' \(no port\)"),
        ('conductor = "10.0.0.1:99999"', r"key 'conductor': port must be an integer in 0..65535"),
        ('conductor = "0.0.0.0:50051"', r"key 'conductor': .* needs a real host"),
        ('role = "router"', r"key 'role': expected one of conductor, prefill, decode, store, all"),
        ("block_size = 0", r"key 'block_size': must be >= 1"),
        ('block_size = "16"', None),  # strings of digits are fine, like env values
        ("block_size = true", r"key 'block_size': expected an integer"),
        ('transfer_backend = "udp"', r"key 'transfer_backend': expected one of tcp, shm, auto, rdma"),
        ('name = "my node"', r"key 'name': expected a name"),
        ("heartbeat_interval_s = -1", r"key 'heartbeat_interval_s': must be > 0"),
        ("store_reads_port = 70000", r"key 'store_reads_port': port must be in 0..65535"),
        ("block_size = [", r"is not valid TOML"),
    ],
)
def test_bad_toml_values_name_the_key_and_file(tmp_path, toml, message):
    path = _toml(tmp_path, toml + "\n")
    argv = ["--config", path] + ([] if toml.startswith("role") else ["--role", "prefill"])
    if message is None:
        assert _load(argv).block_size == 16
        return
    with pytest.raises(ConfigError, match=rf"config file {path}.*{message}"):
        _load(argv)


def test_bad_env_and_flag_values_name_their_source():
    with pytest.raises(ConfigError, match=r"environment variable MOONCAKED_BLOCK_SIZE: expected an integer, got 'x'"):
        _load(["--role", "decode"], {"MOONCAKED_BLOCK_SIZE": "x"})
    with pytest.raises(ConfigError, match=r"--store-dram-bytes: expected a size"):
        _load(["--role", "decode", "--store-dram-bytes", "8 gigs"])
    with pytest.raises(ConfigError, match=r"environment variable MOONCAKED_ROLE: expected one of"):
        _load([], {"MOONCAKED_ROLE": "router"})
    with pytest.raises(ConfigError, match=r"no role given"):
        _load([])
    with pytest.raises(ConfigError, match=r"config file /nonexistent.toml does not exist"):
        _load(["--role", "store", "--config", "/nonexistent.toml"])


def test_cross_field_checks():
    with pytest.raises(ConfigError, match=r"heartbeat_timeout_s \(1\) must be longer than heartbeat_interval_s \(2\)"):
        _load(["--role", "decode", "--heartbeat-interval-s", "2", "--heartbeat-timeout-s", "1"])
    with pytest.raises(ConfigError, match=r"store_lmdb_bytes is set but store_lmdb_path is not"):
        _load(["--role", "prefill", "--store-lmdb-bytes", "1GiB"])
    with pytest.raises(ConfigError, match=r"store_lmdb_path is set but store_lmdb_bytes is not"):
        _load(["--role", "all", "--store-lmdb-path", "/tmp/x"])
    with pytest.raises(ConfigError, match=r"store_lmdb_bytes is set but store_dram_bytes is not"):
        _load(["--role", "decode", "--store-lmdb-path", "/tmp/x", "--store-lmdb-bytes", "1GiB"])
    assert _load(["--role", "all", "--store-lmdb-path", "/tmp/x", "--store-lmdb-bytes", "1GiB"]).store_lmdb_bytes


def test_unset_with_none_and_bool_flags():
    cfg = _load(["--role", "prefill", "--kv-cache-bytes", "none"], {"MOONCAKED_KV_CACHE_BYTES": "1GiB"})
    assert cfg.kv_cache_bytes is None
    assert _load(["--role", "prefill", "--no-enable-prefix-caching"]).enable_prefix_caching is False
    assert _load(["--role", "prefill"], {"MOONCAKED_ENABLE_PREFIX_CACHING": "off"}).enable_prefix_caching is False
    assert _load(["--role", "decode"]).engine_config().exact_small_steps is True
    off = _load(["--role", "decode", "--no-exact-small-steps"])
    assert off.exact_small_steps is False and off.engine_config().exact_small_steps is False
    assert _load(["--role", "decode"]).engine_config().cuda_graphs is True
    assert _load(["--role", "decode", "--no-cuda-graphs"]).engine_config().cuda_graphs is False


def test_name_and_advertise_address(monkeypatch):
    monkeypatch.setattr("socket.gethostname", lambda: "gpu7")
    cfg = _load(["--role", "decode", "--listen", "0.0.0.0:6000"])
    assert cfg.name == "decode-gpu7-6000" and str(cfg.advertise_address) == "gpu7:6000"
    assert cfg.transfer_listen == HostPort("0.0.0.0", 0)
    cfg = _load(["--role", "decode", "--listen", "0.0.0.0:6000", "--advertise-host", "10.1.2.3", "--name", "d1"])
    assert cfg.name == "d1" and cfg.advertise_address == HostPort("10.1.2.3", 6000)


def test_direct_construction_validates_and_coerces():
    cfg = PrefillConfig(listen="127.0.0.1:0", kv_cache_bytes="64MiB", store="[::1]:50052")
    assert cfg.listen == HostPort("127.0.0.1", 0) and cfg.kv_cache_bytes == 64 << 20
    assert str(cfg.store) == "[::1]:50052"
    with pytest.raises(ConfigError, match="block_size: must be >= 1"):
        DecodeConfig(block_size=0)
    with pytest.raises(ConfigError, match="PrefillConfig is for role 'prefill'"):
        PrefillConfig(role="decode")
    assert AllConfig().store_replicas == 1


def test_engine_config_mapping():
    cfg = _load(["--role", "decode", "--block-size", "32", "--kv-cache-bytes", "1MiB", "--dtype", "bfloat16"])
    ec = cfg.engine_config()
    assert (ec.block_size, ec.kv_cache_bytes, ec.device) == (32, 1 << 20, "cpu")
    assert str(ec.dtype) == "torch.bfloat16"


@pytest.mark.parametrize(
    ("text", "nbytes"),
    [(4096, 4096), ("4096", 4096), ("512MiB", 512 << 20), ("2GiB", 2 << 30), ("2G", 2 << 30),
     ("1.5GiB", 3 << 29), ("2GB", 2 * 10**9), ("10kb", 10_000), ("64 KiB", 64 << 10), ("1_000", 1000),
     ("0", 0), ("1TiB", 1 << 40)],
)
def test_parse_size(text, nbytes):
    assert parse_size(text) == nbytes


@pytest.mark.parametrize("text", ["", "GiB", "-1", "1.5", "0.1KiB", "2 GiBs", "1e9", True, 1.0, -5])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError):
        parse_size(text)


def test_parse_hostport():
    assert parse_hostport("10.0.0.1:50051") == ("10.0.0.1", 50051)
    assert parse_hostport("gpu-node.example.com:0") == ("gpu-node.example.com", 0)
    assert parse_hostport("[::1]:80") == ("::1", 80) and str(parse_hostport("[::1]:80")) == "[::1]:80"
    for bad in ["host", ":80", "host:", "host:x", "host:65536", "::1:80", "[zz]:80", "a b:1", "[::1]80"]:
        with pytest.raises(ValueError):
            parse_hostport(bad)


def test_all_role_tells_its_conductor_where_the_store_master_is():
    """The embedded store binds any free port (0) and the others are told the one it got; a --store given
    is where the external one listens, and no store child runs."""
    from mooncaked.roles.all_role import child_configs, embedded_store

    cfg = AllConfig(listen="127.0.0.1:50051")
    assert embedded_store(cfg).listen == HostPort("127.0.0.1", 0)
    children = {c.role: c for c in child_configs(cfg, HostPort("127.0.0.1", 40001))}
    assert "store" not in children
    assert children["conductor"].store == children["prefill"].store == children["decode"].store == \
        HostPort("127.0.0.1", 40001)
    with pytest.raises(ValueError, match="store"):
        child_configs(cfg)
    given = AllConfig(listen="127.0.0.1:50051", store="10.0.0.2:50052")
    assert embedded_store(given) is None
    assert {c.store for c in child_configs(given)} == {HostPort("10.0.0.2", 50052)}


def test_the_all_roles_conductor_waits_for_its_own_engines_to_start():
    """`all` starts its engines itself, and their first start builds the native kernels: its conductor holds
    early requests for up to 600 s by default (a lone conductor: 30 s), or what --ready-timeout-s says."""
    from mooncaked.roles.all_role import child_configs

    assert ConductorConfig().ready_timeout_s == 30
    conductor = next(c for c in child_configs(AllConfig(), HostPort("127.0.0.1", 40001)) if c.role == "conductor")
    assert conductor.ready_timeout_s == 600
    told = next(c for c in child_configs(AllConfig(ready_timeout_s=5), HostPort("127.0.0.1", 40001))
                if c.role == "conductor")
    assert told.ready_timeout_s == 5


@pytest.mark.parametrize("role", ["conductor", "prefill", "decode", "store", "all"])
def test_each_role_help_shows_its_own_flags_each_with_its_default(role):
    parser = argparse.ArgumentParser()
    add_config_args(parser, role)
    cls = {"conductor": ConductorConfig, "prefill": PrefillConfig, "decode": DecodeConfig, "store": StoreConfig,
           "all": AllConfig}[role]
    shown = {a.dest for a in parser._actions if a.help != argparse.SUPPRESS} - {"help", "config", "role"}
    assert shown == {f.name for f in dataclasses.fields(cls)} - {"role"}
    for action in parser._actions:
        if action.dest in shown:
            assert "default" in action.help, (action.dest, action.help)
    # another role's flag still parses, so that load_config can say whose it is
    other = "--policy" if role in ("prefill", "decode", "store") else "--store-lmdb-path"
    if role != "all":
        with pytest.raises(ConfigError, match="is a setting of role"):
            load_config(parser.parse_args(["--role", role, other, "x"]), {})


def test_the_transfer_io_process_is_on_by_default_and_off_under_a_rate_limit():
    default = _load(["--role", "prefill"])
    assert default.transfer_io_process is True and default.io_process is True
    off = _load(["--role", "decode", "--no-transfer-io-process"])
    assert off.transfer_io_process is False and off.io_process is False
    # the I/O process does not pace: a rate limit keeps the in-process data plane, which does
    capped = _load(["--role", "prefill", "--transfer-rate-limit", "1MiB"])
    assert capped.transfer_io_process is True and capped.io_process is False
    assert _load(["--role", "prefill", "--transfer-io-process", "--transfer-rate-limit", "1MiB"]).io_process is False
