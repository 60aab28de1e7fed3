from mooncaked.proto.mooncake.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SegmentInfo(_message.Message):
    __slots__ = ("name", "owner", "endpoint", "nbytes", "medium")
    NAME_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    name: str
    owner: str
    endpoint: _common_pb2.TransferEndpoint
    nbytes: int
    medium: str
    def __init__(self, name: _Optional[str] = ..., owner: _Optional[str] = ..., endpoint: _Optional[_Union[_common_pb2.TransferEndpoint, _Mapping]] = ..., nbytes: _Optional[int] = ..., medium: _Optional[str] = ...) -> None: ...

class PeerSegments(_message.Message):
    __slots__ = ("owner", "same_host_id", "segments")
    OWNER_FIELD_NUMBER: _ClassVar[int]
    SAME_HOST_ID_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    owner: str
    same_host_id: str
    segments: _containers.RepeatedCompositeFieldContainer[SegmentInfo]
    def __init__(self, owner: _Optional[str] = ..., same_host_id: _Optional[str] = ..., segments: _Optional[_Iterable[_Union[SegmentInfo, _Mapping]]] = ...) -> None: ...
