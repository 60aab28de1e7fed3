"""`mooncakectl`: the operator's CLI, talking to the conductor (and the store master) over gRPC.

    mooncakectl status [--json]          the cluster's one screen: conductor, store master, instances
    mooncakectl generate "PROMPT"        stream a completion through the cluster
    mooncakectl drain|undrain INSTANCE   stop / resume routing new work to an instance (name or HOST:PORT)
    mooncakectl store [--json]           the KV pool per segment and tier (the master is found via the conductor)

The conductor is found at --conductor (env MOONCAKED_CONDUCTOR, default 127.0.0.1:50051); with
conductors side by side list them, --conductor A,B: each command goes to the first that answers
(drain and undrain to every one that answers, so none keeps an instance drained that another
freed). On a secured cluster give the same files as the daemons: --tls-cert/--tls-key/--tls-ca and
--cluster-token-file (env MOONCAKED_TLS_CERT, ...), and --api-key for `generate` when one is set.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import sys
import threading
import time
from typing import Any, NoReturn

import grpc

from mooncaked.proto.mooncake.v1 import common_pb2, conductor_pb2, conductor_pb2_grpc, store_pb2, store_pb2_grpc
from mooncaked.security import Security
from mooncaked.startup import StartupError

TIMEOUT_S = 10.0
CONNECT_CHECK_S = 1.0  # after an UNAVAILABLE: is the peer down, or did it answer UNAVAILABLE itself?
CONNECT_S = 3.0  # with several conductors listed: how long one that is not the last gets to connect
DEFAULT_CONDUCTOR = "127.0.0.1:50051"
_STATES = {common_pb2.INSTANCE_STATE_STARTING: "starting", common_pb2.INSTANCE_STATE_SERVING: "serving",
           common_pb2.INSTANCE_STATE_DRAINING: "draining", common_pb2.INSTANCE_STATE_DEAD: "dead"}
_ROLES = {common_pb2.ROLE_PREFILL: "prefill", common_pb2.ROLE_DECODE: "decode",
          common_pb2.ROLE_CONDUCTOR: "conductor", common_pb2.ROLE_STORE: "store"}


class CtlError(Exception):
    """Ends the command with one line on stderr and exit status 1."""


class _Parser(argparse.ArgumentParser):
    """An unknown flag or a missing argument is one line and a hint, not the whole usage."""

    def error(self, message: str) -> NoReturn:
        hint = ""
        if message.startswith("unrecognized arguments:"):
            known = [o for a in self._actions for o in a.option_strings]
            for sub in self._subparsers._group_actions if self._subparsers else []:
                for p in getattr(sub, "choices", {}).values():
                    known += [o for a in p._actions for o in a.option_strings]
            for word in message.split(":", 1)[1].split():
                close = difflib.get_close_matches(word.split("=")[0], known, n=1)
                if close:
                    hint = f"; did you mean {close[0]}?"
                    break
        print(f"{self.prog}: error: {message}{hint} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(2)


# -- talking to the daemons ---------------------------------------------------------------------

def _down(channel: grpc.Channel, e: grpc.RpcError) -> bool:
    """True when nothing answered (as opposed to a peer that answered UNAVAILABLE itself)."""
    if "failed to connect" in (e.details() or ""):
        return True
    try:
        grpc.channel_ready_future(channel).result(timeout=CONNECT_CHECK_S)
        return False
    except grpc.FutureTimeoutError:
        return True


def _tls_failed(e: grpc.RpcError) -> bool:
    details = (e.details() or "").lower()
    return e.code() == grpc.StatusCode.UNAVAILABLE and any(w in details for w in ("ssl", "handshake", "certificate",
                                                                                  "tls"))


class _NoAnswer(CtlError):
    """The conductor did not serve the call (down, TLS refused, not answering, shutting down): with
    several listed, the next one is asked."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


def _conductor_error(e: grpc.RpcError, channel: grpc.Channel, address: str, timeout: float) -> CtlError:
    if _tls_failed(e):
        return _NoAnswer(f"TLS with the conductor at {address} failed ({e.details()}): give --tls-cert, --tls-key "
                         "and --tls-ca signed by the cluster's CA (or MOONCAKED_TLS_CERT, ...)", "TLS failed")
    if e.code() == grpc.StatusCode.UNAVAILABLE and _down(channel, e):
        return _NoAnswer(f"no conductor answers at {address} (is mooncaked running? point --conductor HOST:PORT "
                         "or MOONCAKED_CONDUCTOR at its gRPC address)", "no answer")
    if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
        return _NoAnswer(f"the conductor at {address} did not answer within {timeout:g}s",
                         f"no answer within {timeout:g}s")
    if e.code() == grpc.StatusCode.UNAVAILABLE:
        return _NoAnswer(f"UNAVAILABLE: {e.details()}", f"UNAVAILABLE: {e.details()}")
    return CtlError(f"{e.code().name}: {e.details()}")


def _connects(channel: grpc.Channel, timeout_s: float) -> bool:
    """Whether the channel gets a connection within ``timeout_s``; False at once when the attempt fails
    (a refused port), where a call would wait its whole deadline on a host that does not answer."""
    done = threading.Event()
    ready = []

    def seen(state: grpc.ChannelConnectivity) -> None:
        if state in (grpc.ChannelConnectivity.READY, grpc.ChannelConnectivity.TRANSIENT_FAILURE,
                     grpc.ChannelConnectivity.SHUTDOWN):
            ready.append(state == grpc.ChannelConnectivity.READY)
            done.set()

    channel.subscribe(seen, try_to_connect=True)
    try:
        done.wait(timeout_s)
        return bool(ready and ready[0])
    finally:
        channel.unsubscribe(seen)


class Conductor:
    """A channel to the conductor whose failures become one-line CtlErrors."""

    def __init__(self, address: str, security: Security | None = None) -> None:
        self.address = address
        self.channel = (security or Security()).sync_channel(address)
        self.stub = conductor_pb2_grpc.ConductorStub(self.channel)

    def call(self, method: str, request: Any, timeout: float = TIMEOUT_S) -> Any:
        try:
            return getattr(self.stub, method)(request, timeout=timeout)
        except grpc.RpcError as e:
            raise _conductor_error(e, self.channel, self.address, timeout) from None

    def close(self) -> None:
        self.channel.close()


def conductor_addresses(text: str) -> list[str]:
    """--conductor A,B: the addresses in order."""
    out = [a.strip() for a in text.split(",")]
    if not all(out):
        raise CtlError(f"--conductor {text!r} has an empty entry: give HOST:PORT[,HOST:PORT...]")
    return out


def ask_conductors(addresses: list[str], security: Security | None, ask: Any) -> Any:
    """``ask(conductor)`` on the first conductor listed that answers. One that does not (down, not
    connecting within CONNECT_S, TLS refused, no answer in time) passes the command to the next; an
    answer, an error included, is final. With none answering, one line names each and why."""
    missed: list[_NoAnswer] = []
    for n, address in enumerate(addresses):
        try:
            return _ask_one(address, security, ask, connect_first=n < len(addresses) - 1)
        except _NoAnswer as e:
            missed.append(e)
    raise _none_answers(addresses, missed)


def _ask_one(address: str, security: Security | None, ask: Any, connect_first: bool) -> Any:
    conductor = Conductor(address, security)
    try:
        if connect_first and not _connects(conductor.channel, CONNECT_S):
            raise _NoAnswer(f"no conductor answers at {address} (no connection within {CONNECT_S:g}s)",
                            "no connection")
        return ask(conductor)
    finally:
        conductor.close()


def _none_answers(addresses: list[str], missed: list[_NoAnswer]) -> CtlError:
    if len(missed) == 1:
        return missed[0]
    return CtlError("no conductor of " + ", ".join(f"{a} ({e.reason})" for a, e in zip(addresses, missed)) +
                    " answers (is mooncaked running? point --conductor HOST:PORT[,HOST:PORT...] or "
                    "MOONCAKED_CONDUCTOR at their gRPC addresses)")


# -- status --------------------------------------------------------------------------------------

def _uptime(s: float) -> str:
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def _mib(n: int) -> str:
    """Bytes for people: 2.0KiB, 256.0MiB, 1.5GiB."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return f"{n}B"


def _fields(msg: Any) -> dict[str, Any]:
    """A message's scalar fields as plain numbers (MessageToDict would turn uint64 into strings)."""
    values = {f.name: getattr(msg, f.name) for f in msg.DESCRIPTOR.fields}
    return {k: v for k, v in values.items() if isinstance(v, (bool, int, float, str))}


def _hit_rate(hits: int, misses: int) -> float:
    return hits / (hits + misses) if hits + misses else 0.0


def status_dict(reply: conductor_pb2.StatusReply) -> dict[str, Any]:
    """The screen as JSON: every count a JSON number, enums by their short names."""
    c = reply.conductor
    out: dict[str, Any] = {
        "model_id": reply.model_id,
        "conductor": {
            "address": c.address, "http_address": c.http_address, "state": c.state, "policy": c.policy,
            "ttft_slo_s": c.ttft_slo_s or None, "tbt_slo_s": c.tbt_slo_s or None,
            "uptime_s": reply.uptime_s, "requests_in_flight": c.requests_in_flight, "rejections": c.rejections,
            "ready_timeout_s": c.ready_timeout_s,
        },
        "store": None,
        "instances": [
            {"name": i.name, "role": _ROLES.get(i.role, "?"), "address": i.address,
             "state": _STATES.get(i.state, "?"), "model_id": i.model_id, "uptime_s": i.uptime_s,
             "last_heartbeat_age_s": i.last_heartbeat_age_s, "load": _fields(i.load),
             "pipeline": ({"group": i.pipeline.group, "stage": i.pipeline.stage, "stages": i.pipeline.stages}
                          if i.HasField("pipeline") else None),
             "lent_to": i.lent_to or None}
            for i in reply.instances
        ],
        "groups": _groups(reply),
    }
    if reply.HasField("store"):
        s = reply.store
        store: dict[str, Any] = {"address": s.address, "reachable": s.reachable}
        if s.reachable:
            store.update(_fields(s))
            del store["error"]
            store["tiers"] = [_fields(t) for t in s.tiers]
            store["hit_rate"] = _hit_rate(s.hits, s.misses)
        else:
            store["error"] = s.error
        out["store"] = store
    return out


def _slos(c: conductor_pb2.ConductorInfo) -> str:
    parts = [f"{name} {v:g}s" for name, v in (("TTFT", c.ttft_slo_s), ("TBT", c.tbt_slo_s)) if v]
    return "SLOs " + (", ".join(parts) if parts else "off")


def status_lines(reply: conductor_pb2.StatusReply) -> list[str]:
    c = reply.conductor
    lines = [f"conductor  {c.address or '?'} (HTTP {c.http_address or '?'}): {c.state or '?'}, policy {c.policy}, "
             f"{_slos(c)}, up {_uptime(reply.uptime_s)}, {c.requests_in_flight} in flight, "
             f"{c.rejections} rejected, model {reply.model_id}"]
    if not reply.HasField("store"):
        lines.append("store      none (the conductor follows no KV pool)")
    elif not reply.store.reachable:
        lines.append(f"store      {reply.store.address}: unreachable ({reply.store.error})")
    else:
        s = reply.store
        tiers = ", ".join(f"{t.medium.upper()} {_mib(t.used)}/{_mib(t.capacity)} "
                          f"({t.used / t.capacity if t.capacity else 0:.1%})" for t in s.tiers) or "no segments"
        lines.append(f"store      {s.address}: epoch {s.epoch}, {s.segments} segments, {s.objects} objects, "
                     f"{tiers}, hit rate {_hit_rate(s.hits, s.misses):.1%} ({s.hits}/{s.hits + s.misses}), "
                     f"{s.evictions} evictions")
    for name, g in sorted(_groups(reply).items()):
        stages = ", ".join(f"{k}: {m or 'missing'}" for k, m in enumerate(g["stages"]))
        lines.append(f"group      {name}: {'complete' if g['complete'] else 'INCOMPLETE (gets no work)'}, "
                     f"{len(g['stages'])} stages ({stages})")
    lines.append(f"instances  {len(reply.instances)}")
    lines.append(f"{'NAME':<30} {'ROLE':<8} {'ADDRESS':<22} {'STATE':<9} {'RUN':>4} {'WAIT':>4} {'QUEUED':>7} "
                 f"{'KV USE':>7} {'HIT':>6} {'UPTIME':>7}")
    for i in reply.instances:
        ld = i.load
        kv = 1 - ld.free_kv_blocks / ld.total_kv_blocks if ld.total_kv_blocks else 0.0
        hit = ld.prefix_hit_blocks / ld.prefix_query_blocks if ld.prefix_query_blocks else 0.0
        lines.append(f"{i.name:<30} {_ROLES.get(i.role, '?'):<8} {i.address:<22} {_STATES.get(i.state, '?'):<9} "
                     f"{ld.running_requests:>4} {ld.waiting_requests:>4} {ld.queued_prefill_tokens:>7} "
                     f"{kv:>6.1%} {hit:>6.1%} {_uptime(i.uptime_s):>7}"
                     + (f"  lent to {i.lent_to[:12]}" if i.lent_to else ""))
    return lines


def _groups(reply: conductor_pb2.StatusReply) -> dict[str, dict[str, Any]]:
    """CPP prefill groups: each stage's instance (None where none is registered) and whether all serve."""
    out: dict[str, dict[str, Any]] = {}
    for i in reply.instances:
        if not i.HasField("pipeline"):
            continue
        p = i.pipeline
        g = out.setdefault(p.group, {"stages": [None] * p.stages, "serving": set()})
        if p.stage < len(g["stages"]):
            g["stages"][p.stage] = i.name
            if _STATES.get(i.state) == "serving":
                g["serving"].add(p.stage)
    for g in out.values():
        g["complete"] = len(g.pop("serving")) == len(g["stages"])
    return out


def cmd_status(conductor: Conductor, args) -> int:
    reply = conductor.call("Status", conductor_pb2.StatusRequest())
    if args.json:
        print(json.dumps(status_dict(reply)))
    else:
        print("\n".join(status_lines(reply)))
    return 0


# -- generate, drain -----------------------------------------------------------------------------

def cmd_generate(conductor: Conductor, args) -> int:
    sampling = common_pb2.SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    req = conductor_pb2.GenerateRequest(prompt=args.prompt, raw=args.raw, sampling=sampling)
    metadata = [("authorization", f"Bearer {args.api_key}")] if args.api_key else None
    start = time.perf_counter()
    first = None
    n = 0
    try:
        for chunk in conductor.stub.Generate(req, timeout=args.timeout, metadata=metadata):
            first = first if first is not None else time.perf_counter() - start
            n += len(chunk.token_ids)
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
            if chunk.finish_reason:
                sys.stdout.write("\n")
                print(f"[{n} tokens, first after {first:.2f}s, finish={chunk.finish_reason}]", file=sys.stderr)
    except grpc.RpcError as e:
        error = _conductor_error(e, conductor.channel, conductor.address, args.timeout)
        if first is not None:  # tokens are out: final, no other conductor may start the answer again
            raise CtlError(str(error)) from None
        raise error from None
    return 0


def cmd_drain(addresses: list[str], security: Security | None, args, drain: bool) -> int:
    """Every conductor listed is told (each remembers an operator's drain across the instance's restarts,
    so one left out would keep routing there, or keep it drained after an undrain); the first answer is
    printed and an error in it is final; conductors that are not reached are named on stderr."""
    request = conductor_pb2.SetDrainRequest(name=args.instance, drain=drain)
    reply, missed, untold = None, [], []
    for address in addresses:
        try:
            got = _ask_one(address, security, lambda c: c.call("SetDrain", request), connect_first=len(addresses) > 1)
        except _NoAnswer as e:
            missed.append(e)
            untold.append(f"{address} ({e.reason})")
            continue
        except CtlError as e:
            if reply is None:
                raise
            untold.append(f"{address} ({e})")
            continue
        reply = reply or got
    if reply is None:
        raise _none_answers(addresses, missed)
    print(f"{reply.name or args.instance}: {_STATES.get(reply.state, '?')}")
    if untold:
        print(f"mooncakectl: not told: {'; '.join(untold)}", file=sys.stderr)
    return 0


# -- store ---------------------------------------------------------------------------------------

def _store_address(args) -> str:
    """--store / MOONCAKED_STORE, else the store master the conductor follows."""
    if args.store:
        return args.store
    try:
        reply = ask_conductors(conductor_addresses(args.conductor), args.security,
                               lambda c: c.call("Status", conductor_pb2.StatusRequest(without_pool_stats=True)))
    except CtlError as e:
        raise CtlError(f"{e} — or give the store master itself with --store HOST:PORT (or MOONCAKED_STORE)") from None
    if not reply.HasField("store"):
        raise CtlError(f"the conductor at {args.conductor} follows no store master; give one with --store HOST:PORT "
                       "(or MOONCAKED_STORE)")
    return reply.store.address


def store_dict(reply: store_pb2.PoolStatsReply) -> dict[str, Any]:
    return {**_fields(reply), "hit_rate": _hit_rate(reply.hits, reply.misses),
            "segments": [_fields(s) for s in reply.segments]}


def _masters(target: str, security: Security) -> dict[str, Any]:
    """Who leads and who stands by (store/master_link.survey): etcd's leader key, or each master's word."""
    import asyncio

    from mooncaked.config import ConfigError, parse_store
    from mooncaked.store.master_link import survey

    try:
        parse_store(target)
    except (ValueError, ConfigError) as e:
        raise CtlError(f"--store {target!r}: {e}") from None
    return asyncio.run(survey(target, security))


def _master_line(m: dict[str, Any]) -> str:
    if m.get("error"):
        return f"{m.get('name') or '?'} at {m['address']}: unreachable ({m['error']})"
    if m["role"] != "leader":
        return f"{m.get('name') or '?'} at {m['address']} ({m['role']})"
    state = "writes fenced: etcd lease unconfirmed" if not m.get("writable") else "writable"
    return f"{m.get('name') or '?'} at {m['address']} (epoch {m.get('epoch', 0)}, {state})"


def store_ha_lines(view: dict[str, Any]) -> list[str]:
    """The leader, the standbys and etcd, for a store under HA (nothing for a single master)."""
    if view["mode"] == "single" and not view["standbys"] and (view["leader"] or {}).get("role") == "single":
        return []
    lines = [f"leader     {_master_line(view['leader']) if view['leader'] else 'none (an election is under way?)'}"]
    lines += [f"standby    {_master_line(m)}" for m in view["standbys"]] or ["standby    none"]
    for e in view.get("etcd") or []:
        lines.append(f"etcd       {e['endpoint']}: " + (f"healthy, v{e['version']}{', raft leader' if e['leader'] else ''}, "
                                                         f"term {e['raft_term']}, index {e['raft_index']}, "
                                                         f"db {_mib(e['db_size'])}" if e["healthy"]
                                                         else f"unhealthy ({e['error']})"))
    if view.get("error"):
        lines.append(f"etcd       {view['error']}")
    return lines


def cmd_store(args) -> int:
    target = _store_address(args)
    view = _masters(target, args.security)
    leader = view["leader"]
    if leader is None and view["mode"] == "single":  # it did not answer: PoolStats says why, below
        leader = {"address": target}
    if leader is None:
        lines = store_ha_lines(view)
        if args.json:
            print(json.dumps({"ha": view}))
        else:
            print("\n".join(lines))
        raise CtlError(f"no store master leads at {target} now")
    address = leader["address"]
    with args.security.sync_channel(address) as channel:
        try:
            reply = store_pb2_grpc.StoreMasterStub(channel).PoolStats(store_pb2.PoolStatsRequest(),
                                                                      timeout=TIMEOUT_S)
        except grpc.RpcError as e:
            if _tls_failed(e):
                raise CtlError(f"TLS with the store master at {address} failed ({e.details()}): give --tls-cert, "
                               "--tls-key and --tls-ca signed by the cluster's CA") from None
            if e.code() == grpc.StatusCode.UNAVAILABLE and _down(channel, e):
                raise CtlError(f"no store master answers at {address} (is it running? point --store HOST:PORT "
                               "or MOONCAKED_STORE at it)") from None
            raise CtlError(f"store master {address}: {e.code().name}: {e.details()}") from None
    if args.json:
        print(json.dumps({**store_dict(reply), "ha": view}))
        return 0
    lookups = reply.hits + reply.misses
    print(f"store master {address}: epoch {reply.master_epoch}, {reply.objects} objects, hit rate "
          f"{_hit_rate(reply.hits, reply.misses):.1%} ({reply.hits}/{lookups}), {reply.evictions} evictions, "
          f"{reply.demotions} demotions, {reply.promotions} promotions")
    for line in store_ha_lines(view):
        print(line)
    print(f"{'SEGMENT':<40} {'OWNER':<30} {'TIER':<6} {'USED':>10} {'CAPACITY':>10} {'USE':>6} {'OBJECTS':>8}")
    for seg in reply.segments:
        use = seg.used / seg.capacity if seg.capacity else 0.0
        print(f"{seg.name:<40} {seg.owner:<30} {seg.medium:<6} {_mib(seg.used):>10} {_mib(seg.capacity):>10} "
              f"{use:>6.1%} {seg.objects:>8}")
    return 0


# -- the command line ----------------------------------------------------------------------------

def make_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="mooncakectl", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--conductor", metavar="HOST:PORT[,...]",
                   default=os.environ.get("MOONCAKED_CONDUCTOR") or DEFAULT_CONDUCTOR,
                   help="the conductor's gRPC address; conductors side by side as a comma list, asked in order "
                        "(default: $MOONCAKED_CONDUCTOR, else %s)" % DEFAULT_CONDUCTOR)
    p.add_argument("--store", metavar="HOST:PORT", default=os.environ.get("MOONCAKED_STORE") or None,
                   help="the store master's gRPC address, for `store`; masters under HA: etcd://ETCD:PORT[,...] "
                        "or MASTER:PORT,MASTER:PORT (default: $MOONCAKED_STORE, else the one the conductor follows)")
    for flag, what in (("tls-cert", "PEM certificate signed by the cluster's CA (mutual TLS)"),
                       ("tls-key", "PEM private key of --tls-cert"),
                       ("tls-ca", "PEM certificate of the cluster's CA"),
                       ("cluster-token-file", "file holding the cluster secret (drain, undrain, store)"),
                       ("api-key", "bearer token of the API, for `generate` when the conductor sets --api-key")):
        env = "MOONCAKED_" + flag.upper().replace("-", "_")
        p.add_argument(f"--{flag}", metavar="KEY" if flag == "api-key" else "FILE",
                       default=os.environ.get(env) or None, help=f"{what} (default: ${env}, else none)")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    st = sub.add_parser("status", help="the cluster's one screen: conductor, store master and pool use, instances")
    st.add_argument("--json", action="store_true", help="one JSON object, counts as numbers (default: a table)")
    g = sub.add_parser("generate", help="stream a completion for a prompt through the cluster")
    g.add_argument("prompt", help="the user message (the model's chat template is applied unless --raw)")
    g.add_argument("--raw", action="store_true", help="plain completion of the text, no chat template "
                                                      "(default: chat)")
    g.add_argument("--max-tokens", type=int, default=128, metavar="N", help="most tokens to generate (default 128)")
    g.add_argument("--temperature", type=float, default=0.0, metavar="T",
                   help="sampling temperature, 0 = greedy (default 0)")
    g.add_argument("--timeout", type=float, default=600.0, metavar="S",
                   help="give up after this many seconds (default 600)")
    s = sub.add_parser("store", help="the KV pool per segment and tier: use, objects, hit rate, evictions")
    s.add_argument("--json", action="store_true", help="one JSON object, counts as numbers (default: a table)")
    for name, what in (("drain", "stop routing new work to an instance (running work finishes)"),
                       ("undrain", "route new work to a drained instance again")):
        d = sub.add_parser(name, help=what)
        d.add_argument("instance", metavar="INSTANCE", help="the instance's name or its HOST:PORT, as `status` shows")
    return p


def run(args) -> int:
    try:
        args.security = Security.load(args.tls_cert, args.tls_key, args.tls_ca, args.cluster_token_file)
    except StartupError as e:
        raise CtlError(str(e)) from None
    if args.command == "store":
        return cmd_store(args)
    addresses = conductor_addresses(args.conductor)
    if args.command in ("drain", "undrain"):
        return cmd_drain(addresses, args.security, args, args.command == "drain")
    command = cmd_status if args.command == "status" else cmd_generate
    return ask_conductors(addresses, args.security, lambda conductor: command(conductor, args))


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    try:
        code = run(args)
        sys.stdout.flush()  # inside the try: a reader that left (`| head -1`) is seen here
        return code
    except CtlError as e:
        print(f"mooncakectl: {e}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        # the reader closed the pipe: stop quietly, as Unix tools do (status 128 + SIGPIPE); point
        # stdout at /dev/null so the interpreter's last flush does not complain either
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
