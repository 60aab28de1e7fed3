"""Setting values from text to typed: addresses, sizes, choices, store targets.

Each parser takes a TOML value, a string (env / flag) or an already-typed value, returns the typed
value, and raises ValueError saying what is expected; `load_config` adds the key and its source.
"""

from __future__ import annotations

import ipaddress
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, NamedTuple


WILDCARD_HOSTS = frozenset({"0.0.0.0", "::"})


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
        if not listening and (hp.port == 0 or hp.host in WILDCARD_HOSTS):
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
