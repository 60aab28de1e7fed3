"""Startup failures a user can cause, as one line each.

A daemon that cannot start says why in one line and exits 1; the traceback is for
`--log-level DEBUG`. Failures are typed where they happen (`StartupError` for an address
that cannot be bound, the engine's and the config's own errors for a model or a setting)
and turned into that line in one place, `user_message`, which the CLI calls.

Ports are checked before anything slow starts (`check_addresses`), so a second daemon on a
busy port fails in a moment, before it loads a model or registers anywhere; the servers map
a failed bind the same way, for the port that is taken between the check and the bind.
"""

from __future__ import annotations

import errno
import os
import socket
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from mooncaked.config.values import WILDCARD_HOSTS


class StartupError(Exception):
    """A daemon cannot start for a reason the user can fix; the message says what to do."""


def _host_port(address: Any) -> tuple[str, int]:
    """(host, port) from a HostPort, a tuple or 'HOST:PORT' / '[V6]:PORT'."""
    if isinstance(address, tuple):
        return str(address[0]), int(address[1])
    host, _, port = str(address).rpartition(":")
    return host.strip("[]"), int(port)


def _show(address: Any) -> str:
    host, port = _host_port(address)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def bind_error(flag: str, address: Any, error: OSError | None) -> StartupError:
    """The one-line error for `flag`'s address that could not be bound (`error`: what bind said)."""
    where = f"{flag} {_show(address)}"
    if error is None or error.errno == errno.EADDRINUSE:
        return StartupError(f"{where} is already in use (is another mooncaked running?); "
                            f"stop it or pick another {flag}")
    if error.errno == errno.EADDRNOTAVAIL:
        return StartupError(f"{where}: no such address on this machine; pick another {flag} host")
    if error.errno == errno.EACCES:
        return StartupError(f"{where}: permission denied (ports below 1024 need privileges); pick another {flag}")
    if isinstance(error, socket.gaierror):
        return StartupError(f"{where}: unknown host ({error.strerror or error}); pick another {flag} host")
    return StartupError(f"cannot listen on {where}: {error.strerror or error}")


def probe(address: Any) -> OSError | None:
    """Why `address` cannot be listened on now, or None. Binds as our servers do (SO_REUSEADDR,
    never SO_REUSEPORT), so a port held by any listener, ours or not, is reported."""
    host, port = _host_port(address)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        return e
    family, kind, proto, _, sockaddr = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(sockaddr)
            s.listen(1)
        except OSError as e:
            return e
    # a listener on an IPv6 socket (gRPC binds 127.0.0.1 as ::ffff:127.0.0.1) does not always make an
    # IPv4 bind fail; one that accepts a connection is in use all the same
    target = ("::1" if family == socket.AF_INET6 else "127.0.0.1") if host in ("0.0.0.0", "::", "") else host
    try:
        with socket.create_connection((target, port), timeout=1.0):
            return OSError(errno.EADDRINUSE, "address already in use")
    except OSError:
        return None


def _same_port(a: tuple[str, int], b: tuple[str, int]) -> bool:
    """Whether two listening addresses would take one port (a wildcard host takes it on every address)."""
    return a[1] == b[1] and (a[0] == b[0] or a[0] in WILDCARD_HOSTS or b[0] in WILDCARD_HOSTS)


def check_addresses(addresses: list[tuple[str, Any]]) -> None:
    """Raise the `StartupError` of two flags naming one port, else of the first (flag, address) that cannot
    be listened on; port 0 always can. (Two of our own flags on one port used to read as "is another
    mooncaked running?" once the second bind failed.)"""
    fixed = [(flag, address, _host_port(address)) for flag, address in addresses
             if address is not None and _host_port(address)[1] != 0]
    for i, (flag, address, hp) in enumerate(fixed):
        for other, other_address, other_hp in fixed[:i]:
            if _same_port(hp, other_hp):
                raise StartupError(f"{other} {_show(other_address)} and {flag} {_show(address)} name the same "
                                   "port: give each its own")
    for flag, address, _ in fixed:
        error = probe(address)
        if error is not None:
            raise bind_error(flag, address, error)


@contextmanager
def listening(flag: str, address: Any) -> Iterator[None]:
    """Around a server's bind: an OSError there becomes the `StartupError` naming `flag`."""
    try:
        yield
    except StartupError:
        raise
    except OSError as e:
        raise bind_error(flag, address, e) from e


def _is(error: BaseException, module: str, name: str) -> bool:
    """isinstance against a class of a module only if that module is loaded (the engine imports torch)."""
    mod = sys.modules.get(module)
    return mod is not None and isinstance(error, getattr(mod, name))


def user_message(error: BaseException) -> str | None:
    """The one line for a failure the user can fix (a setting, a model, a port, a device), else None."""
    if isinstance(error, StartupError):
        return str(error)
    if _is(error, "mooncaked.config", "ConfigError"):
        return str(error)
    if (_is(error, "mooncaked.engine.config", "ConfigError")
            or _is(error, "mooncaked.engine.gguf_tokenizer", "UnsupportedGGUFError")
            or _is(error, "mooncaked.engine.gguf_loader", "BadGGUFError")
            or _is(error, "mooncaked.engine.sampling_params", "RequestError")
            or _is(error, "mooncaked.transfer.api", "BackendUnavailableError")):
        return str(error)
    if isinstance(error, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)):
        if error.filename and error.strerror:
            return f"{error.filename}: {error.strerror}"
        return str(error)
    return None


# ---------------------------------------------------------------------------------------------
# under `--role all`: the first failing child's line is the one the user sees. Two engines that
# fail alike (too little KV memory, say) would print the same line twice, then the cluster would
# stop; instead each child sends its line to the parent (over the socket the parent also hears
# the conductor's READY=1 on, roles/all_role.py), which prints the first and drops the rest.

CHILD_ERROR = "MOONCAKED_ERROR"  # the field a child's one-line error travels in
# The same way, a child tells its parent a port it bound: the store master's and each child's metrics port
# are any free one, bound by the child itself (a port picked by the parent and bound later by a child
# could be taken by another process in between); "KIND PID PORT".
CHILD_PORT = "MOONCAKED_PORT"


def parent_socket_name(parent_pid: int) -> str:
    """The `all` parent's datagram socket (Linux abstract namespace: nothing on disk to clean up)."""
    return f"\0mooncaked-all-{parent_pid}"


def _send_parent(parent_pid: int, message: str) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.sendto(message.encode()[:4000], parent_socket_name(parent_pid))
        return True
    except OSError:
        return False


def tell_parent(parent_pid: int, line: str) -> bool:
    """Send a child's one-line error to its `all` parent; False when it cannot (print it yourself)."""
    return _send_parent(parent_pid, f"{CHILD_ERROR}={line}")


def tell_parent_port(parent_pid: int, kind: str, port: int) -> bool:
    """Tell the `all` parent which port this child bound for `kind` ("store", "metrics")."""
    return _send_parent(parent_pid, f"{CHILD_PORT}={kind} {os.getpid()} {port}")


def child_port(message: str) -> tuple[str, int, int] | None:
    """(kind, child pid, port) of a CHILD_PORT message, else None."""
    if not message.startswith(CHILD_PORT + "="):
        return None
    parts = message.removeprefix(CHILD_PORT + "=").split()
    if len(parts) != 3 or not parts[1].isdigit() or not parts[2].isdigit():
        return None
    return parts[0], int(parts[1]), int(parts[2])
