"""The messages passed inside one engine step, and out of it.

    Scheduler --SchedulerOutput--> ModelRunner --ModelRunnerOutput--> Scheduler
                                                         --list[EngineCoreOutput]--> caller
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.request import Request


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step."""

    request: Request
    num_new_tokens: int  # tokens to compute, from request.num_computed_tokens on
    block_ids: list[int]  # the request's whole block table after this step's allocation
    num_samples: int  # 0: a prefill chunk short of the end; n: a prompt forking n samples; else 1
    # Speculative decoding: draft tokens verified this step, after the request's last token
    # (num_new_tokens counts them). The scheduler's update sets how many were accepted.
    spec_token_ids: list[int] = field(default_factory=list)
    num_accepted_tokens: int = 0


@dataclass
class SchedulerOutput:
    """What to run this step. Decodes and prefill chunks share one list."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    # The first num_steady entries are steady decodes: one token each (the request's last,
    # at position num_computed_tokens), one sample, no drafts.
    num_steady: int = 0
    steady_requests: list[Request] = field(default_factory=list)  # their requests, in order
    # Scheduler.num_finished when this step was scheduled: unchanged at its update, none of its
    # requests has ended since (-1: unknown).
    num_finished: int = -1
    num_batched_tokens: int = 0
    # Copy-on-write block copies (src, dst) that must happen before the forward.
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    # Requests that ended since the last step: whoever keeps per-request state (the speculator,
    # a draft model's KV bookkeeping) drops it.
    finished_request_ids: set[str] = field(default_factory=set)
    num_preempted: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class ModelRunnerOutput:
    """Sampled tokens for each request that reached the end of its tokens this step."""

    request_ids: list[str] = field(default_factory=list)
    # n tokens for a forking prompt's n samples; with drafts, the accepted ones then one more; else 1
    token_ids: list[list[int]] = field(default_factory=list)
    logprobs: list[list[dict[int, float] | None]] = field(default_factory=list)
    # Requests scoring their prompt this step (params.prompt_logprobs): one entry per prompt
    # position this chunk reached, in order (a chunk's rows predict positions start+1..).
    prompt_logprobs: dict[str, list[dict[int, float]]] = field(default_factory=dict)
    # Wall time of the forward and of sampling, for metrics. On CUDA the forward is only
    # launched when its time is taken, so the wait for it shows up in sample_s.
    model_s: float = 0.0
    sample_s: float = 0.0
    grammar_s: float | None = None  # structured output's bitmask (within sample_s); None: no constrained row
    # The steady decodes' tokens (SchedulerOutput.scheduled[:len(steady_token_ids)]), one
    # each; the fields above hold the other requests. steady_logprobs: one entry (or None)
    # each, or None when no row asked.
    steady_token_ids: list[int] = field(default_factory=list)
    steady_logprobs: list[dict[int, float] | None] | None = None


@dataclass(slots=True)
class EngineCoreOutput:
    """New tokens of one sample of one request, as the engine reports them each step."""

    request_id: str  # the caller's id
    sample_index: int
    new_token_ids: list[int]
    new_logprobs: list[dict[int, float]] | None
    # "stop" | "length" | "abort"; "invalid" (its grammar did not compile) or "error" (it
    # failed on the way), with `error` saying why.
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
