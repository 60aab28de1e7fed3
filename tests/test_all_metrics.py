"""roles/all_metrics.py: the children's pages served as one, each sample labelled with its process; a
child that does not answer is left out of the scrape and said to be down. Real HTTP servers on loopback."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, generate_latest, start_http_server
from prometheus_client.parser import text_string_to_metric_families

from cluster import free_port
from mooncaked.roles.all_metrics import children_registry, process_labels


def test_process_labels_name_the_first_of_a_role_by_the_role():
    assert process_labels(["conductor", "store", "prefill", "prefill", "decode", "prefill"]) == \
        ["conductor", "store", "prefill", "prefill-1", "decode", "prefill-2"]


def test_the_children_pages_are_served_as_one_with_the_process_named():
    pages = []
    for served in (3, 5):
        registry = CollectorRegistry()
        Counter("mooncaked_demo_requests", "Requests.", ["kind"], registry=registry).labels("a").inc(served)
        port = free_port()
        server, thread = start_http_server(port, "127.0.0.1", registry=registry)
        pages.append((server, f"http://127.0.0.1:{port}/metrics"))
    try:
        targets = {"prefill": pages[0][1], "prefill-1": pages[1][1],
                   "decode": f"http://127.0.0.1:{free_port()}/metrics",  # nobody listens there
                   "store": None}  # not told its port yet
        text = generate_latest(children_registry(targets)).decode()
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for f in text_string_to_metric_families(text) for s in f.samples}
        assert samples[("mooncaked_demo_requests_total", (("kind", "a"), ("mooncaked_process", "prefill")))] == 3
        assert samples[("mooncaked_demo_requests_total", (("kind", "a"), ("mooncaked_process", "prefill-1")))] == 5
        up = {dict(k[1])["mooncaked_process"]: v for k, v in samples.items() if k[0] == "mooncaked_all_process_up"}
        assert up == {"prefill": 1.0, "prefill-1": 1.0, "decode": 0.0, "store": 0.0}
    finally:
        for server, _ in pages:
            server.shutdown()
