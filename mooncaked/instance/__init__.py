"""Prefill and decode instance logic, without gRPC: reservations, the prefill's plan (own prefix
cache, KV pool, a peer's KV cache), compute and layer-wise KV push, decode streams, lending KV to
peers. ``worker.Worker`` is one instance; ``roles/worker.py`` serves it over gRPC and
``local_link.LocalEngineLink`` reaches it in-process."""
