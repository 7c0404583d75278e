import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from trainyard.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WeightKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WEIGHT_KIND_UNSPECIFIED: _ClassVar[WeightKind]
    WEIGHT_KIND_LORA_ADAPTER: _ClassVar[WeightKind]
    WEIGHT_KIND_FULL: _ClassVar[WeightKind]
WEIGHT_KIND_UNSPECIFIED: WeightKind
WEIGHT_KIND_LORA_ADAPTER: WeightKind
WEIGHT_KIND_FULL: WeightKind

class Lineage(_message.Message):
    __slots__ = ("lineage", "kind", "base_model", "current", "latest_version", "updated_at")
    LINEAGE_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    CURRENT_FIELD_NUMBER: _ClassVar[int]
    LATEST_VERSION_FIELD_NUMBER: _ClassVar[int]
    UPDATED_AT_FIELD_NUMBER: _ClassVar[int]
    lineage: str
    kind: WeightKind
    base_model: str
    current: WeightVersion
    latest_version: int
    updated_at: _timestamp_pb2.Timestamp
    def __init__(self, lineage: _Optional[str] = ..., kind: _Optional[_Union[WeightKind, str]] = ..., base_model: _Optional[str] = ..., current: _Optional[_Union[WeightVersion, _Mapping]] = ..., latest_version: _Optional[int] = ..., updated_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class GetLineageRequest(_message.Message):
    __slots__ = ("lineage",)
    LINEAGE_FIELD_NUMBER: _ClassVar[int]
    lineage: str
    def __init__(self, lineage: _Optional[str] = ...) -> None: ...

class WatchLineageRequest(_message.Message):
    __slots__ = ("lineage",)
    LINEAGE_FIELD_NUMBER: _ClassVar[int]
    lineage: str
    def __init__(self, lineage: _Optional[str] = ...) -> None: ...

class RollbackRequest(_message.Message):
    __slots__ = ("lineage", "version_id")
    LINEAGE_FIELD_NUMBER: _ClassVar[int]
    VERSION_ID_FIELD_NUMBER: _ClassVar[int]
    lineage: str
    version_id: str
    def __init__(self, lineage: _Optional[str] = ..., version_id: _Optional[str] = ...) -> None: ...

class WeightFile(_message.Message):
    __slots__ = ("path", "sha256", "size_bytes")
    PATH_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    path: str
    sha256: str
    size_bytes: int
    def __init__(self, path: _Optional[str] = ..., sha256: _Optional[str] = ..., size_bytes: _Optional[int] = ...) -> None: ...

class WeightVersion(_message.Message):
    __slots__ = ("id", "lineage", "version", "parent_id", "kind", "base_model", "files", "metadata", "created_at", "ephemeral")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    LINEAGE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PARENT_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    EPHEMERAL_FIELD_NUMBER: _ClassVar[int]
    id: str
    lineage: str
    version: int
    parent_id: str
    kind: WeightKind
    base_model: str
    files: _containers.RepeatedCompositeFieldContainer[WeightFile]
    metadata: _containers.ScalarMap[str, str]
    created_at: _timestamp_pb2.Timestamp
    ephemeral: bool
    def __init__(self, id: _Optional[str] = ..., lineage: _Optional[str] = ..., version: _Optional[int] = ..., parent_id: _Optional[str] = ..., kind: _Optional[_Union[WeightKind, str]] = ..., base_model: _Optional[str] = ..., files: _Optional[_Iterable[_Union[WeightFile, _Mapping]]] = ..., metadata: _Optional[_Mapping[str, str]] = ..., created_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., ephemeral: _Optional[bool] = ...) -> None: ...

class PublishVersionHeader(_message.Message):
    __slots__ = ("lineage", "parent_id", "kind", "base_model", "files", "metadata", "ephemeral")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    LINEAGE_FIELD_NUMBER: _ClassVar[int]
    PARENT_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    EPHEMERAL_FIELD_NUMBER: _ClassVar[int]
    lineage: str
    parent_id: str
    kind: WeightKind
    base_model: str
    files: _containers.RepeatedCompositeFieldContainer[WeightFile]
    metadata: _containers.ScalarMap[str, str]
    ephemeral: bool
    def __init__(self, lineage: _Optional[str] = ..., parent_id: _Optional[str] = ..., kind: _Optional[_Union[WeightKind, str]] = ..., base_model: _Optional[str] = ..., files: _Optional[_Iterable[_Union[WeightFile, _Mapping]]] = ..., metadata: _Optional[_Mapping[str, str]] = ..., ephemeral: _Optional[bool] = ...) -> None: ...

class PublishVersionRequest(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: PublishVersionHeader
    chunk: _common_pb2.FileChunk
    def __init__(self, header: _Optional[_Union[PublishVersionHeader, _Mapping]] = ..., chunk: _Optional[_Union[_common_pb2.FileChunk, _Mapping]] = ...) -> None: ...

class GetVersionRequest(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class ListVersionsRequest(_message.Message):
    __slots__ = ("lineage",)
    LINEAGE_FIELD_NUMBER: _ClassVar[int]
    lineage: str
    def __init__(self, lineage: _Optional[str] = ...) -> None: ...

class ListVersionsResponse(_message.Message):
    __slots__ = ("versions",)
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    versions: _containers.RepeatedCompositeFieldContainer[WeightVersion]
    def __init__(self, versions: _Optional[_Iterable[_Union[WeightVersion, _Mapping]]] = ...) -> None: ...

class FetchVersionRequest(_message.Message):
    __slots__ = ("id", "from_path", "from_offset", "base_version_id")
    ID_FIELD_NUMBER: _ClassVar[int]
    FROM_PATH_FIELD_NUMBER: _ClassVar[int]
    FROM_OFFSET_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    from_path: str
    from_offset: int
    base_version_id: str
    def __init__(self, id: _Optional[str] = ..., from_path: _Optional[str] = ..., from_offset: _Optional[int] = ..., base_version_id: _Optional[str] = ...) -> None: ...

class DeleteEphemeralVersionsRequest(_message.Message):
    __slots__ = ("lineage",)
    LINEAGE_FIELD_NUMBER: _ClassVar[int]
    lineage: str
    def __init__(self, lineage: _Optional[str] = ...) -> None: ...

class DeleteEphemeralVersionsResponse(_message.Message):
    __slots__ = ("deleted",)
    DELETED_FIELD_NUMBER: _ClassVar[int]
    deleted: int
    def __init__(self, deleted: _Optional[int] = ...) -> None: ...
