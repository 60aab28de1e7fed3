"""etcd v3 through its JSON gateway (`/v3/...` over HTTP, served by etcd 3.4 itself), on aiohttp.

Why the gateway and not a gRPC client: etcd's Python clients pin grpcio/protobuf versions of
their own; the gateway needs nothing we do not already have. Keys and values travel base64,
64-bit numbers come back as strings, streams (keepalive, watch) as newline-delimited JSON.

Every call has a deadline. Several endpoints (`HOST:PORT,HOST:PORT`) are tried in turn, the
one that last answered first; a call fails with `EtcdUnavailable` only when none answered in
time. With mutual TLS configured (`mooncaked.security`) we speak https and present our
certificate (an endpoint written `http://...` or `https://...` keeps its scheme).
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import ssl
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from mooncaked.security import Security

logger = logging.getLogger(__name__)

TIMEOUT_S = 2.0
"""A call's deadline when its caller names none (over all endpoints together)."""


class EtcdError(Exception):
    """etcd refused the call (its message says why)."""


class EtcdUnavailable(EtcdError):
    """No endpoint answered in time."""


@dataclass(frozen=True)
class KeyValue:
    key: str
    value: bytes
    create_revision: int
    mod_revision: int
    lease: int


@dataclass(frozen=True)
class WatchEvent:
    kind: str  # "put" | "delete"
    kv: KeyValue


def _b64(text: str | bytes) -> str:
    return base64.b64encode(text.encode() if isinstance(text, str) else text).decode("ascii")


def _kv(raw: dict[str, Any]) -> KeyValue:
    return KeyValue(key=base64.b64decode(raw.get("key", "")).decode("utf-8", "replace"),
                    value=base64.b64decode(raw.get("value", "")),
                    create_revision=int(raw.get("create_revision", 0)), mod_revision=int(raw.get("mod_revision", 0)),
                    lease=int(raw.get("lease", 0)))


def _range_end(prefix: str) -> str:
    raw = bytearray(prefix.encode())
    while raw and raw[-1] == 0xFF:
        raw.pop()
    if not raw:
        return _b64(b"\0")
    raw[-1] += 1
    return _b64(bytes(raw))


class EtcdGateway:
    """A handle on one etcd cluster; `await close()` when done."""

    def __init__(self, endpoints: Sequence[str], security: Security | None = None,
                 timeout_s: float = TIMEOUT_S) -> None:
        if not endpoints:
            raise ValueError("etcd needs at least one endpoint (HOST:PORT)")
        self.security = security or Security()
        scheme = "https" if self.security.tls else "http"
        self.endpoints = [e if "://" in e else f"{scheme}://{e}" for e in endpoints]
        self.timeout_s = timeout_s
        self._first = 0  # the endpoint that answered last
        self._session: aiohttp.ClientSession | None = None

    def _ssl(self) -> ssl.SSLContext | None:
        sec = self.security
        if not sec.tls:
            return None
        ctx = ssl.create_default_context(cafile=sec.ca_file) if sec.ca_file else \
            ssl.create_default_context(cadata=(sec.ca or b"").decode())
        if sec.cert_file and sec.key_file:
            ctx.load_cert_chain(sec.cert_file, sec.key_file)
        return ctx

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(ssl=self._ssl() or False, limit=16)
            self._session = aiohttp.ClientSession(connector=connector)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    # -- the transport -----------------------------------------------------------------------------
    async def _post(self, path: str, body: dict[str, Any], timeout_s: float | None = None) -> dict[str, Any]:
        """One JSON call; endpoints in turn (each gets an equal share of what time is left)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (timeout_s or self.timeout_s)
        n = len(self.endpoints)
        errors: list[str] = []
        for i in range(n):
            k = (self._first + i) % n
            left = deadline - loop.time()
            if left <= 0:
                break
            url = self.endpoints[k] + path
            try:
                async with self._http().post(url, json=body,
                                             timeout=aiohttp.ClientTimeout(total=left / (n - i))) as resp:
                    text = await resp.text()
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ssl.SSLError) as e:
                errors.append(f"{self.endpoints[k]}: {type(e).__name__}: {e}".rstrip(": "))
                continue
            msg = _first_json(text)
            if resp.status != 200 or "error" in msg:
                err = msg.get("error")
                why = (err.get("message") if isinstance(err, dict) else err) or msg.get("message") or text[:200]
                code = (err.get("grpc_code") or err.get("http_code")) if isinstance(err, dict) else msg.get("code")
                if code == 14 or resp.status in (502, 503):  # gRPC UNAVAILABLE behind the gateway: try another
                    errors.append(f"{self.endpoints[k]}: {why}")
                    continue
                raise EtcdError(f"etcd {path} at {self.endpoints[k]}: {why}")
            self._first = k
            return msg.get("result", msg) if path in ("/v3/lease/keepalive",) else msg
        raise EtcdUnavailable(f"etcd {path}: no endpoint answered within {timeout_s or self.timeout_s:g}s ("
                              + ("; ".join(errors) or "no time left") + ")")

    # -- leases ------------------------------------------------------------------------------------
    async def grant(self, ttl_s: int, timeout_s: float | None = None) -> tuple[int, int]:
        """A new lease: (its id, the TTL etcd granted, which may be raised to etcd's minimum)."""
        msg = await self._post("/v3/lease/grant", {"TTL": int(ttl_s)}, timeout_s)
        return int(msg["ID"]), int(msg.get("TTL", ttl_s))

    async def keepalive(self, lease: int, timeout_s: float | None = None) -> int:
        """Refresh a lease; its TTL, or 0 when etcd no longer has it (expired or revoked)."""
        msg = await self._post("/v3/lease/keepalive", {"ID": str(lease)}, timeout_s)
        return int(msg.get("TTL", 0))

    async def revoke(self, lease: int, timeout_s: float | None = None) -> None:
        """Drop a lease now, and every key attached to it."""
        try:
            await self._post("/v3/lease/revoke", {"ID": str(lease)}, timeout_s)
        except EtcdError as e:
            if "not found" not in str(e):
                raise

    # -- keys --------------------------------------------------------------------------------------
    async def get(self, key: str, timeout_s: float | None = None) -> tuple[KeyValue | None, int]:
        """The key's value (None: absent) and the store's revision as of the read."""
        msg = await self._post("/v3/kv/range", {"key": _b64(key)}, timeout_s)
        kvs = msg.get("kvs") or []
        return (_kv(kvs[0]) if kvs else None), int(msg.get("header", {}).get("revision", 0))

    async def get_prefix(self, prefix: str, timeout_s: float | None = None) -> list[KeyValue]:
        msg = await self._post("/v3/kv/range", {"key": _b64(prefix), "range_end": _range_end(prefix)}, timeout_s)
        return [_kv(kv) for kv in msg.get("kvs") or []]

    async def put(self, key: str, value: bytes | str, lease: int = 0, timeout_s: float | None = None) -> None:
        body: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
        if lease:
            body["lease"] = str(lease)
        await self._post("/v3/kv/put", body, timeout_s)

    async def delete(self, key: str, timeout_s: float | None = None) -> int:
        msg = await self._post("/v3/kv/deleterange", {"key": _b64(key)}, timeout_s)
        return int(msg.get("deleted", 0))

    async def create(self, key: str, value: bytes | str, lease: int,
                     timeout_s: float | None = None) -> tuple[bool, KeyValue | None]:
        """Put `key` only if it does not exist (one txn on its create revision): (True, None) when
        we created it, else (False, the current holder's key-value)."""
        k = _b64(key)
        msg = await self._post("/v3/kv/txn", {
            "compare": [{"key": k, "target": "CREATE", "create_revision": "0", "result": "EQUAL"}],
            "success": [{"request_put": {"key": k, "value": _b64(value), "lease": str(lease)}}],
            "failure": [{"request_range": {"key": k}}],
        }, timeout_s)
        if msg.get("succeeded"):
            return True, None
        for r in msg.get("responses") or []:
            kvs = (r.get("response_range") or {}).get("kvs") or []
            if kvs:
                return False, _kv(kvs[0])
        return False, None  # it went between the compare and the read: the caller tries again

    async def status(self, timeout_s: float | None = None) -> list[dict[str, Any]]:
        """Each endpoint's state (`/v3/maintenance/status`): version, leader, raft index, db size,
        or the error that endpoint answered with."""
        out = []
        for endpoint in self.endpoints:
            try:
                async with self._http().post(endpoint + "/v3/maintenance/status", json={},
                                             timeout=aiohttp.ClientTimeout(total=timeout_s or self.timeout_s)) as r:
                    msg = _first_json(await r.text())
                header = msg.get("header", {})
                out.append({"endpoint": endpoint, "healthy": r.status == 200 and "error" not in msg,
                            "version": msg.get("version", ""), "db_size": int(msg.get("dbSize", 0)),
                            "leader": msg.get("leader", "") == header.get("member_id", "?"),
                            "raft_term": int(msg.get("raftTerm", 0)), "raft_index": int(msg.get("raftIndex", 0)),
                            "error": "" if r.status == 200 else str(msg.get("error") or msg)[:200]})
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ssl.SSLError) as e:
                out.append({"endpoint": endpoint, "healthy": False, "error": f"{type(e).__name__}: {e}"})
        return out

    # -- watch -------------------------------------------------------------------------------------
    async def watch(self, key: str, start_revision: int, timeout_s: float) -> AsyncIterator[list[WatchEvent]]:
        """Changes of `key` from `start_revision` on, a batch at a time, for at most `timeout_s`
        (then the iteration ends; the caller watches again from the revision it reached)."""
        body = {"create_request": {"key": _b64(key), "start_revision": str(start_revision)}}
        errors = []
        for i in range(len(self.endpoints)):
            endpoint = self.endpoints[(self._first + i) % len(self.endpoints)]
            try:
                async with self._http().post(endpoint + "/v3/watch", json=body,
                                             timeout=aiohttp.ClientTimeout(total=timeout_s,
                                                                           connect=self.timeout_s)) as resp:
                    if resp.status != 200:
                        errors.append(f"{endpoint}: HTTP {resp.status}")
                        continue
                    async for line in resp.content:
                        if not line.strip():
                            continue
                        msg = json.loads(line)
                        if "error" in msg:
                            raise EtcdError(f"etcd watch of {key}: {msg['error']}")
                        result = msg.get("result", {})
                        if result.get("canceled"):
                            raise EtcdError(f"etcd cancelled the watch of {key}: "
                                            f"{result.get('cancel_reason', 'compacted?')}")
                        events = [WatchEvent("delete" if e.get("type") == "DELETE" else "put", _kv(e.get("kv", {})))
                                  for e in result.get("events") or []]
                        if events:
                            yield events
                    return
            except asyncio.TimeoutError:
                return  # its deadline: the caller watches again
            except (aiohttp.ClientError, OSError, ssl.SSLError) as e:
                errors.append(f"{endpoint}: {type(e).__name__}: {e}")
        raise EtcdUnavailable(f"etcd watch of {key}: no endpoint answered ({'; '.join(errors)})")


def _first_json(text: str) -> dict[str, Any]:
    """The first JSON object of a body (a stream's answer is one object per line)."""
    line = text.strip().split("\n", 1)[0] if text else ""
    try:
        msg = json.loads(line) if line else {}
    except json.JSONDecodeError:
        return {"error": f"not JSON: {text[:200]!r}"}
    return msg if isinstance(msg, dict) else {"error": f"unexpected answer {text[:200]!r}"}
