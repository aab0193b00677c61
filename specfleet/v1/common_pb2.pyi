from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SessionStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SESSION_STATUS_UNSPECIFIED: _ClassVar[SessionStatus]
    SESSION_OK: _ClassVar[SessionStatus]
    SESSION_UNKNOWN: _ClassVar[SessionStatus]
    SESSION_PREFILLING: _ClassVar[SessionStatus]
SESSION_STATUS_UNSPECIFIED: SessionStatus
SESSION_OK: SessionStatus
SESSION_UNKNOWN: SessionStatus
SESSION_PREFILLING: SessionStatus

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed", "drafter_invariant", "logit_bias", "presence_penalty", "frequency_penalty", "repetition_penalty", "output_start", "min_tokens", "held_back", "guide", "min_p", "allowed_token_ids", "bad_words")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_INVARIANT_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_START_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HELD_BACK_FIELD_NUMBER: _ClassVar[int]
    GUIDE_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BAD_WORDS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    drafter_invariant: bool
    logit_bias: _containers.ScalarMap[int, float]
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    output_start: int
    min_tokens: int
    held_back: _containers.RepeatedScalarFieldContainer[int]
    guide: Guide
    min_p: float
    allowed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    bad_words: _containers.RepeatedCompositeFieldContainer[TokenSequence]
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., drafter_invariant: _Optional[bool] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., output_start: _Optional[int] = ..., min_tokens: _Optional[int] = ..., held_back: _Optional[_Iterable[int]] = ..., guide: _Optional[_Union[Guide, _Mapping]] = ..., min_p: _Optional[float] = ..., allowed_token_ids: _Optional[_Iterable[int]] = ..., bad_words: _Optional[_Iterable[_Union[TokenSequence, _Mapping]]] = ...) -> None: ...

class TokenSequence(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Guide(_message.Message):
    __slots__ = ("kind", "spec", "compact", "thought_end", "thought_open")
    KIND_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    COMPACT_FIELD_NUMBER: _ClassVar[int]
    THOUGHT_END_FIELD_NUMBER: _ClassVar[int]
    THOUGHT_OPEN_FIELD_NUMBER: _ClassVar[int]
    kind: str
    spec: str
    compact: bool
    thought_end: _containers.RepeatedScalarFieldContainer[int]
    thought_open: int
    def __init__(self, kind: _Optional[str] = ..., spec: _Optional[str] = ..., compact: _Optional[bool] = ..., thought_end: _Optional[_Iterable[int]] = ..., thought_open: _Optional[int] = ...) -> None: ...

class SessionSync(_message.Message):
    __slots__ = ("session_id", "prefix_length", "new_token_ids", "cache_salt")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PREFIX_LENGTH_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    prefix_length: int
    new_token_ids: _containers.RepeatedScalarFieldContainer[int]
    cache_salt: str
    def __init__(self, session_id: _Optional[str] = ..., prefix_length: _Optional[int] = ..., new_token_ids: _Optional[_Iterable[int]] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class SparseDistribution(_message.Message):
    __slots__ = ("token_ids", "probs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    probs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., probs: _Optional[_Iterable[float]] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("name", "path", "vocab_size", "max_context", "eos_token_id", "tokenizer_fingerprint", "parameters", "device", "dtype", "attention", "host", "cpus", "threads", "structured_output")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    CPUS_FIELD_NUMBER: _ClassVar[int]
    THREADS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    vocab_size: int
    max_context: int
    eos_token_id: int
    tokenizer_fingerprint: str
    parameters: int
    device: str
    dtype: str
    attention: str
    host: str
    cpus: _containers.RepeatedScalarFieldContainer[int]
    threads: int
    structured_output: bool
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_context: _Optional[int] = ..., eos_token_id: _Optional[int] = ..., tokenizer_fingerprint: _Optional[str] = ..., parameters: _Optional[int] = ..., device: _Optional[str] = ..., dtype: _Optional[str] = ..., attention: _Optional[str] = ..., host: _Optional[str] = ..., cpus: _Optional[_Iterable[int]] = ..., threads: _Optional[int] = ..., structured_output: _Optional[bool] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("session_ids", "keep_tokens")
    SESSION_IDS_FIELD_NUMBER: _ClassVar[int]
    KEEP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    session_ids: _containers.RepeatedScalarFieldContainer[str]
    keep_tokens: bool
    def __init__(self, session_ids: _Optional[_Iterable[str]] = ..., keep_tokens: _Optional[bool] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: int
    def __init__(self, released: _Optional[int] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
