from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model_name", "architecture", "max_model_len", "vocab_size", "eos_token_ids", "dtype", "lora_enabled", "max_lora_rank", "lora_adapters", "task", "embedding_dimensions", "quantization")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    LORA_ENABLED_FIELD_NUMBER: _ClassVar[int]
    MAX_LORA_RANK_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_DIMENSIONS_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    architecture: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    lora_enabled: bool
    max_lora_rank: int
    lora_adapters: _containers.RepeatedCompositeFieldContainer[LoraAdapterInfo]
    task: str
    embedding_dimensions: int
    quantization: str
    def __init__(self, model_name: _Optional[str] = ..., architecture: _Optional[str] = ..., max_model_len: _Optional[int] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., lora_enabled: _Optional[bool] = ..., max_lora_rank: _Optional[int] = ..., lora_adapters: _Optional[_Iterable[_Union[LoraAdapterInfo, _Mapping]]] = ..., task: _Optional[str] = ..., embedding_dimensions: _Optional[int] = ..., quantization: _Optional[str] = ...) -> None: ...

class LoraAdapterInfo(_message.Message):
    __slots__ = ("name", "path", "rank")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    rank: int
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ..., rank: _Optional[int] = ...) -> None: ...

class GetServerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Peer(_message.Message):
    __slots__ = ("id", "address")
    ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    id: str
    address: str
    def __init__(self, id: _Optional[str] = ..., address: _Optional[str] = ...) -> None: ...

class ServerInfo(_message.Message):
    __slots__ = ("block_size", "kv_blocks_total", "kv_blocks_free", "num_running", "num_waiting", "frontends", "engines", "version")
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    FRONTENDS_FIELD_NUMBER: _ClassVar[int]
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    block_size: int
    kv_blocks_total: int
    kv_blocks_free: int
    num_running: int
    num_waiting: int
    frontends: _containers.RepeatedCompositeFieldContainer[Peer]
    engines: _containers.RepeatedCompositeFieldContainer[Peer]
    version: str
    def __init__(self, block_size: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ..., kv_blocks_free: _Optional[int] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., frontends: _Optional[_Iterable[_Union[Peer, _Mapping]]] = ..., engines: _Optional[_Iterable[_Union[Peer, _Mapping]]] = ..., version: _Optional[str] = ...) -> None: ...
