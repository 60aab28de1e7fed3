"""This host's identity, without torch: the store master (which never touches tensors) names it too."""

from __future__ import annotations

import hashlib
import socket


def host_id() -> str:
    """Names this host (and boot) so two engines can tell they share /dev/shm. Peers only compare
    it, so the boot id goes out as a digest (the host name stays: errors name it)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "unknown-boot"
    return f"{socket.gethostname()}/{hashlib.sha256(boot.encode()).hexdigest()[:16]}"
