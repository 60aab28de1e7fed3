"""The store master's fast path on the wire: StoreMaster's unary messages in small frames.

Why not gRPC for these: from Python a unary gRPC call costs ~0.7 ms here, a framed
message on a plain socket ~0.05 ms, and a single put needs two calls. The frames and
the handshake are documented beside `DescribeReply` in protos/mooncake/v1/store.proto;
the messages are the .proto's own, so nothing is described twice. With a cluster secret the
connection first runs mooncaked.transfer.handshake (before HELLO).

Frames are bounded by kind, checked from the header before the body is waited for: a request
is small metadata (MAX_REQUEST_BYTES; a bigger one goes over gRPC instead), a reply may be as
big as a gRPC message (the client asked for it, of a master that proved the secret).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import NamedTuple

from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass

from mooncaked.proto.mooncake.v1 import store_pb2
from mooncaked.store.records import MAX_KEY_BYTES

HELLO = b"MCKSTOR1"
HEADER = struct.Struct("<IBBHII")  # body_len, kind, method_len | status, 0, call_id, timeout_ms | 0
REQUEST, REPLY = 1, 2
MAX_KEYS_PER_REQUEST = 1024
MAX_REQUEST_BYTES = MAX_KEYS_PER_REQUEST * (MAX_KEY_BYTES + 64)
"""The biggest request the fast path takes (~1.1 MB): the messages are key lists and a few numbers
per key (store.proto: PutStartRequest is a key, two numbers, a segment name, a flag), so 1024 keys
at the 1 KiB key maximum, or ~10k keys of the usual 'model/hash' shape: more than a batch of 64
gets, a put chunk or a 128k-token prompt's LongestPrefix. Clients send anything bigger by gRPC."""
MAX_REPLY_BYTES = 64 << 20  # the same cap as gRPC messages (rpc.CHANNEL_OPTIONS)
MAX_BODY_BYTES = MAX_REPLY_BYTES  # the old name: the larger of the two


class FrameError(Exception):
    """The peer does not speak the fast path; the connection is closed."""


class RequestTooBig(Exception):
    """A request over MAX_REQUEST_BYTES: nothing was sent; the caller uses gRPC for it."""


@dataclass(frozen=True, slots=True)
class Method:
    name: str
    request: type[Message]
    reply: type[Message]


def _unary_methods() -> dict[str, Method]:
    service = store_pb2.DESCRIPTOR.services_by_name["StoreMaster"]
    return {m.name: Method(m.name, GetMessageClass(m.input_type), GetMessageClass(m.output_type))
            for m in service.methods if not m.client_streaming and not m.server_streaming}


METHODS = _unary_methods()
"""Every unary StoreMaster method, by name: what the fast path serves."""


def pack_request(call_id: int, method: str, timeout_ms: int, body: bytes) -> bytes:
    name = method.encode("ascii")
    return HEADER.pack(len(name) + len(body), REQUEST, len(name), 0, call_id, timeout_ms) + name + body


def pack_reply(call_id: int, status: int, body: bytes) -> bytes:
    return HEADER.pack(len(body), REPLY, status, 0, call_id, 0) + body


class Frame(NamedTuple):
    """A named tuple, not a dataclass: one is made per call on both ends."""

    kind: int
    tag: int  # request: method name length; reply: status
    call_id: int
    timeout_ms: int
    body: bytes


def frame_bytes(f: Frame) -> int:
    """How many bytes the frame took on the wire."""
    return HEADER.size + len(f.body)


def read_frames(buf: bytes | bytearray, expect: int, most: int = 1 << 62) -> tuple[list[Frame], int]:
    """The whole frames at the start of `buf` (`most` at most) and how many bytes they took;
    FrameError on garbage (a frame over its kind's limit is refused from its header, before its
    body arrives)."""
    frames: list[Frame] = []
    at, end = 0, len(buf)
    limit = MAX_REQUEST_BYTES if expect == REQUEST else MAX_REPLY_BYTES
    while end - at >= HEADER.size and len(frames) < most:
        body_len, kind, tag, _, call_id, timeout_ms = HEADER.unpack_from(buf, at)
        if kind != expect:
            raise FrameError(f"frame kind {kind}, expected {expect}")
        if body_len > limit:
            raise FrameError(f"frame of {body_len} bytes is over the {limit}-byte limit")
        if end - at - HEADER.size < body_len:
            break
        start = at + HEADER.size
        frames.append(Frame(kind, tag, call_id, timeout_ms, bytes(buf[start:start + body_len])))
        at = start + body_len
    return frames, at
