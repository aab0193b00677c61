from specfleet.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TokenTree(_message.Message):
    __slots__ = ("token_ids", "parents", "proposals")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    PROPOSALS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    parents: _containers.RepeatedScalarFieldContainer[int]
    proposals: _containers.RepeatedCompositeFieldContainer[_common_pb2.SparseDistribution]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., parents: _Optional[_Iterable[int]] = ..., proposals: _Optional[_Iterable[_Union[_common_pb2.SparseDistribution, _Mapping]]] = ...) -> None: ...

class VerifySession(_message.Message):
    __slots__ = ("sync", "tree", "sampling", "logprobs", "top_logprobs", "plain_steps", "lookup_tokens", "max_tokens", "prompt_logprobs", "prompt_top_logprobs")
    SYNC_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PLAIN_STEPS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    sync: _common_pb2.SessionSync
    tree: TokenTree
    sampling: _common_pb2.SamplingParams
    logprobs: bool
    top_logprobs: int
    plain_steps: int
    lookup_tokens: int
    max_tokens: int
    prompt_logprobs: bool
    prompt_top_logprobs: int
    def __init__(self, sync: _Optional[_Union[_common_pb2.SessionSync, _Mapping]] = ..., tree: _Optional[_Union[TokenTree, _Mapping]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., plain_steps: _Optional[int] = ..., lookup_tokens: _Optional[int] = ..., max_tokens: _Optional[int] = ..., prompt_logprobs: _Optional[bool] = ..., prompt_top_logprobs: _Optional[int] = ...) -> None: ...

class PromptLogprobs(_message.Message):
    __slots__ = ("logprobs", "ranks", "top_token_ids", "top_logprobs")
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    ranks: _containers.RepeatedScalarFieldContainer[int]
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, logprobs: _Optional[_Iterable[float]] = ..., ranks: _Optional[_Iterable[int]] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("sessions",)
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    sessions: _containers.RepeatedCompositeFieldContainer[VerifySession]
    def __init__(self, sessions: _Optional[_Iterable[_Union[VerifySession, _Mapping]]] = ...) -> None: ...

class VerifiedSession(_message.Message):
    __slots__ = ("session_id", "status", "accepted_nodes", "token_ids", "logprobs", "top_token_ids", "top_logprobs", "lookup_proposed", "lookup_accepted", "prompt_logprobs", "cached_tokens")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_NODES_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_PROPOSED_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    status: _common_pb2.SessionStatus
    accepted_nodes: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    lookup_proposed: int
    lookup_accepted: int
    prompt_logprobs: PromptLogprobs
    cached_tokens: int
    def __init__(self, session_id: _Optional[str] = ..., status: _Optional[_Union[_common_pb2.SessionStatus, str]] = ..., accepted_nodes: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ..., lookup_proposed: _Optional[int] = ..., lookup_accepted: _Optional[int] = ..., prompt_logprobs: _Optional[_Union[PromptLogprobs, _Mapping]] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class VerifyResponse(_message.Message):
    __slots__ = ("sessions", "compute_ms", "batch_size", "queue_ms", "passes", "shared_ms")
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    PASSES_FIELD_NUMBER: _ClassVar[int]
    SHARED_MS_FIELD_NUMBER: _ClassVar[int]
    sessions: _containers.RepeatedCompositeFieldContainer[VerifiedSession]
    compute_ms: float
    batch_size: int
    queue_ms: float
    passes: int
    shared_ms: float
    def __init__(self, sessions: _Optional[_Iterable[_Union[VerifiedSession, _Mapping]]] = ..., compute_ms: _Optional[float] = ..., batch_size: _Optional[int] = ..., queue_ms: _Optional[float] = ..., passes: _Optional[int] = ..., shared_ms: _Optional[float] = ...) -> None: ...

class VerifierServiceStats(_message.Message):
    __slots__ = ("session_ids",)
    SESSION_IDS_FIELD_NUMBER: _ClassVar[int]
    session_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, session_ids: _Optional[_Iterable[str]] = ...) -> None: ...
