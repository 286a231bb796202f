from swarm._proto.swarm.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class InferenceRequest(_message.Message):
    __slots__ = ("session_id", "stage", "position", "token_ids", "frame")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FRAME_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    stage: int
    position: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    frame: _common_pb2.ActivationFrame
    def __init__(self, session_id: _Optional[str] = ..., stage: _Optional[int] = ..., position: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., frame: _Optional[_Union[_common_pb2.ActivationFrame, _Mapping]] = ...) -> None: ...

class InferenceReply(_message.Message):
    __slots__ = ("frame", "cached")
    FRAME_FIELD_NUMBER: _ClassVar[int]
    CACHED_FIELD_NUMBER: _ClassVar[int]
    frame: _common_pb2.ActivationFrame
    cached: int
    def __init__(self, frame: _Optional[_Union[_common_pb2.ActivationFrame, _Mapping]] = ..., cached: _Optional[int] = ...) -> None: ...
