from swarm._proto.swarm.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ErrorCode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ERROR_CODE_UNSPECIFIED: _ClassVar[ErrorCode]
    ERROR_CODE_PROTOCOL_VERSION: _ClassVar[ErrorCode]
    ERROR_CODE_UNAUTHENTICATED: _ClassVar[ErrorCode]
    ERROR_CODE_CONFIG_MISMATCH: _ClassVar[ErrorCode]
    ERROR_CODE_WRONG_BOUNDARY: _ClassVar[ErrorCode]
    ERROR_CODE_BAD_PAYLOAD: _ClassVar[ErrorCode]
    ERROR_CODE_SUBSPACE_VERSION: _ClassVar[ErrorCode]
    ERROR_CODE_UNEXPECTED_MESSAGE: _ClassVar[ErrorCode]
    ERROR_CODE_SHUTTING_DOWN: _ClassVar[ErrorCode]
    ERROR_CODE_INTERNAL: _ClassVar[ErrorCode]
    ERROR_CODE_PLAN_EPOCH: _ClassVar[ErrorCode]
ERROR_CODE_UNSPECIFIED: ErrorCode
ERROR_CODE_PROTOCOL_VERSION: ErrorCode
ERROR_CODE_UNAUTHENTICATED: ErrorCode
ERROR_CODE_CONFIG_MISMATCH: ErrorCode
ERROR_CODE_WRONG_BOUNDARY: ErrorCode
ERROR_CODE_BAD_PAYLOAD: ErrorCode
ERROR_CODE_SUBSPACE_VERSION: ErrorCode
ERROR_CODE_UNEXPECTED_MESSAGE: ErrorCode
ERROR_CODE_SHUTTING_DOWN: ErrorCode
ERROR_CODE_INTERNAL: ErrorCode
ERROR_CODE_PLAN_EPOCH: ErrorCode

class EvidenceRequest(_message.Message):
    __slots__ = ("step", "boundary", "direction", "microbatch", "side", "access")
    STEP_FIELD_NUMBER: _ClassVar[int]
    BOUNDARY_FIELD_NUMBER: _ClassVar[int]
    DIRECTION_FIELD_NUMBER: _ClassVar[int]
    MICROBATCH_FIELD_NUMBER: _ClassVar[int]
    SIDE_FIELD_NUMBER: _ClassVar[int]
    ACCESS_FIELD_NUMBER: _ClassVar[int]
    step: int
    boundary: int
    direction: str
    microbatch: int
    side: str
    access: str
    def __init__(self, step: _Optional[int] = ..., boundary: _Optional[int] = ..., direction: _Optional[str] = ..., microbatch: _Optional[int] = ..., side: _Optional[str] = ..., access: _Optional[str] = ...) -> None: ...

class EvidenceReply(_message.Message):
    __slots__ = ("activation", "gradient")
    ACTIVATION_FIELD_NUMBER: _ClassVar[int]
    GRADIENT_FIELD_NUMBER: _ClassVar[int]
    activation: _common_pb2.ActivationFrame
    gradient: _common_pb2.GradientFrame
    def __init__(self, activation: _Optional[_Union[_common_pb2.ActivationFrame, _Mapping]] = ..., gradient: _Optional[_Union[_common_pb2.GradientFrame, _Mapping]] = ...) -> None: ...

class SnapshotRequest(_message.Message):
    __slots__ = ("digest", "chunk_bytes", "chunks", "access")
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    ACCESS_FIELD_NUMBER: _ClassVar[int]
    digest: str
    chunk_bytes: int
    chunks: _containers.RepeatedScalarFieldContainer[int]
    access: str
    def __init__(self, digest: _Optional[str] = ..., chunk_bytes: _Optional[int] = ..., chunks: _Optional[_Iterable[int]] = ..., access: _Optional[str] = ...) -> None: ...

class SnapshotChunk(_message.Message):
    __slots__ = ("index", "data")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    index: int
    data: bytes
    def __init__(self, index: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class StageMessage(_message.Message):
    __slots__ = ("hello", "activation", "gradient", "sync", "error")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    ACTIVATION_FIELD_NUMBER: _ClassVar[int]
    GRADIENT_FIELD_NUMBER: _ClassVar[int]
    SYNC_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    hello: Hello
    activation: _common_pb2.ActivationFrame
    gradient: _common_pb2.GradientFrame
    sync: BoundarySync
    error: Error
    def __init__(self, hello: _Optional[_Union[Hello, _Mapping]] = ..., activation: _Optional[_Union[_common_pb2.ActivationFrame, _Mapping]] = ..., gradient: _Optional[_Union[_common_pb2.GradientFrame, _Mapping]] = ..., sync: _Optional[_Union[BoundarySync, _Mapping]] = ..., error: _Optional[_Union[Error, _Mapping]] = ...) -> None: ...

class Hello(_message.Message):
    __slots__ = ("protocol_version", "run_id", "config_hash", "boundary", "stage", "auth_token", "node_id", "plan_epoch")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    CONFIG_HASH_FIELD_NUMBER: _ClassVar[int]
    BOUNDARY_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    AUTH_TOKEN_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    PLAN_EPOCH_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    run_id: str
    config_hash: str
    boundary: int
    stage: int
    auth_token: str
    node_id: str
    plan_epoch: int
    def __init__(self, protocol_version: _Optional[int] = ..., run_id: _Optional[str] = ..., config_hash: _Optional[str] = ..., boundary: _Optional[int] = ..., stage: _Optional[int] = ..., auth_token: _Optional[str] = ..., node_id: _Optional[str] = ..., plan_epoch: _Optional[int] = ...) -> None: ...

class BoundarySync(_message.Message):
    __slots__ = ("step", "boundary", "mapl_gradients", "codebook_delta", "mapl_projection")
    STEP_FIELD_NUMBER: _ClassVar[int]
    BOUNDARY_FIELD_NUMBER: _ClassVar[int]
    MAPL_GRADIENTS_FIELD_NUMBER: _ClassVar[int]
    CODEBOOK_DELTA_FIELD_NUMBER: _ClassVar[int]
    MAPL_PROJECTION_FIELD_NUMBER: _ClassVar[int]
    step: int
    boundary: int
    mapl_gradients: bytes
    codebook_delta: bytes
    mapl_projection: bytes
    def __init__(self, step: _Optional[int] = ..., boundary: _Optional[int] = ..., mapl_gradients: _Optional[bytes] = ..., codebook_delta: _Optional[bytes] = ..., mapl_projection: _Optional[bytes] = ...) -> None: ...

class Error(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: ErrorCode
    message: str
    def __init__(self, code: _Optional[_Union[ErrorCode, str]] = ..., message: _Optional[str] = ...) -> None: ...

class PingRequest(_message.Message):
    __slots__ = ("nonce",)
    NONCE_FIELD_NUMBER: _ClassVar[int]
    nonce: int
    def __init__(self, nonce: _Optional[int] = ...) -> None: ...

class PingReply(_message.Message):
    __slots__ = ("nonce", "protocol_version", "node_id", "stages")
    NONCE_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    nonce: int
    protocol_version: int
    node_id: str
    stages: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, nonce: _Optional[int] = ..., protocol_version: _Optional[int] = ..., node_id: _Optional[str] = ..., stages: _Optional[_Iterable[int]] = ...) -> None: ...
