"""Requests that are not the message their method takes get INVALID_ARGUMENT, not UNKNOWN.

grpc.aio runs a method's deserializer inside the call and reports its exception as UNKNOWN
("Unexpected <class DecodeError>"): to a client that reads as a server bug. This interceptor
wraps each handler's deserializer so that bytes which do not parse become a clear
INVALID_ARGUMENT naming the message type, before the handler is entered.
"""

from __future__ import annotations

import logging
from typing import Any

import grpc

log = logging.getLogger(__name__)


class _Undecodable:
    __slots__ = ("error",)

    def __init__(self, error: Exception) -> None:
        self.error = error


def _safe(deserializer):
    def parse(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception as e:  # noqa: BLE001 - protobuf's DecodeError and anything else a parser raises
            return _Undecodable(e)
    return parse


def _message_name(deserializer) -> str:
    owner = getattr(deserializer, "__self__", None)  # Message.FromString is a bound class method
    desc = getattr(owner, "DESCRIPTOR", None)
    return desc.full_name if desc is not None else "request message"


class ParseErrorsAreInvalidArgument(grpc.aio.ServerInterceptor):
    """Wraps unary-request handlers (all of ours) so undecodable bytes are refused as INVALID_ARGUMENT."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        name = _message_name(handler.request_deserializer)
        method = handler_call_details.method

        async def refuse(request: _Undecodable, context) -> None:
            log.info("%s: refused a request that is not a %s (%s)", method, name, request.error)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"the request is not a valid {name}: {request.error}")

        deserialize = _safe(handler.request_deserializer)
        if handler.response_streaming:
            inner = handler.unary_stream

            async def stream(request, context):
                if isinstance(request, _Undecodable):
                    await refuse(request, context)
                async for item in inner(request, context):
                    yield item

            return grpc.unary_stream_rpc_method_handler(stream, request_deserializer=deserialize,
                                                        response_serializer=handler.response_serializer)
        inner_unary = handler.unary_unary

        async def unary(request, context):
            if isinstance(request, _Undecodable):
                await refuse(request, context)
            return await inner_unary(request, context)

        return grpc.unary_unary_rpc_method_handler(unary, request_deserializer=deserialize,
                                                   response_serializer=handler.response_serializer)
