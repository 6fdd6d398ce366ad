"""How a request can be refused or fail, shared by the engine and every frontend API.

Each protocol maps them once: `InvalidRequest` -> gRPC INVALID_ARGUMENT / HTTP 400,
`EngineOverloaded` -> RESOURCE_EXHAUSTED / 429, `Unavailable` -> UNAVAILABLE / 503,
`RequestFailed` -> INTERNAL / 500 with its message. Any other exception is a bug, never the
caller's fault: it must not be reported as a bad request. `ModelError` is the one raised
before anything serves: a model or tokenizer named that cannot be used.
"""

from __future__ import annotations


class InvalidRequest(ValueError):
    """The request can never run as given; the message names the field and what is allowed.
    A ValueError, so `SamplingParams(...)` in user code raises what Python users expect."""


class EngineOverloaded(Exception):
    """The engine's waiting queue is full; the request may be retried later."""


class RequestFailed(Exception):
    """The engine ended the request part-way for a reason it can name (it sampled a token its
    grammar's mask forbade). Not the caller's fault; the message says what happened. (A grammar
    the model's vocabulary cannot write is the caller's: InvalidRequest, even part-way.)"""


class Unavailable(Exception):
    """No engine can take the request now: none is connected, it was lost, or the server is
    draining for shutdown (gRPC UNAVAILABLE / HTTP 503). Retry later or on another replica."""


class LoraError(InvalidRequest):
    """A LoRA adapter operation or a request naming an adapter was refused. `kind` says why:
    "invalid" (unreadable adapter, rank above --max-lora-rank, LoRA off), "not_found" (no
    adapter of that name: 404 / NOT_FOUND), "conflict" (the name is taken, or requests still
    use the adapter being unloaded). An InvalidRequest, so offline callers get a ValueError."""

    def __init__(self, message: str, kind: str = "invalid") -> None:
        super().__init__(message)
        self.kind = kind


class ModelError(ValueError):
    """A model or tokenizer named that cannot be used. The message names the field, the name,
    the problem and what is accepted. A ValueError, as the offline `LLM`'s users expect."""

    def __init__(self, reason: str, name: str | None = None, field: str = "model") -> None:
        super().__init__(f"{field} {name!r}: {reason}" if name is not None else f"{field}: {reason}")
        self.reason, self.name, self.field = reason, name, field

    def as_flag(self) -> str:
        """The message as the command line names things: `--speculative-model PATH: reason`."""
        flag = "--" + self.field.replace("_", "-")
        return f"{flag} {self.name}: {self.reason}" if self.name is not None else f"{flag}: {self.reason}"
