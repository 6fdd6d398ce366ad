from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class SleepRequest(_message.Message):
    __slots__ = ("level",)
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    level: int
    def __init__(self, level: _Optional[int] = ...) -> None: ...

class WakeUpRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class IsSleepingRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class UpdateWeightsRequest(_message.Message):
    __slots__ = ("model_path",)
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    model_path: str
    def __init__(self, model_path: _Optional[str] = ...) -> None: ...

class SleepState(_message.Message):
    __slots__ = ("is_sleeping", "level")
    IS_SLEEPING_FIELD_NUMBER: _ClassVar[int]
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    is_sleeping: bool
    level: int
    def __init__(self, is_sleeping: _Optional[bool] = ..., level: _Optional[int] = ...) -> None: ...
