"""Each role's /metrics page shows its own series, not every series its imports declared
(role_metrics.py). The whole-cluster check, one real process per role, is in test_all_role."""

import pytest
from prometheus_client import generate_latest
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.parser import text_string_to_metric_families

from mooncaked.conductor import metrics as conductor_metrics
from mooncaked.instance import metrics as instance_metrics
from mooncaked.role_metrics import ROLE_SERIES, registry_for
from mooncaked.store import metrics as store_metrics
from mooncaked.transfer import metrics as transfer_metrics


def _declared(module) -> set[int]:
    return {id(v) for v in vars(module).values() if isinstance(v, (MetricWrapperBase, store_metrics.MasterGauges))}


@pytest.mark.parametrize("module, groups", [
    (conductor_metrics, [conductor_metrics.SERIES]),
    (instance_metrics, [instance_metrics.SERIES]),
    (transfer_metrics, [transfer_metrics.SERIES]),
    (store_metrics, [store_metrics.MASTER_SERIES, store_metrics.CLIENT_SERIES]),
])
def test_every_declared_series_belongs_to_exactly_one_group(module, groups):
    grouped = [id(c) for g in groups for c in g]
    assert len(grouped) == len(set(grouped)), "a series in two groups"
    assert set(grouped) == _declared(module), "a series no role's page would show, or a stranger in a group"


def _names(role: str) -> set[str]:
    text = generate_latest(registry_for(role)).decode()
    return {s.name for f in text_string_to_metric_families(text) for s in f.samples}


def test_each_role_page_holds_its_series_and_not_the_others():
    engine, store, conductor = _names("decode"), _names("store"), _names("conductor")
    assert _names("prefill") == engine
    for names in (engine, store, conductor):  # the process's own figures on every page
        assert {"process_resident_memory_bytes", "python_gc_collections_total"} <= names
    assert {"mooncaked_kv_push_fenced_total", "mooncaked_store_client_leader_changes_total"} <= engine
    assert {"mooncaked_store_is_leader", "mooncaked_store_objects"} <= store  # (segments: once a master has some)
    assert {"mooncaked_conductor_prompt_tokens_total", "mooncaked_conductor_pool_watch_up"} <= conductor
    # what an engine's page used to say: a standby master, a conductor with no tokens
    assert not {n for n in engine if n.startswith("mooncaked_conductor_")}
    assert not {"mooncaked_store_is_leader", "mooncaked_store_objects", "mooncaked_store_stale_puts_total"} & engine
    assert not {n for n in store if n.startswith(("mooncaked_conductor_", "mooncaked_transfer_", "mooncaked_kv_"))}
    assert not {"mooncaked_store_is_leader", "mooncaked_kv_push_fenced_total"} & conductor


def test_an_unknown_role_has_no_page():
    with pytest.raises(KeyError):
        registry_for("all")  # its page is its children's (roles/all_metrics.py)
    assert set(ROLE_SERIES) == {"conductor", "prefill", "decode", "store"}
