"""`mooncakectl` as an operator runs it, against `mooncaked --role all` (real processes): `status` is
the cluster's one screen (conductor, store master with pool figures, instances; `--json` with
numbers as numbers), `store` finds the master through the conductor, `drain` takes an address,
and errors are one line: a conductor that is down, a closed pipe, an unknown flag."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time

import pytest

from cluster import Cluster, free_port
from mooncaked.ctl import make_parser

pytestmark = pytest.mark.timeout(300)

CTL = [sys.executable, "-m", "mooncaked.ctl"]


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("MOONCAKED_")}


def _ctl(*args: str, conductor: str | None = None) -> subprocess.CompletedProcess:
    extra = ["--conductor", conductor] if conductor else []
    return subprocess.run([*CTL, *extra, *args], capture_output=True, text=True, timeout=60, env=_env())


@pytest.fixture(scope="module")
def cluster(tiny_model_factory, tmp_path_factory):
    """`mooncaked --role all` once its prefill and decode serve; yields its conductor's address."""
    _, folder = tiny_model_factory("llama")
    logs = tmp_path_factory.mktemp("ctl-logs")
    env = Cluster(folder, logs).env()
    conductor = f"127.0.0.1:{free_port()}"
    log_path = logs / "all.log"
    proc = subprocess.Popen([sys.executable, "-m", "mooncaked.cli", "--role", "all", "--listen", conductor,
                             "--http", "127.0.0.1:0"], env=env, stdout=open(log_path, "w"),
                            stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while "mooncaked all: cluster ready" not in log_path.read_text():
            assert proc.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, "the all role did not get ready"
            time.sleep(0.2)
        # one request through, so the pool and the counters hold something
        gen = _ctl("generate", "t1 t2 t3 t4 t5 t6 t7 t8 t9", "--raw", "--max-tokens", "3", conductor=conductor)
        assert gen.returncode == 0, gen.stderr
        yield conductor
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _numbers(d: dict, keys: list[str], kind=int) -> None:
    for k in keys:
        assert type(d[k]) is kind, f"{k} = {d[k]!r} is not a JSON {kind.__name__}"


def test_status_is_the_clusters_one_screen(cluster):
    out = _ctl("status", conductor=cluster)
    assert out.returncode == 0 and out.stderr == "", out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith(f"conductor  {cluster} (HTTP 127.0.0.1:")
    assert "ready, policy mooncake, SLOs off, up " in lines[0] and "in flight" in lines[0] and "rejected" in lines[0]
    assert re.match(r"store      127\.0\.0\.1:\d+: epoch \d+, \d+ segments, \d+ objects, DRAM [\d.]+(B|KiB|MiB)/256\.0MiB",
                    lines[1]), lines[1]
    assert "hit rate" in lines[1] and "evictions" in lines[1]
    table = "\n".join(lines[2:])
    assert re.search(r"^prefill-127\.0\.0\.1-\d+ +prefill +127\.0\.0\.1:\d+ +serving", table, re.M), table
    assert re.search(r"^decode-127\.0\.0\.1-\d+ +decode +127\.0\.0\.1:\d+ +serving", table, re.M), table


def test_status_json_has_numbers_as_numbers(cluster):
    # loads are the instances' last heartbeats: the fixture's request shows once the prefill's next one came
    deadline = time.monotonic() + 10
    while True:
        out = _ctl("status", "--json", conductor=cluster)
        assert out.returncode == 0, out.stderr
        st = json.loads(out.stdout)
        loads = [i["load"]["prefill_tokens_computed"] for i in st["instances"] if i["role"] == "prefill"]
        if any(loads) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    c = st["conductor"]
    assert c["address"] == cluster and c["state"] == "ready" and c["policy"] == "mooncake"
    assert c["ttft_slo_s"] is None and c["tbt_slo_s"] is None
    _numbers(c, ["requests_in_flight", "rejections"])
    _numbers(c, ["uptime_s", "ready_timeout_s"], float)
    s = st["store"]
    assert s["reachable"] is True and s["address"].startswith("127.0.0.1:")
    _numbers(s, ["epoch", "segments", "objects", "hits", "misses", "evictions", "clients"])
    assert s["segments"] >= 1 and s["clients"] >= 1
    dram = next(t for t in s["tiers"] if t["medium"] == "dram")
    _numbers(dram, ["segments", "used", "capacity", "objects"])
    assert dram["capacity"] == 256 << 20
    assert sorted(i["role"] for i in st["instances"]) == ["decode", "prefill"]
    for i in st["instances"]:
        assert i["state"] == "serving"
        _numbers(i["load"], ["total_kv_blocks", "free_kv_blocks", "running_requests"])
    prefill = next(i for i in st["instances"] if i["role"] == "prefill")
    assert prefill["load"]["prefill_tokens_computed"] > 0  # the fixture's request went through it


def test_store_finds_the_master_through_the_conductor(cluster):
    status = json.loads(_ctl("status", "--json", conductor=cluster).stdout)
    prefill = next(i["name"] for i in status["instances"] if i["role"] == "prefill")
    out = _ctl("store", conductor=cluster)  # no --store, no MOONCAKED_STORE
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"store master {status['store']['address']}: epoch {status['store']['epoch']}")
    assert re.search(rf"^\S+ +{re.escape(prefill)} +dram ", out.stdout, re.M), out.stdout  # owner: the instance
    js = json.loads(_ctl("store", "--json", conductor=cluster).stdout)
    _numbers(js, ["objects", "hits", "misses", "evictions", "master_epoch"])
    assert js["master_epoch"] == status["store"]["epoch"]
    assert all(type(seg["capacity"]) is int for seg in js["segments"])


def test_drain_and_undrain_by_address(cluster):
    status = json.loads(_ctl("status", "--json", conductor=cluster).stdout)
    decode = next(i for i in status["instances"] if i["role"] == "decode")
    out = _ctl("drain", decode["address"], conductor=cluster)
    assert (out.returncode, out.stdout) == (0, f"{decode['name']}: draining\n"), out.stderr
    states = {i["name"]: i["state"] for i in json.loads(_ctl("status", "--json", conductor=cluster).stdout)["instances"]}
    assert states[decode["name"]] == "draining"
    out = _ctl("undrain", decode["name"], conductor=cluster)
    assert (out.returncode, out.stdout) == (0, f"{decode['name']}: serving\n"), out.stderr


def test_closed_pipe_gives_no_traceback(cluster):
    ctl = " ".join(shlex.quote(a) for a in [*CTL, "--conductor", cluster, "status"])
    head = subprocess.run(["bash", "-c", f"{ctl} | head -1"], capture_output=True, text=True, timeout=60, env=_env())
    assert head.stdout.startswith(f"conductor  {cluster}") and head.stdout.count("\n") == 1
    assert head.stderr == "", head.stderr
    # a reader that is gone before anything is written: the write fails with EPIPE
    gone = subprocess.run(["bash", "-c", f'{ctl} | true; echo "rc=${{PIPESTATUS[0]}}"'], capture_output=True,
                          text=True, timeout=60, env=_env())
    assert gone.stderr == "", gone.stderr
    assert gone.stdout.strip() in ("rc=141", "rc=0")


def test_a_conductor_that_is_down_is_one_line_naming_the_flag():
    down = f"127.0.0.1:{free_port()}"
    for args in (["status"], ["drain", "p1"], ["generate", "hi"], ["store"]):
        out = _ctl(*args, conductor=down)
        assert out.returncode == 1, (args, out)
        assert out.stdout == "" and len(out.stderr.splitlines()) == 1, (args, out.stderr)
        assert f"no conductor answers at {down}" in out.stderr and "--conductor" in out.stderr
        assert "MOONCAKED_CONDUCTOR" in out.stderr and "Traceback" not in out.stderr
    store = _ctl("--store", down, "store")
    assert store.returncode == 1 and len(store.stderr.splitlines()) == 1 and "--store" in store.stderr


def test_unknown_flag_is_one_line_with_a_hint():
    out = _ctl("status", "--jsn")
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.splitlines() == ["mooncakectl: error: unrecognized arguments: --jsn; did you mean --json? "
                                       "(see mooncakectl --help)"]


def test_every_flag_says_what_it_does_and_its_default():
    parser = make_parser()
    subs = next(a for a in parser._actions if a.dest == "command").choices
    for p in [parser, *subs.values()]:
        for a in p._actions:
            if a.dest in ("help", "command") or not a.option_strings:
                continue
            assert a.help and "default" in a.help, f"{p.prog} {a.option_strings}: {a.help!r}"
