"""The messages passed inside one engine step. What leaves it (EngineCoreOutput,
PlainTokens) is common.outputs', shared with the frontend.

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
    # The prefix cache's second tier (engine/kv_offload), before the forward: cached blocks
    # popped for reuse are saved (block_id, slot) first, then restores (slot, block_id) fill
    # fresh blocks of prefixes it held.
    kv_saves: list[tuple[int, int]] = field(default_factory=list)
    kv_restores: list[tuple[int, int]] = field(default_factory=list)
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
    # Pooling requests (task embed / score) whose prompt ran this step: request id -> its vector.
    pooled: dict[str, list[float]] = field(default_factory=dict)
