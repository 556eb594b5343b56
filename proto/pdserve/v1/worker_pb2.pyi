from pdserve.v1 import generate_pb2 as _generate_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ResolvedSampling(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed", "max_tokens", "ignore_eos", "step_offset")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    STEP_OFFSET_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    max_tokens: int
    ignore_eos: bool
    step_offset: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., max_tokens: _Optional[int] = ..., ignore_eos: _Optional[bool] = ..., step_offset: _Optional[int] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "decode_address", "kv_skip_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DECODE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    KV_SKIP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: ResolvedSampling
    decode_address: str
    kv_skip_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[ResolvedSampling, _Mapping]] = ..., decode_address: _Optional[str] = ..., kv_skip_tokens: _Optional[int] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_token", "finish_reason", "queue_ns", "prefill_ns", "first_token_unix_ns", "kv_push_error", "cached_prompt_tokens")
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    QUEUE_NS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_NS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    KV_PUSH_ERROR_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    first_token: int
    finish_reason: _generate_pb2.FinishReason
    queue_ns: int
    prefill_ns: int
    first_token_unix_ns: int
    kv_push_error: KvPushError
    cached_prompt_tokens: int
    def __init__(self, first_token: _Optional[int] = ..., finish_reason: _Optional[_Union[_generate_pb2.FinishReason, str]] = ..., queue_ns: _Optional[int] = ..., prefill_ns: _Optional[int] = ..., first_token_unix_ns: _Optional[int] = ..., kv_push_error: _Optional[_Union[KvPushError, _Mapping]] = ..., cached_prompt_tokens: _Optional[int] = ...) -> None: ...

class KvPushError(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: str
    message: str
    def __init__(self, code: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class KvChunk(_message.Message):
    __slots__ = ("request_id", "data")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    data: bytes
    def __init__(self, request_id: _Optional[str] = ..., data: _Optional[bytes] = ...) -> None: ...

class PushKvResponse(_message.Message):
    __slots__ = ("received_bytes",)
    RECEIVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    received_bytes: int
    def __init__(self, received_bytes: _Optional[int] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "kv_timeout_s", "prompt_token_ids", "token_channel")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    KV_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_CHANNEL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    kv_timeout_s: float
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    token_channel: str
    def __init__(self, request_id: _Optional[str] = ..., kv_timeout_s: _Optional[float] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., token_channel: _Optional[str] = ...) -> None: ...

class ColocatedRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "token_channel")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TOKEN_CHANNEL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: ResolvedSampling
    token_channel: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[ResolvedSampling, _Mapping]] = ..., token_channel: _Optional[str] = ...) -> None: ...

class TokenBatch(_message.Message):
    __slots__ = ("token_ids", "finish_reason", "timings", "first_index")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    FIRST_INDEX_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: _generate_pb2.FinishReason
    timings: _generate_pb2.Timings
    first_index: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[_generate_pb2.FinishReason, str]] = ..., timings: _Optional[_Union[_generate_pb2.Timings, _Mapping]] = ..., first_index: _Optional[int] = ...) -> None: ...

class TokenChannelRequest(_message.Message):
    __slots__ = ("channel_id",)
    CHANNEL_ID_FIELD_NUMBER: _ClassVar[int]
    channel_id: str
    def __init__(self, channel_id: _Optional[str] = ...) -> None: ...

class ChannelBatch(_message.Message):
    __slots__ = ("requests",)
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[ChannelTokens]
    def __init__(self, requests: _Optional[_Iterable[_Union[ChannelTokens, _Mapping]]] = ...) -> None: ...

class ChannelTokens(_message.Message):
    __slots__ = ("request_id", "first_index", "token_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    first_index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., first_index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStats(_message.Message):
    __slots__ = ("role", "num_waiting", "num_running", "used_kv_blocks", "free_kv_blocks", "block_size", "outstanding_prefill_tokens", "num_awaiting_kv", "model_fingerprint", "cached_kv_blocks", "prefix_query_tokens", "prefix_hit_tokens", "prefill_busy_ns", "decode_busy_ns", "switchable", "kv_tcp_port")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    USED_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FREE_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    OUTSTANDING_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_AWAITING_KV_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    CACHED_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_QUERY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_BUSY_NS_FIELD_NUMBER: _ClassVar[int]
    DECODE_BUSY_NS_FIELD_NUMBER: _ClassVar[int]
    SWITCHABLE_FIELD_NUMBER: _ClassVar[int]
    KV_TCP_PORT_FIELD_NUMBER: _ClassVar[int]
    role: str
    num_waiting: int
    num_running: int
    used_kv_blocks: int
    free_kv_blocks: int
    block_size: int
    outstanding_prefill_tokens: int
    num_awaiting_kv: int
    model_fingerprint: str
    cached_kv_blocks: int
    prefix_query_tokens: int
    prefix_hit_tokens: int
    prefill_busy_ns: int
    decode_busy_ns: int
    switchable: bool
    kv_tcp_port: int
    def __init__(self, role: _Optional[str] = ..., num_waiting: _Optional[int] = ..., num_running: _Optional[int] = ..., used_kv_blocks: _Optional[int] = ..., free_kv_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., outstanding_prefill_tokens: _Optional[int] = ..., num_awaiting_kv: _Optional[int] = ..., model_fingerprint: _Optional[str] = ..., cached_kv_blocks: _Optional[int] = ..., prefix_query_tokens: _Optional[int] = ..., prefix_hit_tokens: _Optional[int] = ..., prefill_busy_ns: _Optional[int] = ..., decode_busy_ns: _Optional[int] = ..., switchable: _Optional[bool] = ..., kv_tcp_port: _Optional[int] = ...) -> None: ...

class SetRoleRequest(_message.Message):
    __slots__ = ("role",)
    ROLE_FIELD_NUMBER: _ClassVar[int]
    role: str
    def __init__(self, role: _Optional[str] = ...) -> None: ...

class SetRoleResponse(_message.Message):
    __slots__ = ("previous_role", "role")
    PREVIOUS_ROLE_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    previous_role: str
    role: str
    def __init__(self, previous_role: _Optional[str] = ..., role: _Optional[str] = ...) -> None: ...

class WorkerAbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class WorkerAbortResponse(_message.Message):
    __slots__ = ("aborted",)
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    aborted: bool
    def __init__(self, aborted: _Optional[bool] = ...) -> None: ...
