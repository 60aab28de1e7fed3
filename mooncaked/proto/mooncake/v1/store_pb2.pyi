from mooncaked.proto.mooncake.v1 import common_pb2 as _common_pb2
from mooncaked.proto.mooncake.v1 import transfer_pb2 as _transfer_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DescribeRequest(_message.Message):
    __slots__ = ("any_role",)
    ANY_ROLE_FIELD_NUMBER: _ClassVar[int]
    any_role: bool
    def __init__(self, any_role: _Optional[bool] = ...) -> None: ...

class DescribeReply(_message.Message):
    __slots__ = ("fast_path_port", "master_epoch", "fast_path_unix", "host_id", "role", "leader", "name", "writable")
    FAST_PATH_PORT_FIELD_NUMBER: _ClassVar[int]
    MASTER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    FAST_PATH_UNIX_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    LEADER_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    WRITABLE_FIELD_NUMBER: _ClassVar[int]
    fast_path_port: int
    master_epoch: int
    fast_path_unix: str
    host_id: str
    role: str
    leader: str
    name: str
    writable: bool
    def __init__(self, fast_path_port: _Optional[int] = ..., master_epoch: _Optional[int] = ..., fast_path_unix: _Optional[str] = ..., host_id: _Optional[str] = ..., role: _Optional[str] = ..., leader: _Optional[str] = ..., name: _Optional[str] = ..., writable: _Optional[bool] = ...) -> None: ...

class Replica(_message.Message):
    __slots__ = ("segment", "offset", "size", "endpoint", "medium")
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    segment: str
    offset: int
    size: int
    endpoint: _common_pb2.TransferEndpoint
    medium: str
    def __init__(self, segment: _Optional[str] = ..., offset: _Optional[int] = ..., size: _Optional[int] = ..., endpoint: _Optional[_Union[_common_pb2.TransferEndpoint, _Mapping]] = ..., medium: _Optional[str] = ...) -> None: ...

class ObjectReplicas(_message.Message):
    __slots__ = ("key", "replicas", "checksum", "size")
    KEY_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    key: str
    replicas: _containers.RepeatedCompositeFieldContainer[Replica]
    checksum: int
    size: int
    def __init__(self, key: _Optional[str] = ..., replicas: _Optional[_Iterable[_Union[Replica, _Mapping]]] = ..., checksum: _Optional[int] = ..., size: _Optional[int] = ...) -> None: ...

class ObjectRecord(_message.Message):
    __slots__ = ("key", "offset", "size", "checksum")
    KEY_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    key: str
    offset: int
    size: int
    checksum: int
    def __init__(self, key: _Optional[str] = ..., offset: _Optional[int] = ..., size: _Optional[int] = ..., checksum: _Optional[int] = ...) -> None: ...

class MountSegmentRequest(_message.Message):
    __slots__ = ("client_id", "segment")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    segment: _transfer_pb2.SegmentInfo
    def __init__(self, client_id: _Optional[str] = ..., segment: _Optional[_Union[_transfer_pb2.SegmentInfo, _Mapping]] = ...) -> None: ...

class MountSegmentReply(_message.Message):
    __slots__ = ("ok", "master_epoch")
    OK_FIELD_NUMBER: _ClassVar[int]
    MASTER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    master_epoch: int
    def __init__(self, ok: _Optional[bool] = ..., master_epoch: _Optional[int] = ...) -> None: ...

class UnmountSegmentRequest(_message.Message):
    __slots__ = ("client_id", "segment")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    segment: str
    def __init__(self, client_id: _Optional[str] = ..., segment: _Optional[str] = ...) -> None: ...

class UnmountSegmentReply(_message.Message):
    __slots__ = ("objects_removed",)
    OBJECTS_REMOVED_FIELD_NUMBER: _ClassVar[int]
    objects_removed: int
    def __init__(self, objects_removed: _Optional[int] = ...) -> None: ...

class EvacuateSegmentRequest(_message.Message):
    __slots__ = ("client_id", "segment")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    segment: str
    def __init__(self, client_id: _Optional[str] = ..., segment: _Optional[str] = ...) -> None: ...

class EvacuateSegmentReply(_message.Message):
    __slots__ = ("demotions", "left")
    DEMOTIONS_FIELD_NUMBER: _ClassVar[int]
    LEFT_FIELD_NUMBER: _ClassVar[int]
    demotions: int
    left: int
    def __init__(self, demotions: _Optional[int] = ..., left: _Optional[int] = ...) -> None: ...

class ReportWritesRequest(_message.Message):
    __slots__ = ("client_id", "segment", "objects")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    OBJECTS_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    segment: str
    objects: _containers.RepeatedCompositeFieldContainer[ObjectRecord]
    def __init__(self, client_id: _Optional[str] = ..., segment: _Optional[str] = ..., objects: _Optional[_Iterable[_Union[ObjectRecord, _Mapping]]] = ...) -> None: ...

class ReportWritesReply(_message.Message):
    __slots__ = ("objects_accepted", "rejected_keys", "segment_mounted")
    OBJECTS_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REJECTED_KEYS_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_MOUNTED_FIELD_NUMBER: _ClassVar[int]
    objects_accepted: int
    rejected_keys: _containers.RepeatedScalarFieldContainer[str]
    segment_mounted: bool
    def __init__(self, objects_accepted: _Optional[int] = ..., rejected_keys: _Optional[_Iterable[str]] = ..., segment_mounted: _Optional[bool] = ...) -> None: ...

class RemountSegmentRequest(_message.Message):
    __slots__ = ("client_id", "segment", "objects")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    OBJECTS_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    segment: _transfer_pb2.SegmentInfo
    objects: _containers.RepeatedCompositeFieldContainer[ObjectRecord]
    def __init__(self, client_id: _Optional[str] = ..., segment: _Optional[_Union[_transfer_pb2.SegmentInfo, _Mapping]] = ..., objects: _Optional[_Iterable[_Union[ObjectRecord, _Mapping]]] = ...) -> None: ...

class RemountSegmentReply(_message.Message):
    __slots__ = ("objects_accepted", "master_epoch", "rejected_keys")
    OBJECTS_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    MASTER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    REJECTED_KEYS_FIELD_NUMBER: _ClassVar[int]
    objects_accepted: int
    master_epoch: int
    rejected_keys: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, objects_accepted: _Optional[int] = ..., master_epoch: _Optional[int] = ..., rejected_keys: _Optional[_Iterable[str]] = ...) -> None: ...

class PutStartRequest(_message.Message):
    __slots__ = ("key", "size", "checksum", "replicas", "preferred_segment", "soft_pin", "client_id")
    KEY_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    PREFERRED_SEGMENT_FIELD_NUMBER: _ClassVar[int]
    SOFT_PIN_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    key: str
    size: int
    checksum: int
    replicas: int
    preferred_segment: str
    soft_pin: bool
    client_id: str
    def __init__(self, key: _Optional[str] = ..., size: _Optional[int] = ..., checksum: _Optional[int] = ..., replicas: _Optional[int] = ..., preferred_segment: _Optional[str] = ..., soft_pin: _Optional[bool] = ..., client_id: _Optional[str] = ...) -> None: ...

class PutStartReply(_message.Message):
    __slots__ = ("replicas", "exists")
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    EXISTS_FIELD_NUMBER: _ClassVar[int]
    replicas: _containers.RepeatedCompositeFieldContainer[Replica]
    exists: bool
    def __init__(self, replicas: _Optional[_Iterable[_Union[Replica, _Mapping]]] = ..., exists: _Optional[bool] = ...) -> None: ...

class PutEndRequest(_message.Message):
    __slots__ = ("key", "checksum")
    KEY_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    key: str
    checksum: int
    def __init__(self, key: _Optional[str] = ..., checksum: _Optional[int] = ...) -> None: ...

class PutEndReply(_message.Message):
    __slots__ = ("ok",)
    OK_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    def __init__(self, ok: _Optional[bool] = ...) -> None: ...

class PutRevokeRequest(_message.Message):
    __slots__ = ("key",)
    KEY_FIELD_NUMBER: _ClassVar[int]
    key: str
    def __init__(self, key: _Optional[str] = ...) -> None: ...

class PutRevokeReply(_message.Message):
    __slots__ = ("ok",)
    OK_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    def __init__(self, ok: _Optional[bool] = ...) -> None: ...

class BatchPutStartRequest(_message.Message):
    __slots__ = ("items", "client_id")
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[PutStartRequest]
    client_id: str
    def __init__(self, items: _Optional[_Iterable[_Union[PutStartRequest, _Mapping]]] = ..., client_id: _Optional[str] = ...) -> None: ...

class BatchPutStartReply(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[PutStartReply]
    def __init__(self, items: _Optional[_Iterable[_Union[PutStartReply, _Mapping]]] = ...) -> None: ...

class BatchPutEndRequest(_message.Message):
    __slots__ = ("keys", "revoke_keys", "checksums", "reserved", "revoke_reservations")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    REVOKE_KEYS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    RESERVED_FIELD_NUMBER: _ClassVar[int]
    REVOKE_RESERVATIONS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    revoke_keys: _containers.RepeatedScalarFieldContainer[str]
    checksums: _containers.RepeatedScalarFieldContainer[int]
    reserved: _containers.RepeatedCompositeFieldContainer[ReservedPut]
    revoke_reservations: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, keys: _Optional[_Iterable[str]] = ..., revoke_keys: _Optional[_Iterable[str]] = ..., checksums: _Optional[_Iterable[int]] = ..., reserved: _Optional[_Iterable[_Union[ReservedPut, _Mapping]]] = ..., revoke_reservations: _Optional[_Iterable[int]] = ...) -> None: ...

class ReservedPut(_message.Message):
    __slots__ = ("reservation", "key", "checksum", "soft_pin")
    RESERVATION_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    SOFT_PIN_FIELD_NUMBER: _ClassVar[int]
    reservation: int
    key: str
    checksum: int
    soft_pin: bool
    def __init__(self, reservation: _Optional[int] = ..., key: _Optional[str] = ..., checksum: _Optional[int] = ..., soft_pin: _Optional[bool] = ...) -> None: ...

class ReservePlacesRequest(_message.Message):
    __slots__ = ("client_id", "size", "count", "replicas", "preferred_segment", "first_for_a_put")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    PREFERRED_SEGMENT_FIELD_NUMBER: _ClassVar[int]
    FIRST_FOR_A_PUT_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    size: int
    count: int
    replicas: int
    preferred_segment: str
    first_for_a_put: bool
    def __init__(self, client_id: _Optional[str] = ..., size: _Optional[int] = ..., count: _Optional[int] = ..., replicas: _Optional[int] = ..., preferred_segment: _Optional[str] = ..., first_for_a_put: _Optional[bool] = ...) -> None: ...

class Reservation(_message.Message):
    __slots__ = ("id", "replicas")
    ID_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    id: int
    replicas: _containers.RepeatedCompositeFieldContainer[Replica]
    def __init__(self, id: _Optional[int] = ..., replicas: _Optional[_Iterable[_Union[Replica, _Mapping]]] = ...) -> None: ...

class ReservePlacesReply(_message.Message):
    __slots__ = ("reservations", "timeout_s", "master_epoch")
    RESERVATIONS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    MASTER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    reservations: _containers.RepeatedCompositeFieldContainer[Reservation]
    timeout_s: float
    master_epoch: int
    def __init__(self, reservations: _Optional[_Iterable[_Union[Reservation, _Mapping]]] = ..., timeout_s: _Optional[float] = ..., master_epoch: _Optional[int] = ...) -> None: ...

class BatchPutEndReply(_message.Message):
    __slots__ = ("committed", "revoked", "reserved_ok")
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    REVOKED_FIELD_NUMBER: _ClassVar[int]
    RESERVED_OK_FIELD_NUMBER: _ClassVar[int]
    committed: int
    revoked: int
    reserved_ok: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, committed: _Optional[int] = ..., revoked: _Optional[int] = ..., reserved_ok: _Optional[_Iterable[bool]] = ...) -> None: ...

class GetReplicasRequest(_message.Message):
    __slots__ = ("key", "client_id")
    KEY_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    key: str
    client_id: str
    def __init__(self, key: _Optional[str] = ..., client_id: _Optional[str] = ...) -> None: ...

class GetReplicasReply(_message.Message):
    __slots__ = ("object", "lease_s")
    OBJECT_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    object: ObjectReplicas
    lease_s: float
    def __init__(self, object: _Optional[_Union[ObjectReplicas, _Mapping]] = ..., lease_s: _Optional[float] = ...) -> None: ...

class BatchGetReplicasRequest(_message.Message):
    __slots__ = ("keys", "client_id", "release_lease", "release_keys")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    RELEASE_LEASE_FIELD_NUMBER: _ClassVar[int]
    RELEASE_KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    client_id: str
    release_lease: int
    release_keys: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, keys: _Optional[_Iterable[str]] = ..., client_id: _Optional[str] = ..., release_lease: _Optional[int] = ..., release_keys: _Optional[_Iterable[str]] = ...) -> None: ...

class BatchGetReplicasReply(_message.Message):
    __slots__ = ("objects", "lease_s", "lease_id", "later_keys")
    OBJECTS_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LATER_KEYS_FIELD_NUMBER: _ClassVar[int]
    objects: _containers.RepeatedCompositeFieldContainer[ObjectReplicas]
    lease_s: float
    lease_id: int
    later_keys: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, objects: _Optional[_Iterable[_Union[ObjectReplicas, _Mapping]]] = ..., lease_s: _Optional[float] = ..., lease_id: _Optional[int] = ..., later_keys: _Optional[_Iterable[str]] = ...) -> None: ...

class ExistRequest(_message.Message):
    __slots__ = ("key",)
    KEY_FIELD_NUMBER: _ClassVar[int]
    key: str
    def __init__(self, key: _Optional[str] = ...) -> None: ...

class ExistReply(_message.Message):
    __slots__ = ("exists",)
    EXISTS_FIELD_NUMBER: _ClassVar[int]
    exists: bool
    def __init__(self, exists: _Optional[bool] = ...) -> None: ...

class BatchExistRequest(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, keys: _Optional[_Iterable[str]] = ...) -> None: ...

class BatchExistReply(_message.Message):
    __slots__ = ("exists",)
    EXISTS_FIELD_NUMBER: _ClassVar[int]
    exists: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, exists: _Optional[_Iterable[bool]] = ...) -> None: ...

class LongestPrefixRequest(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, keys: _Optional[_Iterable[str]] = ...) -> None: ...

class LongestPrefixReply(_message.Message):
    __slots__ = ("num_keys",)
    NUM_KEYS_FIELD_NUMBER: _ClassVar[int]
    num_keys: int
    def __init__(self, num_keys: _Optional[int] = ...) -> None: ...

class RemoveRequest(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, keys: _Optional[_Iterable[str]] = ...) -> None: ...

class RemoveReply(_message.Message):
    __slots__ = ("removed",)
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    removed: int
    def __init__(self, removed: _Optional[int] = ...) -> None: ...

class PingRequest(_message.Message):
    __slots__ = ("client_id", "touched")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    TOUCHED_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    touched: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, client_id: _Optional[str] = ..., touched: _Optional[_Iterable[str]] = ...) -> None: ...

class PingReply(_message.Message):
    __slots__ = ("known", "master_epoch", "journal_seq", "serve_window_s")
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    MASTER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    JOURNAL_SEQ_FIELD_NUMBER: _ClassVar[int]
    SERVE_WINDOW_S_FIELD_NUMBER: _ClassVar[int]
    known: bool
    master_epoch: int
    journal_seq: int
    serve_window_s: float
    def __init__(self, known: _Optional[bool] = ..., master_epoch: _Optional[int] = ..., journal_seq: _Optional[int] = ..., serve_window_s: _Optional[float] = ...) -> None: ...

class TasksRequest(_message.Message):
    __slots__ = ("client_id",)
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    def __init__(self, client_id: _Optional[str] = ...) -> None: ...

class TierTask(_message.Message):
    __slots__ = ("task_id", "kind", "key", "size", "checksum", "src_segment", "src_offset", "dst_segment", "dst_offset", "journal", "journal_seq", "master_epoch")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[TierTask.Kind]
        KIND_DEMOTE: _ClassVar[TierTask.Kind]
        KIND_PROMOTE: _ClassVar[TierTask.Kind]
        KIND_DELETE: _ClassVar[TierTask.Kind]
        KIND_PERSIST: _ClassVar[TierTask.Kind]
        KIND_JOURNAL: _ClassVar[TierTask.Kind]
    KIND_UNSPECIFIED: TierTask.Kind
    KIND_DEMOTE: TierTask.Kind
    KIND_PROMOTE: TierTask.Kind
    KIND_DELETE: TierTask.Kind
    KIND_PERSIST: TierTask.Kind
    KIND_JOURNAL: TierTask.Kind
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    SRC_SEGMENT_FIELD_NUMBER: _ClassVar[int]
    SRC_OFFSET_FIELD_NUMBER: _ClassVar[int]
    DST_SEGMENT_FIELD_NUMBER: _ClassVar[int]
    DST_OFFSET_FIELD_NUMBER: _ClassVar[int]
    JOURNAL_FIELD_NUMBER: _ClassVar[int]
    JOURNAL_SEQ_FIELD_NUMBER: _ClassVar[int]
    MASTER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    task_id: int
    kind: TierTask.Kind
    key: str
    size: int
    checksum: int
    src_segment: str
    src_offset: int
    dst_segment: str
    dst_offset: int
    journal: _containers.RepeatedCompositeFieldContainer[JournalEntry]
    journal_seq: int
    master_epoch: int
    def __init__(self, task_id: _Optional[int] = ..., kind: _Optional[_Union[TierTask.Kind, str]] = ..., key: _Optional[str] = ..., size: _Optional[int] = ..., checksum: _Optional[int] = ..., src_segment: _Optional[str] = ..., src_offset: _Optional[int] = ..., dst_segment: _Optional[str] = ..., dst_offset: _Optional[int] = ..., journal: _Optional[_Iterable[_Union[JournalEntry, _Mapping]]] = ..., journal_seq: _Optional[int] = ..., master_epoch: _Optional[int] = ...) -> None: ...

class JournalEntry(_message.Message):
    __slots__ = ("key", "offset", "size", "checksum")
    KEY_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    key: str
    offset: int
    size: int
    checksum: int
    def __init__(self, key: _Optional[str] = ..., offset: _Optional[int] = ..., size: _Optional[int] = ..., checksum: _Optional[int] = ...) -> None: ...

class TaskResult(_message.Message):
    __slots__ = ("task_id", "ok", "error")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    task_id: int
    ok: bool
    error: str
    def __init__(self, task_id: _Optional[int] = ..., ok: _Optional[bool] = ..., error: _Optional[str] = ...) -> None: ...

class TaskDoneRequest(_message.Message):
    __slots__ = ("client_id", "results", "journal_seq")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    JOURNAL_SEQ_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    results: _containers.RepeatedCompositeFieldContainer[TaskResult]
    journal_seq: int
    def __init__(self, client_id: _Optional[str] = ..., results: _Optional[_Iterable[_Union[TaskResult, _Mapping]]] = ..., journal_seq: _Optional[int] = ...) -> None: ...

class TaskDoneReply(_message.Message):
    __slots__ = ("accepted",)
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    accepted: int
    def __init__(self, accepted: _Optional[int] = ...) -> None: ...

class PoolStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SegmentStats(_message.Message):
    __slots__ = ("name", "owner", "medium", "capacity", "used", "objects")
    NAME_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    USED_FIELD_NUMBER: _ClassVar[int]
    OBJECTS_FIELD_NUMBER: _ClassVar[int]
    name: str
    owner: str
    medium: str
    capacity: int
    used: int
    objects: int
    def __init__(self, name: _Optional[str] = ..., owner: _Optional[str] = ..., medium: _Optional[str] = ..., capacity: _Optional[int] = ..., used: _Optional[int] = ..., objects: _Optional[int] = ...) -> None: ...

class PoolStatsReply(_message.Message):
    __slots__ = ("segments", "objects", "hits", "misses", "evictions", "demotions", "promotions", "master_epoch", "clients")
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    OBJECTS_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    DEMOTIONS_FIELD_NUMBER: _ClassVar[int]
    PROMOTIONS_FIELD_NUMBER: _ClassVar[int]
    MASTER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    CLIENTS_FIELD_NUMBER: _ClassVar[int]
    segments: _containers.RepeatedCompositeFieldContainer[SegmentStats]
    objects: int
    hits: int
    misses: int
    evictions: int
    demotions: int
    promotions: int
    master_epoch: int
    clients: int
    def __init__(self, segments: _Optional[_Iterable[_Union[SegmentStats, _Mapping]]] = ..., objects: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., evictions: _Optional[int] = ..., demotions: _Optional[int] = ..., promotions: _Optional[int] = ..., master_epoch: _Optional[int] = ..., clients: _Optional[int] = ...) -> None: ...

class WatchPoolRequest(_message.Message):
    __slots__ = ("key_prefix",)
    KEY_PREFIX_FIELD_NUMBER: _ClassVar[int]
    key_prefix: str
    def __init__(self, key_prefix: _Optional[str] = ...) -> None: ...

class PoolEvent(_message.Message):
    __slots__ = ("kind", "keys", "medium")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[PoolEvent.Kind]
        KIND_STORED: _ClassVar[PoolEvent.Kind]
        KIND_REMOVED: _ClassVar[PoolEvent.Kind]
    KIND_UNSPECIFIED: PoolEvent.Kind
    KIND_STORED: PoolEvent.Kind
    KIND_REMOVED: PoolEvent.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    kind: PoolEvent.Kind
    keys: _containers.RepeatedScalarFieldContainer[str]
    medium: str
    def __init__(self, kind: _Optional[_Union[PoolEvent.Kind, str]] = ..., keys: _Optional[_Iterable[str]] = ..., medium: _Optional[str] = ...) -> None: ...

class PoolEvents(_message.Message):
    __slots__ = ("events", "snapshot_done", "master_epoch")
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_DONE_FIELD_NUMBER: _ClassVar[int]
    MASTER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[PoolEvent]
    snapshot_done: bool
    master_epoch: int
    def __init__(self, events: _Optional[_Iterable[_Union[PoolEvent, _Mapping]]] = ..., snapshot_done: _Optional[bool] = ..., master_epoch: _Optional[int] = ...) -> None: ...
