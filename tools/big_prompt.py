"""A huge prompt against a real cluster (conductor, prefill, decode on a tiny model) while /health is probed
from another thread: the answer's status and time, /health latency, the conductor's RSS before and after,
whether every engine still serves (docs/reliability.md).

    python tools/big_prompt.py [--mb 60]
"""
from pathlib import Path
import argparse, json, sys, tempfile, threading, time, urllib.request, http.client
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from cluster import Cluster
from tiny_models import make_tiny_model
def rss(pid):
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS"): return int(line.split()[1]) // 1024
ap = argparse.ArgumentParser(description=__doc__); ap.add_argument("--mb", type=int, default=60)
MB = ap.parse_args().mb
tmp = Path(tempfile.mkdtemp()); make_tiny_model("llama", tmp / "m")
c = Cluster(tmp / "m", tmp)
try:
    c.start_serving()
    port = int(c.http.rsplit(":", 1)[1]); pid = c.procs["conductor"].pid
    body = json.dumps({"model": c.model.name, "prompt": "t1 " * (MB * 1024 * 1024 // 3), "max_tokens": 2}).encode()
    print("RSS start", rss(pid), "MB; body", len(body), "bytes")
    lat, stop = [], threading.Event()
    def probe():
        while not stop.is_set():
            t = time.perf_counter()
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as r: r.read()
            lat.append(time.perf_counter() - t); time.sleep(0.02)
    th = threading.Thread(target=probe); th.start(); time.sleep(0.5)
    t = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
        r = conn.getresponse(); status = r.status; r.read()
    except (BrokenPipeError, ConnectionResetError) as e:
        status = f"connection closed ({e})"
    took = time.perf_counter() - t
    time.sleep(1.0); stop.set(); th.join()
    print(f"{MB} MB prompt: {status} in {took:.2f} s; /health p50 {sorted(lat)[len(lat)//2]*1000:.1f} ms, max {max(lat)*1000:.1f} ms over {len(lat)} probes; RSS after {rss(pid)} MB")
    print("instances:", [(i.name, i.state) for i in c.status().instances])
finally:
    c.stop()
