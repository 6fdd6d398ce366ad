"""What the engine reports each step, as both sides of the socket hold it: an output per
sample that got tokens (EngineCoreOutput), and the step's plain tokens packed (PlainTokens).
common.ipc turns them into the engine_ipc protos and back."""

from __future__ import annotations

from dataclasses import dataclass, field


def sample_request_id(parent_id: str, index: int) -> str:
    """The engine-internal id of sample `index` of an n>1 request."""
    return f"{parent_id}/{index}"


@dataclass(slots=True)
class EngineCoreOutput:
    """New tokens of one sample of one request, as the engine reports them each step."""

    request_id: str  # the caller's id
    sample_index: int
    new_token_ids: list[int]
    new_logprobs: list[dict[int, float]] | None
    # "stop" | "length" | "abort"; "invalid" (the caller's to fix, maybe after some tokens: its
    # grammar did not compile, or the vocabulary can't write it) or "error" (it failed on the
    # way, the engine's fault), with `error` saying why.
    finish_reason: str | None = None
    stop_token_id: int | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    # With SamplingParams.prompt_logprobs: one entry per prompt token (position 0: None), on
    # the request's first output only.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # Alongside prompt_logprobs only: the prompt tokens they score, for output_to_proto.
    prompt_token_ids: list[int] | None = None
    error: str | None = None
    pooled: list[float] | None = None  # a pooling request's vector (or a cross-encoder's logits), with its finish

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def plain_output(request_id: str, token_id: int, num_cached_tokens: int) -> EngineCoreOutput:
    """A plain token (see PlainTokens) as an EngineCoreOutput. Positional: this may run for
    most requests every step (a slots dataclass from keywords costs 3x)."""
    return EngineCoreOutput(request_id, 0, [token_id], None, None, None, 0, num_cached_tokens)


@dataclass(slots=True)
class PlainTokens:
    """A step's plain tokens, packed: one new token of sample 0 of a request that goes on, with
    no logprobs, which is most outputs of most steps. Three parallel lists instead of an
    EngineCoreOutput each (`EngineCore.step_packed`); `num_prompt_tokens` is not carried (the
    reader has the prompt)."""

    request_ids: list[str] = field(default_factory=list)  # the callers' ids
    token_ids: list[int] = field(default_factory=list)
    num_cached_tokens: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.token_ids)

    def add(self, request_ids: list[str], token_ids: list[int], num_cached_tokens: list[int]) -> None:
        self.request_ids += request_ids
        self.token_ids += token_ids
        self.num_cached_tokens += num_cached_tokens
