from . import generation_pb2 as _generation_pb2
from . import info_pb2 as _info_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EngineRequest(_message.Message):
    __slots__ = ("hello", "add", "abort", "ping", "bye", "load_lora", "unload_lora", "admin")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    ADD_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    PING_FIELD_NUMBER: _ClassVar[int]
    BYE_FIELD_NUMBER: _ClassVar[int]
    LOAD_LORA_FIELD_NUMBER: _ClassVar[int]
    UNLOAD_LORA_FIELD_NUMBER: _ClassVar[int]
    ADMIN_FIELD_NUMBER: _ClassVar[int]
    hello: Hello
    add: AddRequest
    abort: AbortRequests
    ping: Ping
    bye: Bye
    load_lora: LoadLora
    unload_lora: UnloadLora
    admin: AdminOp
    def __init__(self, hello: _Optional[_Union[Hello, _Mapping]] = ..., add: _Optional[_Union[AddRequest, _Mapping]] = ..., abort: _Optional[_Union[AbortRequests, _Mapping]] = ..., ping: _Optional[_Union[Ping, _Mapping]] = ..., bye: _Optional[_Union[Bye, _Mapping]] = ..., load_lora: _Optional[_Union[LoadLora, _Mapping]] = ..., unload_lora: _Optional[_Union[UnloadLora, _Mapping]] = ..., admin: _Optional[_Union[AdminOp, _Mapping]] = ...) -> None: ...

class Hello(_message.Message):
    __slots__ = ("frontend_id", "address")
    FRONTEND_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    frontend_id: str
    address: str
    def __init__(self, frontend_id: _Optional[str] = ..., address: _Optional[str] = ...) -> None: ...

class AddRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "priority", "structured_outputs", "lora_name", "bad_words_token_ids", "pooling", "images")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    BAD_WORDS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    POOLING_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _generation_pb2.SamplingParams
    priority: int
    structured_outputs: StructuredOutputs
    lora_name: str
    bad_words_token_ids: _containers.RepeatedCompositeFieldContainer[_generation_pb2.TokenIds]
    pooling: Pooling
    images: _containers.RepeatedCompositeFieldContainer[ImageInput]
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_generation_pb2.SamplingParams, _Mapping]] = ..., priority: _Optional[int] = ..., structured_outputs: _Optional[_Union[StructuredOutputs, _Mapping]] = ..., lora_name: _Optional[str] = ..., bad_words_token_ids: _Optional[_Iterable[_Union[_generation_pb2.TokenIds, _Mapping]]] = ..., pooling: _Optional[_Union[Pooling, _Mapping]] = ..., images: _Optional[_Iterable[_Union[ImageInput, _Mapping]]] = ...) -> None: ...

class ImageInput(_message.Message):
    __slots__ = ("pixels", "shape", "grid", "hash", "offset", "length")
    PIXELS_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    GRID_FIELD_NUMBER: _ClassVar[int]
    HASH_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    pixels: bytes
    shape: _containers.RepeatedScalarFieldContainer[int]
    grid: _containers.RepeatedScalarFieldContainer[int]
    hash: str
    offset: int
    length: int
    def __init__(self, pixels: _Optional[bytes] = ..., shape: _Optional[_Iterable[int]] = ..., grid: _Optional[_Iterable[int]] = ..., hash: _Optional[str] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class MultiModalInfo(_message.Message):
    __slots__ = ("model_type", "preprocessor_config", "image_token_id", "tokens_per_image")
    MODEL_TYPE_FIELD_NUMBER: _ClassVar[int]
    PREPROCESSOR_CONFIG_FIELD_NUMBER: _ClassVar[int]
    IMAGE_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_IMAGE_FIELD_NUMBER: _ClassVar[int]
    model_type: str
    preprocessor_config: str
    image_token_id: int
    tokens_per_image: int
    def __init__(self, model_type: _Optional[str] = ..., preprocessor_config: _Optional[str] = ..., image_token_id: _Optional[int] = ..., tokens_per_image: _Optional[int] = ...) -> None: ...

class Pooling(_message.Message):
    __slots__ = ("token_type_start",)
    TOKEN_TYPE_START_FIELD_NUMBER: _ClassVar[int]
    token_type_start: int
    def __init__(self, token_type_start: _Optional[int] = ...) -> None: ...

class Pooler(_message.Message):
    __slots__ = ("task", "mode", "normalize", "dimensions", "matryoshka", "max_tokens", "sigmoid")
    TASK_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    NORMALIZE_FIELD_NUMBER: _ClassVar[int]
    DIMENSIONS_FIELD_NUMBER: _ClassVar[int]
    MATRYOSHKA_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SIGMOID_FIELD_NUMBER: _ClassVar[int]
    task: str
    mode: str
    normalize: bool
    dimensions: int
    matryoshka: bool
    max_tokens: int
    sigmoid: bool
    def __init__(self, task: _Optional[str] = ..., mode: _Optional[str] = ..., normalize: _Optional[bool] = ..., dimensions: _Optional[int] = ..., matryoshka: _Optional[bool] = ..., max_tokens: _Optional[int] = ..., sigmoid: _Optional[bool] = ...) -> None: ...

class LoraAdapter(_message.Message):
    __slots__ = ("name", "path", "rank")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    rank: int
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ..., rank: _Optional[int] = ...) -> None: ...

class LoadLora(_message.Message):
    __slots__ = ("op_id", "name", "path")
    OP_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    op_id: str
    name: str
    path: str
    def __init__(self, op_id: _Optional[str] = ..., name: _Optional[str] = ..., path: _Optional[str] = ...) -> None: ...

class UnloadLora(_message.Message):
    __slots__ = ("op_id", "name")
    OP_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    op_id: str
    name: str
    def __init__(self, op_id: _Optional[str] = ..., name: _Optional[str] = ...) -> None: ...

class AdminOp(_message.Message):
    __slots__ = ("op_id", "kind", "level", "model_path")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_SLEEP: _ClassVar[AdminOp.Kind]
        KIND_WAKE_UP: _ClassVar[AdminOp.Kind]
        KIND_UPDATE_WEIGHTS: _ClassVar[AdminOp.Kind]
    KIND_SLEEP: AdminOp.Kind
    KIND_WAKE_UP: AdminOp.Kind
    KIND_UPDATE_WEIGHTS: AdminOp.Kind
    OP_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    op_id: str
    kind: AdminOp.Kind
    level: int
    model_path: str
    def __init__(self, op_id: _Optional[str] = ..., kind: _Optional[_Union[AdminOp.Kind, str]] = ..., level: _Optional[int] = ..., model_path: _Optional[str] = ...) -> None: ...

class AdminResult(_message.Message):
    __slots__ = ("op_id", "ok", "message", "sleep_level")
    OP_ID_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    SLEEP_LEVEL_FIELD_NUMBER: _ClassVar[int]
    op_id: str
    ok: bool
    message: str
    sleep_level: int
    def __init__(self, op_id: _Optional[str] = ..., ok: _Optional[bool] = ..., message: _Optional[str] = ..., sleep_level: _Optional[int] = ...) -> None: ...

class StructuredOutputs(_message.Message):
    __slots__ = ("json", "json_object", "regex", "choice", "grammar", "starts_after")
    JSON_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    STARTS_AFTER_FIELD_NUMBER: _ClassVar[int]
    json: str
    json_object: bool
    regex: str
    choice: _generation_pb2.Choices
    grammar: str
    starts_after: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, json: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., choice: _Optional[_Union[_generation_pb2.Choices, _Mapping]] = ..., grammar: _Optional[str] = ..., starts_after: _Optional[_Iterable[int]] = ...) -> None: ...

class AbortRequests(_message.Message):
    __slots__ = ("request_ids", "stop_string")
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    STOP_STRING_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    stop_string: bool
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ..., stop_string: _Optional[bool] = ...) -> None: ...

class Ping(_message.Message):
    __slots__ = ("seq",)
    SEQ_FIELD_NUMBER: _ClassVar[int]
    seq: int
    def __init__(self, seq: _Optional[int] = ...) -> None: ...

class Bye(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EngineResponse(_message.Message):
    __slots__ = ("welcome", "outputs", "pong", "error", "lora_result", "admin_result")
    WELCOME_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    PONG_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    LORA_RESULT_FIELD_NUMBER: _ClassVar[int]
    ADMIN_RESULT_FIELD_NUMBER: _ClassVar[int]
    welcome: Welcome
    outputs: OutputBatch
    pong: Pong
    error: RequestError
    lora_result: LoraResult
    admin_result: AdminResult
    def __init__(self, welcome: _Optional[_Union[Welcome, _Mapping]] = ..., outputs: _Optional[_Union[OutputBatch, _Mapping]] = ..., pong: _Optional[_Union[Pong, _Mapping]] = ..., error: _Optional[_Union[RequestError, _Mapping]] = ..., lora_result: _Optional[_Union[LoraResult, _Mapping]] = ..., admin_result: _Optional[_Union[AdminResult, _Mapping]] = ...) -> None: ...

class LoraResult(_message.Message):
    __slots__ = ("op_id", "kind", "message", "adapters")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_OK: _ClassVar[LoraResult.Kind]
        KIND_INVALID: _ClassVar[LoraResult.Kind]
        KIND_NOT_FOUND: _ClassVar[LoraResult.Kind]
        KIND_CONFLICT: _ClassVar[LoraResult.Kind]
    KIND_OK: LoraResult.Kind
    KIND_INVALID: LoraResult.Kind
    KIND_NOT_FOUND: LoraResult.Kind
    KIND_CONFLICT: LoraResult.Kind
    OP_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    op_id: str
    kind: LoraResult.Kind
    message: str
    adapters: _containers.RepeatedCompositeFieldContainer[LoraAdapter]
    def __init__(self, op_id: _Optional[str] = ..., kind: _Optional[_Union[LoraResult.Kind, str]] = ..., message: _Optional[str] = ..., adapters: _Optional[_Iterable[_Union[LoraAdapter, _Mapping]]] = ...) -> None: ...

class Welcome(_message.Message):
    __slots__ = ("engine_id", "model_name", "architecture", "max_model_len", "vocab_size", "eos_token_ids", "block_size", "kv_blocks_total", "dtype", "device", "model_path", "tokenizer_files", "lora_enabled", "max_lora_rank", "max_loras", "lora_adapters", "sampling_defaults", "pooler", "quantization", "multimodal")
    class TokenizerFilesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: bytes
        def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FILES_FIELD_NUMBER: _ClassVar[int]
    LORA_ENABLED_FIELD_NUMBER: _ClassVar[int]
    MAX_LORA_RANK_FIELD_NUMBER: _ClassVar[int]
    MAX_LORAS_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_DEFAULTS_FIELD_NUMBER: _ClassVar[int]
    POOLER_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    MULTIMODAL_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    model_name: str
    architecture: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    block_size: int
    kv_blocks_total: int
    dtype: str
    device: str
    model_path: str
    tokenizer_files: _containers.ScalarMap[str, bytes]
    lora_enabled: bool
    max_lora_rank: int
    max_loras: int
    lora_adapters: _containers.RepeatedCompositeFieldContainer[LoraAdapter]
    sampling_defaults: _generation_pb2.SamplingParams
    pooler: Pooler
    quantization: str
    multimodal: MultiModalInfo
    def __init__(self, engine_id: _Optional[str] = ..., model_name: _Optional[str] = ..., architecture: _Optional[str] = ..., max_model_len: _Optional[int] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., block_size: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., model_path: _Optional[str] = ..., tokenizer_files: _Optional[_Mapping[str, bytes]] = ..., lora_enabled: _Optional[bool] = ..., max_lora_rank: _Optional[int] = ..., max_loras: _Optional[int] = ..., lora_adapters: _Optional[_Iterable[_Union[LoraAdapter, _Mapping]]] = ..., sampling_defaults: _Optional[_Union[_generation_pb2.SamplingParams, _Mapping]] = ..., pooler: _Optional[_Union[Pooler, _Mapping]] = ..., quantization: _Optional[str] = ..., multimodal: _Optional[_Union[MultiModalInfo, _Mapping]] = ...) -> None: ...

class EngineStats(_message.Message):
    __slots__ = ("num_running", "num_waiting", "kv_blocks_total", "kv_blocks_free", "num_preemptions", "prefix_cache_queries", "prefix_cache_hits", "kv_offload_hits", "kv_offload_saved_bytes", "kv_offload_restored_bytes", "kv_offload_restore_seconds")
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    KV_OFFLOAD_HITS_FIELD_NUMBER: _ClassVar[int]
    KV_OFFLOAD_SAVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_OFFLOAD_RESTORED_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_OFFLOAD_RESTORE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    num_running: int
    num_waiting: int
    kv_blocks_total: int
    kv_blocks_free: int
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    kv_offload_hits: int
    kv_offload_saved_bytes: int
    kv_offload_restored_bytes: int
    kv_offload_restore_seconds: float
    def __init__(self, num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ..., kv_blocks_free: _Optional[int] = ..., num_preemptions: _Optional[int] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ..., kv_offload_hits: _Optional[int] = ..., kv_offload_saved_bytes: _Optional[int] = ..., kv_offload_restored_bytes: _Optional[int] = ..., kv_offload_restore_seconds: _Optional[float] = ...) -> None: ...

class OutputBatch(_message.Message):
    __slots__ = ("outputs", "stats", "token_request_ids", "token_ids", "token_num_cached_tokens")
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    outputs: _containers.RepeatedCompositeFieldContainer[RequestOutput]
    stats: EngineStats
    token_request_ids: _containers.RepeatedScalarFieldContainer[str]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    token_num_cached_tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, outputs: _Optional[_Iterable[_Union[RequestOutput, _Mapping]]] = ..., stats: _Optional[_Union[EngineStats, _Mapping]] = ..., token_request_ids: _Optional[_Iterable[str]] = ..., token_ids: _Optional[_Iterable[int]] = ..., token_num_cached_tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class RequestOutput(_message.Message):
    __slots__ = ("request_id", "sample_index", "new_token_ids", "logprobs", "finish_reason", "stop_token_id", "num_prompt_tokens", "num_cached_tokens", "prompt_logprobs", "error", "pooled")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_INDEX_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    POOLED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    sample_index: int
    new_token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_generation_pb2.PositionLogprobs]
    finish_reason: str
    stop_token_id: int
    num_prompt_tokens: int
    num_cached_tokens: int
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_generation_pb2.PositionLogprobs]
    error: str
    pooled: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, request_id: _Optional[str] = ..., sample_index: _Optional[int] = ..., new_token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_generation_pb2.PositionLogprobs, _Mapping]]] = ..., finish_reason: _Optional[str] = ..., stop_token_id: _Optional[int] = ..., num_prompt_tokens: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_generation_pb2.PositionLogprobs, _Mapping]]] = ..., error: _Optional[str] = ..., pooled: _Optional[_Iterable[float]] = ...) -> None: ...

class Pong(_message.Message):
    __slots__ = ("seq", "stats", "frontends", "engine_id", "draining", "lora_names", "sleep_level")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    FRONTENDS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    LORA_NAMES_FIELD_NUMBER: _ClassVar[int]
    SLEEP_LEVEL_FIELD_NUMBER: _ClassVar[int]
    seq: int
    stats: EngineStats
    frontends: _containers.RepeatedCompositeFieldContainer[_info_pb2.Peer]
    engine_id: str
    draining: bool
    lora_names: _containers.RepeatedScalarFieldContainer[str]
    sleep_level: int
    def __init__(self, seq: _Optional[int] = ..., stats: _Optional[_Union[EngineStats, _Mapping]] = ..., frontends: _Optional[_Iterable[_Union[_info_pb2.Peer, _Mapping]]] = ..., engine_id: _Optional[str] = ..., draining: _Optional[bool] = ..., lora_names: _Optional[_Iterable[str]] = ..., sleep_level: _Optional[int] = ...) -> None: ...

class RequestError(_message.Message):
    __slots__ = ("request_id", "message", "kind")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_INVALID: _ClassVar[RequestError.Kind]
        KIND_OVERLOADED: _ClassVar[RequestError.Kind]
        KIND_NOT_FOUND: _ClassVar[RequestError.Kind]
    KIND_INVALID: RequestError.Kind
    KIND_OVERLOADED: RequestError.Kind
    KIND_NOT_FOUND: RequestError.Kind
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    message: str
    kind: RequestError.Kind
    def __init__(self, request_id: _Optional[str] = ..., message: _Optional[str] = ..., kind: _Optional[_Union[RequestError.Kind, str]] = ...) -> None: ...
