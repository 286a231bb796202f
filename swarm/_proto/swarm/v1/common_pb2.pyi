from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ProtocolVersion(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PROTOCOL_VERSION_UNSPECIFIED: _ClassVar[ProtocolVersion]
    PROTOCOL_VERSION_CURRENT: _ClassVar[ProtocolVersion]
PROTOCOL_VERSION_UNSPECIFIED: ProtocolVersion
PROTOCOL_VERSION_CURRENT: ProtocolVersion

class EncodedTensor(_message.Message):
    __slots__ = ("format", "rows", "cols", "data")
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    COLS_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    format: str
    rows: int
    cols: int
    data: bytes
    def __init__(self, format: _Optional[str] = ..., rows: _Optional[int] = ..., cols: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class ActivationFrame(_message.Message):
    __slots__ = ("step", "microbatch", "subspace_version", "batch", "seq_len", "payload", "token_ids", "zstd", "cut")
    STEP_FIELD_NUMBER: _ClassVar[int]
    MICROBATCH_FIELD_NUMBER: _ClassVar[int]
    SUBSPACE_VERSION_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    SEQ_LEN_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ZSTD_FIELD_NUMBER: _ClassVar[int]
    CUT_FIELD_NUMBER: _ClassVar[int]
    step: int
    microbatch: int
    subspace_version: int
    batch: int
    seq_len: int
    payload: EncodedTensor
    token_ids: bytes
    zstd: bool
    cut: bool
    def __init__(self, step: _Optional[int] = ..., microbatch: _Optional[int] = ..., subspace_version: _Optional[int] = ..., batch: _Optional[int] = ..., seq_len: _Optional[int] = ..., payload: _Optional[_Union[EncodedTensor, _Mapping]] = ..., token_ids: _Optional[bytes] = ..., zstd: _Optional[bool] = ..., cut: _Optional[bool] = ...) -> None: ...

class GradientFrame(_message.Message):
    __slots__ = ("step", "microbatch", "subspace_version", "payload", "zstd")
    STEP_FIELD_NUMBER: _ClassVar[int]
    MICROBATCH_FIELD_NUMBER: _ClassVar[int]
    SUBSPACE_VERSION_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    ZSTD_FIELD_NUMBER: _ClassVar[int]
    step: int
    microbatch: int
    subspace_version: int
    payload: EncodedTensor
    zstd: bool
    def __init__(self, step: _Optional[int] = ..., microbatch: _Optional[int] = ..., subspace_version: _Optional[int] = ..., payload: _Optional[_Union[EncodedTensor, _Mapping]] = ..., zstd: _Optional[bool] = ...) -> None: ...

class Rotation(_message.Message):
    __slots__ = ("version", "effective_step", "basis_f64_le", "d", "k", "digest", "lineage")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    EFFECTIVE_STEP_FIELD_NUMBER: _ClassVar[int]
    BASIS_F64_LE_FIELD_NUMBER: _ClassVar[int]
    D_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    LINEAGE_FIELD_NUMBER: _ClassVar[int]
    version: int
    effective_step: int
    basis_f64_le: bytes
    d: int
    k: int
    digest: str
    lineage: int
    def __init__(self, version: _Optional[int] = ..., effective_step: _Optional[int] = ..., basis_f64_le: _Optional[bytes] = ..., d: _Optional[int] = ..., k: _Optional[int] = ..., digest: _Optional[str] = ..., lineage: _Optional[int] = ...) -> None: ...
