"""The series one role's /metrics page shows.

prometheus-client declares every series in one process-wide registry as soon as its module is
imported, and a role imports more than it runs (an engine imports the store's metrics for its
client, and with them the master's). Served whole, an engine's page said `mooncaked_store_is_leader 0`
and `mooncaked_conductor_prompt_tokens_total 0`: a dashboard counting standby masters or summing the
conductors' tokens over every process read them as real. A role's page is a registry of its own
series (each collector registered in it too; the default registry keeps them all for tests and
in-process use) and the process's own: CPU, memory, GC.
"""

from __future__ import annotations

import prometheus_client
from prometheus_client import CollectorRegistry

from mooncaked.conductor import metrics as conductor_metrics
from mooncaked.instance import metrics as instance_metrics
from mooncaked.store import metrics as store_metrics
from mooncaked.transfer import metrics as transfer_metrics

_PROCESS = (prometheus_client.PROCESS_COLLECTOR, prometheus_client.PLATFORM_COLLECTOR,
            prometheus_client.GC_COLLECTOR)
_ENGINE = (*instance_metrics.SERIES, *transfer_metrics.SERIES, *store_metrics.CLIENT_SERIES)
ROLE_SERIES = {
    "conductor": (*conductor_metrics.SERIES, *store_metrics.CLIENT_SERIES),  # it follows the master's pool events
    "prefill": _ENGINE,
    "decode": _ENGINE,
    "store": store_metrics.MASTER_SERIES,
}


def registry_for(role: str) -> CollectorRegistry:
    """A registry holding `role`'s series and the process collectors (KeyError for an unknown role)."""
    registry = CollectorRegistry()
    for collector in (*_PROCESS, *ROLE_SERIES[role]):
        registry.register(collector)
    return registry
