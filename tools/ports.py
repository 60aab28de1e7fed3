"""Loopback ports for daemons that a bench or a test starts on a port it names.

Such a daemon binds its port a second or more after the port was picked. A port picked by binding port 0
comes from the kernel's ephemeral range, which every "any port" bind and every outgoing connection draws
from meanwhile, so it can be taken before the daemon binds it. The ports handed out here lie below that
range. Under pytest-xdist the range is split between the workers, so two workers never hand out the same one.
"""

from __future__ import annotations

import itertools
import os
import random
import socket


def _unhanded_ports() -> list[int]:
    """This process's share of the ports below the ephemeral range, walked from a random start."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral = 32768
    first = 10000 if ephemeral > 12000 else 1024
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    workers = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    share = (ephemeral - first) // workers
    ports = list(range(first + worker * share, first + (worker + 1) * share))
    start = random.randrange(len(ports))
    return ports[start:] + ports[:start]


_ports = itertools.cycle(_unhanded_ports())


def free_port() -> int:
    """A loopback port nobody listens on, that no "any port" bind can take before the caller's daemon binds it."""
    for _ in range(1000):
        port = next(_ports)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue  # in use, or a connection of a daemon gone still in TIME_WAIT
            return port
    raise RuntimeError("no free port below the ephemeral range")
