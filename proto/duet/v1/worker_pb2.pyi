from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TransferOutcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRANSFER_OUTCOME_UNSPECIFIED: _ClassVar[TransferOutcome]
    TRANSFER_OUTCOME_DONE: _ClassVar[TransferOutcome]
    TRANSFER_OUTCOME_FAILED: _ClassVar[TransferOutcome]
    TRANSFER_OUTCOME_ABORTED: _ClassVar[TransferOutcome]
TRANSFER_OUTCOME_UNSPECIFIED: TransferOutcome
TRANSFER_OUTCOME_DONE: TransferOutcome
TRANSFER_OUTCOME_FAILED: TransferOutcome
TRANSFER_OUTCOME_ABORTED: TransferOutcome

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop_token_ids", "ignore_eos", "presence_penalty", "frequency_penalty", "repetition_penalty", "logprobs", "prompt_logprobs", "structured_outputs", "logit_bias", "allowed_token_ids", "cache_salt", "bad_words", "prediction_token_ids", "pooling")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    BAD_WORDS_FIELD_NUMBER: _ClassVar[int]
    PREDICTION_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    POOLING_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    min_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logprobs: int
    prompt_logprobs: int
    structured_outputs: WorkerStructuredOutputs
    logit_bias: _containers.ScalarMap[int, float]
    allowed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    cache_salt: str
    bad_words: _containers.RepeatedScalarFieldContainer[str]
    prediction_token_ids: _containers.RepeatedScalarFieldContainer[int]
    pooling: str
    def __init__(self, max_tokens: _Optional[int] = ..., min_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., structured_outputs: _Optional[_Union[WorkerStructuredOutputs, _Mapping]] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., allowed_token_ids: _Optional[_Iterable[int]] = ..., cache_salt: _Optional[str] = ..., bad_words: _Optional[_Iterable[str]] = ..., prediction_token_ids: _Optional[_Iterable[int]] = ..., pooling: _Optional[str] = ...) -> None: ...

class WorkerStructuredOutputs(_message.Message):
    __slots__ = ("json", "json_object", "regex", "choice", "grammar", "whitespace", "reasoning")
    JSON_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    WHITESPACE_FIELD_NUMBER: _ClassVar[int]
    REASONING_FIELD_NUMBER: _ClassVar[int]
    json: str
    json_object: bool
    regex: str
    choice: ChoiceList
    grammar: str
    whitespace: bool
    reasoning: str
    def __init__(self, json: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., choice: _Optional[_Union[ChoiceList, _Mapping]] = ..., grammar: _Optional[str] = ..., whitespace: _Optional[bool] = ..., reasoning: _Optional[str] = ...) -> None: ...

class ChoiceList(_message.Message):
    __slots__ = ("choices",)
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    choices: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, choices: _Optional[_Iterable[str]] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "kv_destination", "num_replayed", "priority")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    KV_DESTINATION_FIELD_NUMBER: _ClassVar[int]
    NUM_REPLAYED_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    kv_destination: str
    num_replayed: int
    priority: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., kv_destination: _Optional[str] = ..., num_replayed: _Optional[int] = ..., priority: _Optional[int] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("outcome", "error", "retryable", "first_token", "num_cached_tokens", "num_transfer_bytes", "transfer_s", "prompt_logprobs", "num_transfer_chunks", "link_gbps")
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    RETRYABLE_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_TRANSFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_S_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NUM_TRANSFER_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    LINK_GBPS_FIELD_NUMBER: _ClassVar[int]
    outcome: TransferOutcome
    error: str
    retryable: bool
    first_token: int
    num_cached_tokens: int
    num_transfer_bytes: int
    transfer_s: float
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[WorkerTokenLogprobs]
    num_transfer_chunks: int
    link_gbps: float
    def __init__(self, outcome: _Optional[_Union[TransferOutcome, str]] = ..., error: _Optional[str] = ..., retryable: _Optional[bool] = ..., first_token: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., num_transfer_bytes: _Optional[int] = ..., transfer_s: _Optional[float] = ..., prompt_logprobs: _Optional[_Iterable[_Union[WorkerTokenLogprobs, _Mapping]]] = ..., num_transfer_chunks: _Optional[int] = ..., link_gbps: _Optional[float] = ...) -> None: ...

class LoadRequest(_message.Message):
    __slots__ = ("since_event",)
    SINCE_EVENT_FIELD_NUMBER: _ClassVar[int]
    since_event: int
    def __init__(self, since_event: _Optional[int] = ...) -> None: ...

class PrefillLoad(_message.Message):
    __slots__ = ("worker_id", "num_waiting", "num_running", "num_transferring", "num_queued_tokens", "num_free_blocks", "num_blocks", "block_size", "last_event", "snapshot", "stored_hashes", "removed_hashes", "deterministic", "stats")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_TRANSFERRING_FIELD_NUMBER: _ClassVar[int]
    NUM_QUEUED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    LAST_EVENT_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    STORED_HASHES_FIELD_NUMBER: _ClassVar[int]
    REMOVED_HASHES_FIELD_NUMBER: _ClassVar[int]
    DETERMINISTIC_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    num_waiting: int
    num_running: int
    num_transferring: int
    num_queued_tokens: int
    num_free_blocks: int
    num_blocks: int
    block_size: int
    last_event: int
    snapshot: bool
    stored_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    removed_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    deterministic: bool
    stats: WorkerStats
    def __init__(self, worker_id: _Optional[str] = ..., num_waiting: _Optional[int] = ..., num_running: _Optional[int] = ..., num_transferring: _Optional[int] = ..., num_queued_tokens: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., num_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., last_event: _Optional[int] = ..., snapshot: _Optional[bool] = ..., stored_hashes: _Optional[_Iterable[bytes]] = ..., removed_hashes: _Optional[_Iterable[bytes]] = ..., deterministic: _Optional[bool] = ..., stats: _Optional[_Union[WorkerStats, _Mapping]] = ...) -> None: ...

class WorkerStats(_message.Message):
    __slots__ = ("iteration_token_counts", "iteration_tokens_sum", "speculating", "spec_num_drafts", "spec_num_draft_tokens", "spec_num_accepted_tokens", "spec_num_accepted_tokens_per_pos", "moe_expert_tokens", "moe_expert_imbalance")
    ITERATION_TOKEN_COUNTS_FIELD_NUMBER: _ClassVar[int]
    ITERATION_TOKENS_SUM_FIELD_NUMBER: _ClassVar[int]
    SPECULATING_FIELD_NUMBER: _ClassVar[int]
    SPEC_NUM_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    SPEC_NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_NUM_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_NUM_ACCEPTED_TOKENS_PER_POS_FIELD_NUMBER: _ClassVar[int]
    MOE_EXPERT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MOE_EXPERT_IMBALANCE_FIELD_NUMBER: _ClassVar[int]
    iteration_token_counts: _containers.RepeatedScalarFieldContainer[int]
    iteration_tokens_sum: int
    speculating: bool
    spec_num_drafts: int
    spec_num_draft_tokens: int
    spec_num_accepted_tokens: int
    spec_num_accepted_tokens_per_pos: _containers.RepeatedScalarFieldContainer[int]
    moe_expert_tokens: _containers.RepeatedScalarFieldContainer[int]
    moe_expert_imbalance: float
    def __init__(self, iteration_token_counts: _Optional[_Iterable[int]] = ..., iteration_tokens_sum: _Optional[int] = ..., speculating: _Optional[bool] = ..., spec_num_drafts: _Optional[int] = ..., spec_num_draft_tokens: _Optional[int] = ..., spec_num_accepted_tokens: _Optional[int] = ..., spec_num_accepted_tokens_per_pos: _Optional[_Iterable[int]] = ..., moe_expert_tokens: _Optional[_Iterable[int]] = ..., moe_expert_imbalance: _Optional[float] = ...) -> None: ...

class DecodeRemoteRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "kv_wait_s", "num_replayed", "stream_id", "priority")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    KV_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    NUM_REPLAYED_FIELD_NUMBER: _ClassVar[int]
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    kv_wait_s: float
    num_replayed: int
    stream_id: str
    priority: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., kv_wait_s: _Optional[float] = ..., num_replayed: _Optional[int] = ..., stream_id: _Optional[str] = ..., priority: _Optional[int] = ...) -> None: ...

class LocalGenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "num_replayed", "stream_id", "priority")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    NUM_REPLAYED_FIELD_NUMBER: _ClassVar[int]
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    num_replayed: int
    stream_id: str
    priority: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., num_replayed: _Optional[int] = ..., stream_id: _Optional[str] = ..., priority: _Optional[int] = ...) -> None: ...

class OutputsRequest(_message.Message):
    __slots__ = ("stream_id",)
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    stream_id: str
    def __init__(self, stream_id: _Optional[str] = ...) -> None: ...

class OutputBatch(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[RequestOutputItem]
    def __init__(self, items: _Optional[_Iterable[_Union[RequestOutputItem, _Mapping]]] = ...) -> None: ...

class RequestOutputItem(_message.Message):
    __slots__ = ("request_id", "output", "error")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    output: OutputDelta
    error: RequestError
    def __init__(self, request_id: _Optional[str] = ..., output: _Optional[_Union[OutputDelta, _Mapping]] = ..., error: _Optional[_Union[RequestError, _Mapping]] = ...) -> None: ...

class RequestError(_message.Message):
    __slots__ = ("code", "details")
    CODE_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    code: int
    details: str
    def __init__(self, code: _Optional[int] = ..., details: _Optional[str] = ...) -> None: ...

class Started(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AbortDecodeRequest(_message.Message):
    __slots__ = ("request_id", "stream_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    stream_id: str
    def __init__(self, request_id: _Optional[str] = ..., stream_id: _Optional[str] = ...) -> None: ...

class Aborted(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Reserved(_message.Message):
    __slots__ = ("kv_address", "num_blocks")
    KV_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    kv_address: str
    num_blocks: int
    def __init__(self, kv_address: _Optional[str] = ..., num_blocks: _Optional[int] = ...) -> None: ...

class WorkerLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "rank")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    rank: int
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., rank: _Optional[int] = ...) -> None: ...

class WorkerTokenLogprobs(_message.Message):
    __slots__ = ("sampled", "top")
    SAMPLED_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    sampled: WorkerLogprob
    top: _containers.RepeatedCompositeFieldContainer[WorkerLogprob]
    def __init__(self, sampled: _Optional[_Union[WorkerLogprob, _Mapping]] = ..., top: _Optional[_Iterable[_Union[WorkerLogprob, _Mapping]]] = ...) -> None: ...

class OutputDelta(_message.Message):
    __slots__ = ("token_ids", "logprobs", "finish_reason", "stop_token_id", "num_cached_tokens", "embedding")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[WorkerTokenLogprobs]
    finish_reason: str
    stop_token_id: int
    num_cached_tokens: int
    embedding: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[WorkerTokenLogprobs, _Mapping]]] = ..., finish_reason: _Optional[str] = ..., stop_token_id: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., embedding: _Optional[_Iterable[float]] = ...) -> None: ...

class DecodeLoad(_message.Message):
    __slots__ = ("worker_id", "num_running", "num_waiting", "num_waiting_for_kv", "num_free_blocks", "num_blocks", "max_num_seqs", "block_size", "kv_address", "deterministic", "stats", "ngram")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FOR_KV_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DETERMINISTIC_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    NGRAM_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    num_running: int
    num_waiting: int
    num_waiting_for_kv: int
    num_free_blocks: int
    num_blocks: int
    max_num_seqs: int
    block_size: int
    kv_address: str
    deterministic: bool
    stats: WorkerStats
    ngram: bool
    def __init__(self, worker_id: _Optional[str] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_waiting_for_kv: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., num_blocks: _Optional[int] = ..., max_num_seqs: _Optional[int] = ..., block_size: _Optional[int] = ..., kv_address: _Optional[str] = ..., deterministic: _Optional[bool] = ..., stats: _Optional[_Union[WorkerStats, _Mapping]] = ..., ngram: _Optional[bool] = ...) -> None: ...
