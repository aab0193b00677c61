from specfleet.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DraftSession(_message.Message):
    __slots__ = ("sync", "model", "num_draft_tokens", "sampling", "stop_below_confidence", "score_context", "lockstep_group")
    SYNC_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOP_BELOW_CONFIDENCE_FIELD_NUMBER: _ClassVar[int]
    SCORE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    LOCKSTEP_GROUP_FIELD_NUMBER: _ClassVar[int]
    sync: _common_pb2.SessionSync
    model: str
    num_draft_tokens: int
    sampling: _common_pb2.SamplingParams
    stop_below_confidence: float
    score_context: bool
    lockstep_group: str
    def __init__(self, sync: _Optional[_Union[_common_pb2.SessionSync, _Mapping]] = ..., model: _Optional[str] = ..., num_draft_tokens: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., stop_below_confidence: _Optional[float] = ..., score_context: _Optional[bool] = ..., lockstep_group: _Optional[str] = ...) -> None: ...

class DraftRequest(_message.Message):
    __slots__ = ("sessions",)
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    sessions: _containers.RepeatedCompositeFieldContainer[DraftSession]
    def __init__(self, sessions: _Optional[_Iterable[_Union[DraftSession, _Mapping]]] = ...) -> None: ...

class DraftedSession(_message.Message):
    __slots__ = ("session_id", "status", "token_ids", "proposals", "confidences", "context_log_prob", "context_tokens")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROPOSALS_FIELD_NUMBER: _ClassVar[int]
    CONFIDENCES_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LOG_PROB_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    status: _common_pb2.SessionStatus
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    proposals: _containers.RepeatedCompositeFieldContainer[_common_pb2.SparseDistribution]
    confidences: _containers.RepeatedScalarFieldContainer[float]
    context_log_prob: float
    context_tokens: int
    def __init__(self, session_id: _Optional[str] = ..., status: _Optional[_Union[_common_pb2.SessionStatus, str]] = ..., token_ids: _Optional[_Iterable[int]] = ..., proposals: _Optional[_Iterable[_Union[_common_pb2.SparseDistribution, _Mapping]]] = ..., confidences: _Optional[_Iterable[float]] = ..., context_log_prob: _Optional[float] = ..., context_tokens: _Optional[int] = ...) -> None: ...

class DraftResponse(_message.Message):
    __slots__ = ("sessions", "compute_ms", "queue_ms")
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    sessions: _containers.RepeatedCompositeFieldContainer[DraftedSession]
    compute_ms: float
    queue_ms: float
    def __init__(self, sessions: _Optional[_Iterable[_Union[DraftedSession, _Mapping]]] = ..., compute_ms: _Optional[float] = ..., queue_ms: _Optional[float] = ...) -> None: ...

class DrafterInfo(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[_common_pb2.ModelInfo]
    def __init__(self, models: _Optional[_Iterable[_Union[_common_pb2.ModelInfo, _Mapping]]] = ...) -> None: ...

class DrafterServiceStats(_message.Message):
    __slots__ = ("session_ids",)
    SESSION_IDS_FIELD_NUMBER: _ClassVar[int]
    session_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, session_ids: _Optional[_Iterable[str]] = ...) -> None: ...
