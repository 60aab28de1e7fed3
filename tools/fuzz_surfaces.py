"""Hostile inputs for every surface of a running cluster, and a tally of what they did.

Surfaces: the conductor's HTTP routes; every gRPC method of the Conductor, Engine and
StoreMaster services (messages of the right shape with hostile values, and random bytes);
the transfer engine's TCP port and the store master's fast path (random, truncated and
oversized frames); the model loaders (hostile config.json, safetensors and GGUF files).
hypothesis draws the inputs. A robust server never does any of these, and the tally counts
them: **crash** (a process dies; a loader raises something other than its typed errors),
**hang** (no answer within a deadline), **server error** (HTTP 5xx other than 503/504,
gRPC UNKNOWN, or INTERNAL not from a request that could not be parsed).

Addresses in fuzzed messages are only ever loopback literals (never a name to resolve, never
another host): a fuzzed Register or Prefill makes the cluster dial what it says.
"""

from __future__ import annotations

import gzip
import http.client
import json
import os
import random
import re
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message_factory import GetMessageClass
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

from mooncaked.proto.mooncake.v1 import conductor_pb2, engine_pb2, store_pb2

HTTP_TIMEOUT_S = 60.0
GRPC_TIMEOUT_S = 15.0
RAW_TIMEOUT_S = 5.0
SAFE_ADDRESSES = ["127.0.0.1:1", "127.0.0.1:0", "127.0.0.1:65535", "[::1]:1", "", ":", "127.0.0.1",
                  "127.0.0.1:notaport", "[::1]", "127.0.0.1:99999"]
_ADDRESS_FIELD = re.compile(r"address|host|endpoint|url|master|conductor|peer|listen")


@dataclass
class Tally:
    """What one surface's inputs did."""

    surface: str
    inputs: int = 0
    crashes: int = 0
    hangs: int = 0
    server_errors: int = 0
    samples: list[str] = field(default_factory=list)  # the first few bad outcomes, for a person to read

    def bad(self, kind: str, what: str) -> None:
        setattr(self, kind, getattr(self, kind) + 1)
        if len(self.samples) < 8:
            self.samples.append(f"{kind}: {what[:300]}")

    def as_dict(self) -> dict[str, Any]:
        return {"inputs": self.inputs, "crashes": self.crashes, "hangs": self.hangs,
                "server_errors": self.server_errors, "samples": self.samples}


def run_examples(strategy: st.SearchStrategy, n: int, send: Callable[[Any], None], seed: int) -> None:
    """Draw up to ``n`` inputs from ``strategy`` and hand each to ``send`` (no shrinking: we count, not fail)."""

    @settings(max_examples=n, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @hypothesis_seed(seed)
    @given(strategy)
    def one(x: Any) -> None:
        send(x)

    one()


# ---------------------------------------------------------------------------------------------
# values

EXTREME_INTS = [0, -1, 1, 2, 255, 256, 2**31 - 1, 2**31, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64, -2**63, 10**30]
EXTREME_FLOATS = [0.0, -0.0, 1e-40, 1e-300, 1e-5, 0.5, 1.0, 2.0, 1e10, 1e308, -1e308, -1.0, 5e-324]


def json_values() -> st.SearchStrategy:
    scalars = st.one_of(st.none(), st.booleans(), st.sampled_from(EXTREME_INTS), st.integers(),
                        st.sampled_from(EXTREME_FLOATS), st.floats(allow_nan=False, allow_infinity=False),
                        st.text(max_size=40))
    return st.recursive(scalars, lambda c: st.lists(c, max_size=6) | st.dictionaries(st.text(max_size=12), c,
                                                                                      max_size=6), max_leaves=24)


OPENAI_FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p",
                 "top_k", "min_p", "n", "seed", "stop", "stop_token_ids", "logprobs", "top_logprobs", "echo",
                 "presence_penalty", "frequency_penalty", "repetition_penalty", "stream", "stream_options", "user",
                 "logit_bias", "ignore_eos", "skip_special_tokens", "suffix", "best_of", "tools", "response_format",
                 "min_tokens", "tool_choice", "guided_json", "guided_regex", "guided_choice"]
INDEXER_FIELDS = ["tokens", "token_ids", "block_hashes", "model", "model_name", "instance_id", "tenant_id", "dp_rank",
                  "endpoint", "type", "lora_name", "lora_id", "block_size", "events", "medium", "parent_block_hash"]


def _bodies(model: str) -> st.SearchStrategy[bytes]:
    """Request bodies: OpenAI-shaped with hostile fields, indexer-shaped, any JSON, raw bytes, nesting bombs,
    lone surrogates."""
    hostile = st.one_of(json_values(), st.lists(st.sampled_from(EXTREME_INTS), max_size=8),
                        st.lists(st.integers(0, 300), min_size=1, max_size=64))
    completion = st.fixed_dictionaries({"model": st.just(model), "prompt": st.just("t5 t6 t7"),
                                        "max_tokens": st.integers(1, 4)})
    chat = st.fixed_dictionaries({"model": st.just(model), "max_tokens": st.integers(1, 4),
                                  "messages": st.just([{"role": "user", "content": "t5 t6"}])})
    mutated = st.tuples(completion | chat, st.dictionaries(st.sampled_from(OPENAI_FIELDS), hostile, max_size=4)
                        ).map(lambda t: {**t[0], **t[1]})
    indexer = st.dictionaries(st.sampled_from(INDEXER_FIELDS), hostile, max_size=6)
    as_json = st.one_of(mutated, indexer, json_values()).map(lambda v: json.dumps(v).encode())
    surrogate = st.sampled_from([b'{"model":"%s","prompt":"\\ud800"}', b'{"model":"%s","messages":[{"role":"user",'
                                 b'"content":"a\\udfff"}]}', b'{"model":"%s","prompt":"x","stop":"\\ud834"}']
                                ).map(lambda b: b.replace(b"%s", model.encode()))
    nesting = st.integers(1, 200_000).map(lambda d: b"[" * d + b"]" * d)
    return st.one_of(as_json, as_json, as_json, st.binary(max_size=2048), surrogate, nesting,
                     st.just(b'{"model": "x", "max_tokens": 1' + b"0" * 5000 + b"}"))


HTTP_ROUTES = [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
               ("GET", "/v1/models/default"), ("POST", "/query"), ("POST", "/query_by_hash"), ("POST", "/register"),
               ("POST", "/unregister"), ("POST", "/events"), ("GET", "/metrics"), ("GET", "/health"),
               ("POST", "/health"), ("GET", "/no/such/route"), ("DELETE", "/v1/completions")]


def http_inputs(model: str) -> st.SearchStrategy:
    headers = st.dictionaries(
        st.sampled_from(["Content-Type", "Content-Encoding", "Authorization", "Accept", "Accept-Encoding",
                         "X-Forwarded-For", "Connection", "Expect", "Range"]),
        st.one_of(st.sampled_from(["application/json", "text/plain", "gzip", "deflate", "br", "identity", "*/*",
                                   "Bearer x", "Bearer ", "keep-alive", "close", "100-continue", "bytes=0-1"]),
                  st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=60)),
        max_size=4)
    return st.tuples(st.sampled_from(HTTP_ROUTES), headers, _bodies(model), st.booleans())


# ---------------------------------------------------------------------------------------------
# the HTTP front


def http_send(host: str, port: int, x: tuple, tally: Tally, alive: Callable[[], str | None]) -> None:
    (method, path), headers, body, gzip_it = x
    if gzip_it and headers.get("Content-Encoding") == "gzip":
        body = gzip.compress(body)
    tally.inputs += 1
    conn = http.client.HTTPConnection(host, port, timeout=HTTP_TIMEOUT_S)
    try:
        conn.request(method, path, body=body if method != "GET" else None, headers=headers)
        resp = conn.getresponse()
        resp.read()
        if resp.status >= 500 and resp.status not in (503, 504):
            tally.bad("server_errors", f"{method} {path} -> {resp.status} for {body[:200]!r} {headers}")
    except socket.timeout:
        tally.bad("hangs", f"{method} {path}: no answer in {HTTP_TIMEOUT_S}s for {body[:200]!r}")
    except (ConnectionError, http.client.HTTPException, OSError):
        pass  # a connection the server closed on garbage is an answer
    finally:
        conn.close()
    dead = alive()
    if dead:
        tally.bad("crashes", f"{dead} died after {method} {path} {body[:200]!r}")


# ---------------------------------------------------------------------------------------------
# gRPC: every method of every service


SERVICES = {"Conductor": conductor_pb2, "Engine": engine_pb2, "StoreMaster": store_pb2}
SUBSCRIPTIONS = {"Tasks", "WatchPool"}  # streams that wait for events: a deadline there is no hang


def _scalar(f: FieldDescriptor) -> st.SearchStrategy:
    t = f.type
    if t in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
        return st.one_of(st.sampled_from(EXTREME_FLOATS + [float("nan"), float("inf"), -float("inf")]),
                         st.floats(width=32 if t == FieldDescriptor.TYPE_FLOAT else 64))
    if t == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if t == FieldDescriptor.TYPE_STRING:
        if _ADDRESS_FIELD.search(f.name):
            return st.sampled_from(SAFE_ADDRESSES)
        return st.one_of(st.text(max_size=40), st.sampled_from(["", "a" * 5000, "../../etc/passwd", "store",
                                                                 "SmolLM2/1", "\x00"]))
    if t == FieldDescriptor.TYPE_BYTES:
        return st.binary(max_size=256)
    if t in (FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_FIXED64):
        lo, hi = 0, 2**64 - 1
    elif t in (FieldDescriptor.TYPE_UINT32, FieldDescriptor.TYPE_FIXED32):
        lo, hi = 0, 2**32 - 1
    elif t in (FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_SINT64, FieldDescriptor.TYPE_SFIXED64):
        lo, hi = -2**63, 2**63 - 1
    else:  # int32, sint32, sfixed32, enum (proto3 enums are open)
        lo, hi = -2**31, 2**31 - 1
    return st.one_of(st.sampled_from([v for v in EXTREME_INTS if lo <= v <= hi]), st.integers(lo, hi),
                     st.integers(0, 64))


@st.composite
def _fill(draw, cls: type, depth: int):
    msg = cls()
    for f in cls.DESCRIPTOR.fields:
        if not draw(st.booleans()):
            continue
        is_map = f.message_type is not None and f.message_type.GetOptions().map_entry
        repeated = f.is_repeated
        if is_map:
            kf, vf = f.message_type.fields_by_name["key"], f.message_type.fields_by_name["value"]
            for _ in range(draw(st.integers(0, 3))):
                k = draw(_scalar(kf))
                if vf.message_type is None:
                    getattr(msg, f.name)[k] = draw(_scalar(vf))
                elif depth < 3:
                    getattr(msg, f.name)[k].CopyFrom(draw(_fill(GetMessageClass(vf.message_type), depth + 1)))
        elif f.message_type is not None:
            if depth >= 3:
                continue
            sub = GetMessageClass(f.message_type)
            if repeated:
                for _ in range(draw(st.integers(0, 4))):
                    getattr(msg, f.name).add().CopyFrom(draw(_fill(sub, depth + 1)))
            else:
                getattr(msg, f.name).CopyFrom(draw(_fill(sub, depth + 1)))
        elif repeated:
            n = draw(st.one_of(st.integers(0, 8), st.sampled_from([0, 1, 100, 20_000])))
            value = _scalar(f)
            if n > 64:  # a long list of one hostile value: bounds before work
                getattr(msg, f.name).extend([draw(value)] * n)
            else:
                getattr(msg, f.name).extend(draw(st.lists(value, min_size=n, max_size=n)))
        else:
            setattr(msg, f.name, draw(_scalar(f)))
    return msg


def sanitize(msg) -> None:
    """Every address-like string field in ``msg`` (at any depth) becomes a loopback literal."""
    for f, value in msg.ListFields():
        if f.message_type is not None:
            if f.message_type.GetOptions().map_entry:
                continue
            for sub in (value if f.is_repeated else [value]):
                sanitize(sub)
        elif f.type == FieldDescriptor.TYPE_STRING and _ADDRESS_FIELD.search(f.name):
            if f.is_repeated:
                del value[:]
            else:
                setattr(msg, f.name, SAFE_ADDRESSES[hash(value) % len(SAFE_ADDRESSES)])


@dataclass(frozen=True)
class Method:
    service: str
    name: str
    request: type
    server_stream: bool

    @property
    def path(self) -> str:
        return f"/mooncake.v1.{self.service}/{self.name}"


def methods(service: str) -> list[Method]:
    desc = SERVICES[service].DESCRIPTOR.services_by_name[service]
    return [Method(service, m.name, GetMessageClass(m.input_type), m.server_streaming) for m in desc.methods]


def grpc_inputs(service: str) -> st.SearchStrategy:
    """(method, request bytes): a hostile message of the method's own type, or random bytes (which,
    when they happen to parse, are sanitized like any message before they go)."""
    ms = methods(service)

    def raw(m: Method, data: bytes) -> tuple[Method, bytes]:
        try:
            msg = m.request.FromString(data)
        except Exception:  # noqa: BLE001 - not a message: sent as it is, the server must refuse it
            return m, data
        sanitize(msg)
        return m, msg.SerializeToString()

    shaped = st.sampled_from(ms).flatmap(lambda m: _fill(m.request, 0).map(lambda msg: (m, msg)))
    shaped = shaped.map(lambda t: (sanitize(t[1]), (t[0], t[1].SerializeToString()))[1])
    random_bytes = st.tuples(st.sampled_from(ms), st.binary(max_size=512)).map(lambda t: raw(*t))
    return st.one_of(shaped, shaped, random_bytes)


def grpc_send(channel: grpc.Channel, x: tuple[Method, bytes], tally: Tally, alive: Callable[[], str | None],
              metadata: list[tuple[str, str]] | None = None) -> None:
    m, data = x
    tally.inputs += 1
    ident = lambda b: b  # noqa: E731
    timeout = 2.0 if m.name in SUBSCRIPTIONS else GRPC_TIMEOUT_S
    try:
        if m.server_stream:
            call = channel.unary_stream(m.path, request_serializer=ident, response_deserializer=ident)(
                data, timeout=timeout, metadata=metadata)
            try:
                for i, _ in enumerate(call):
                    if i >= 2:
                        break
            finally:
                call.cancel()
        else:
            channel.unary_unary(m.path, request_serializer=ident, response_deserializer=ident)(
                data, timeout=timeout, metadata=metadata)
    except grpc.RpcError as e:
        code, details = e.code(), e.details() or ""
        if code == grpc.StatusCode.UNKNOWN or (code == grpc.StatusCode.INTERNAL
                                               and "deserializ" not in details.lower()):
            tally.bad("server_errors", f"{m.path} -> {code.name}: {details[:200]}")
        elif code == grpc.StatusCode.DEADLINE_EXCEEDED and m.name not in SUBSCRIPTIONS:
            tally.bad("hangs", f"{m.path}: no answer in {timeout}s")
    dead = alive()
    if dead:
        tally.bad("crashes", f"{dead} died after {m.path} ({len(data)} bytes)")


# ---------------------------------------------------------------------------------------------
# raw ports: the transfer engine's tcp backend, the store master's fast path, a DRAM owner's reads by key


def transfer_frames() -> st.SearchStrategy[bytes]:
    from mooncaked.transfer.wire import MAGIC, REQ, VERSION

    name = st.one_of(st.sampled_from([b"kv", b"store", b"", b"x" * 64]), st.binary(max_size=64))
    header = st.builds(lambda op, nm, rid, off, ln, magic, ver: REQ.pack(magic, ver, op, len(nm) & 0xFFFF, rid, off,
                                                                          ln, nm),
                       st.integers(0, 255), name, st.integers(0, 2**64 - 1),
                       st.sampled_from([0, 1, 4096, 2**40, 2**64 - 1]) | st.integers(0, 2**64 - 1),
                       st.sampled_from([0, 1, 16, 4096, 2**40, 2**64 - 1]) | st.integers(0, 2**64 - 1),
                       st.sampled_from([MAGIC, MAGIC, 0]), st.sampled_from([VERSION, VERSION, 0, 255]))
    frames = st.lists(st.tuples(header, st.binary(max_size=512)).map(lambda t: t[0] + t[1]), min_size=1, max_size=4)
    return st.one_of(frames.map(b"".join), st.binary(max_size=2048),
                     st.tuples(frames.map(b"".join), st.integers(1, 200)).map(lambda t: t[0][: t[1]]))


def fast_path_frames() -> st.SearchStrategy[bytes]:
    from mooncaked.store.fast_wire import HEADER, HELLO, METHODS

    names = st.one_of(st.sampled_from(sorted(METHODS)), st.text(max_size=20)).map(lambda s: s.encode())

    def frame(kind: int, name: bytes, body: bytes, claimed: int | None, call_id: int, timeout: int) -> bytes:
        length = len(name) + len(body) if claimed is None else claimed
        return HEADER.pack(length & 0xFFFFFFFF, kind & 0xFF, len(name) & 0xFF, 0, call_id & 0xFFFFFFFF,
                           timeout & 0xFFFFFFFF) + name + body

    one = st.builds(frame, st.integers(0, 3), names, st.binary(max_size=256),
                    st.one_of(st.none(), st.sampled_from([0, 1, 60 << 20, 2**32 - 1])),
                    st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1))
    hello = st.sampled_from([HELLO, HELLO, b"", HELLO[:4], b"GET / HTTP/1.1\r\n\r\n"])
    return st.one_of(st.tuples(hello, st.lists(one, min_size=1, max_size=3)).map(lambda t: t[0] + b"".join(t[1])),
                     st.binary(max_size=2048))


def owner_read_frames() -> st.SearchStrategy[bytes]:
    """Reads by key from a DRAM owner (store/owner_wire.py): hostile headers and keys, long pipelines."""
    from mooncaked.store.owner_wire import MAX_KEY_BYTES, REQUEST

    key = st.one_of(st.sampled_from([b"", b"k", b"x" * MAX_KEY_BYTES, b"x" * (MAX_KEY_BYTES + 1), b"\xff\xfe"]),
                    st.binary(max_size=64))
    edges = st.sampled_from([0, 1, 4096, 2**40, 2**40 + 1, 2**64 - 1])

    def request(k: bytes, claimed: int | None, req_id: int, size: int, csum: int) -> bytes:
        return REQUEST.pack((len(k) if claimed is None else claimed) & 0xFFFF, req_id, size, csum) + k

    one = st.builds(request, key, st.one_of(st.none(), st.sampled_from([0, 1, MAX_KEY_BYTES + 1, 0xFFFF])),
                    st.integers(0, 2**64 - 1), edges | st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1))
    pipeline = st.tuples(one, st.integers(1, 300)).map(lambda t: t[0] * t[1])  # many answers owed at once
    frames = st.lists(one, min_size=1, max_size=4).map(b"".join)
    return st.one_of(frames, pipeline, st.binary(max_size=2048),
                     st.tuples(frames, st.integers(1, 60)).map(lambda t: t[0][: t[1]]))


def raw_send(host: str, port: int, data: bytes, tally: Tally, alive: Callable[[], str | None],
             probe: Callable[[], str | None]) -> None:
    """Send the bytes, read what comes back for a moment, close; then check the server still answers."""
    tally.inputs += 1
    try:
        s = socket.create_connection((host, port), timeout=RAW_TIMEOUT_S)
    except OSError as e:
        tally.bad("hangs", f"cannot connect to {host}:{port}: {e}")
    else:
        with s:
            try:
                s.sendall(data)
                s.shutdown(socket.SHUT_WR)  # end of input: a server waiting for the rest of a frame sees EOF
                s.settimeout(0.5)
                while s.recv(65536):
                    pass
            except OSError:
                pass  # the server closed first (it refused the bytes), or said nothing more: both answers
    dead = alive()
    if dead:
        tally.bad("crashes", f"{dead} died after {len(data)} bytes to {port}: {data[:100]!r}")
    elif tally.inputs % 50 == 0:
        why = probe()
        if why:
            tally.bad("hangs", f"port {port} stopped answering: {why}")


# ---------------------------------------------------------------------------------------------
# loaders: hostile model folders, each loaded in a worker process with a memory cap


LOADER_WORKER = r"""
import json, resource, sys, traceback
resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))
from pathlib import Path
from mooncaked.startup import user_message
from mooncaked.engine import Engine
from mooncaked.engine.config import EngineConfig
for line in sys.stdin:
    path = line.strip()
    try:
        engine = Engine.from_pretrained(path, kv_cache_bytes=1 << 20, cache_dir=Path(path).parent / "cache")
        engine.close()
        out = "ok"
    except BaseException as e:
        out = "ok" if user_message(e) is not None else "crash " + "".join(traceback.format_exception_only(e))[-400:]
    print(json.dumps(out), flush=True)
"""


def loader_inputs() -> st.SearchStrategy:
    """(kind, mutation) for a tiny model folder: config.json values, safetensors header and bytes, GGUF bytes."""
    config_keys = ["hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                   "num_key_value_heads", "vocab_size", "max_position_embeddings", "head_dim", "rms_norm_eps",
                   "rope_theta", "rope_scaling", "tie_word_embeddings", "architectures", "torch_dtype",
                   "eos_token_id", "bos_token_id", "sliding_window"]
    config = st.dictionaries(st.sampled_from(config_keys), json_values() | st.sampled_from(EXTREME_INTS),
                             min_size=1, max_size=4)
    safetensors = st.one_of(
        st.tuples(st.sampled_from(EXTREME_INTS + [8, 100]), st.binary(max_size=256)),  # header length, bytes
        st.tuples(st.just(None), st.binary(max_size=512)),  # the file cut at a random place (length in bytes)
    )
    gguf_bytes = st.one_of(st.binary(max_size=512).map(lambda b: b"GGUF" + b),
                           st.tuples(st.integers(0, 4096), st.binary(max_size=64)))
    return st.one_of(st.tuples(st.just("config"), config), st.tuples(st.just("safetensors"), safetensors),
                     st.tuples(st.just("gguf"), gguf_bytes), st.tuples(st.just("files"), st.sampled_from(
                         ["no-config", "no-weights", "no-tokenizer", "empty-config", "config-list"])))


def make_hostile_model(base: Path, gguf_file: Path | None, x: tuple, out: Path) -> Path:
    """A copy of the tiny model folder (or a .gguf) with one hostile change; returns what to load."""
    import shutil

    kind, what = x
    if kind == "gguf" and gguf_file is not None:
        data = gguf_file.read_bytes()
        path = out / "model.gguf"
        if isinstance(what, bytes):
            path.write_bytes(what)
        else:
            cut, junk = what
            path.write_bytes(data[: min(cut, len(data))] + junk)
        return path
    shutil.copytree(base, out / "model")
    folder = out / "model"
    if kind == "config":
        cfg = json.loads((folder / "config.json").read_text())
        cfg.update(what)
        (folder / "config.json").write_text(json.dumps(cfg))
    elif kind == "safetensors":
        weights = next(folder.glob("*.safetensors"))
        data = weights.read_bytes()
        header_len, junk = what
        if header_len is None:
            weights.write_bytes(data[: len(junk)])
        else:
            weights.write_bytes(struct.pack("<Q", header_len & (2**64 - 1)) + junk)
    elif kind == "files":
        if what == "no-config":
            (folder / "config.json").unlink()
        elif what == "no-weights":
            for w in folder.glob("*.safetensors"):
                w.unlink()
        elif what == "no-tokenizer":
            (folder / "tokenizer.json").unlink(missing_ok=True)
        elif what == "empty-config":
            (folder / "config.json").write_text("")
        else:
            (folder / "config.json").write_text("[1, 2, 3]")
    return folder


class LoaderWorker:
    """A subprocess that loads one model path per line and answers "ok" / "crash ..."; restarted when it dies."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self.proc: subprocess.Popen | None = None

    def _start(self) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", LOADER_WORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True, env=self.env)

    def load(self, path: Path, timeout_s: float = 60.0) -> str:
        if self.proc is None or self.proc.poll() is not None:
            self.proc = self._start()
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write(f"{path}\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            self.proc = None
            return "crash: the loader process died"
        import select

        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        if not ready:
            self.proc.kill()
            self.proc = None
            return "hang"
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait()
            self.proc = None
            return f"crash: the loader process died (exit {code})"
        return json.loads(line)

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.close()  # type: ignore[union-attr]
            self.proc.wait(30)


def loader_send(worker: LoaderWorker, base: Path, gguf_file: Path | None, x: tuple, tally: Tally) -> None:
    tally.inputs += 1
    with tempfile.TemporaryDirectory() as tmp:
        path = make_hostile_model(base, gguf_file, x, Path(tmp))
        out = worker.load(path)
    if out == "hang":
        tally.bad("hangs", f"loading {x!r:.200} took over 60s")
    elif out != "ok":
        tally.bad("crashes", f"{x!r:.200}: {out}")


# ---------------------------------------------------------------------------------------------
# process health


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def settled_fd_growth(pids: dict[str, int], before: dict[str, int], wait_s: float = 20.0) -> dict[str, int]:
    """Each process's open descriptors over its count before, once closed connections are reaped."""
    deadline = time.monotonic() + wait_s
    while True:
        growth = {n: max(0, fd_count(p) - before[n]) for n, p in pids.items()}
        if not any(growth.values()) or time.monotonic() > deadline:
            return growth
        time.sleep(0.5)


def random_seed() -> int:
    return random.SystemRandom().randrange(2**32)
