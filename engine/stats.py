"""What the engine did between two metric scrapes: step times, token counts, request latencies.

The scheduler and the core add to an `IterationStats` as they work; the process wrapper
takes it (`EngineCore.take_iteration_stats`) after each loop and turns it into Prometheus
metrics. Nothing here does I/O. Latencies are engine-side, from the request's arrival at
the engine; a sample of an n>1 request counts as a request, as in vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.request import Request


@dataclass(slots=True)
class FinishedRequestStats:
    finish_reason: str  # "stop" | "length" | "abort" | "error"
    num_prompt_tokens: int
    num_generation_tokens: int
    queue_s: float | None  # arrival -> first scheduled; None if it never ran
    e2e_s: float  # arrival -> finished


@dataclass
class SpecDecodingStats:
    """Speculative decoding's totals since start, as vLLM counts them: a draft is one request's
    verification step with drafts; position i counts drafts accepted at draft slot i."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_draft_tokens:
            self.accepted_per_position += [0] * (num_draft_tokens - len(self.accepted_per_position))
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1

    def copy(self) -> SpecDecodingStats:
        return SpecDecodingStats(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                                 list(self.accepted_per_position))


@dataclass
class IterationStats:
    """Accumulates until taken; every list holds one value per event."""

    schedule_s: list[float] = field(default_factory=list)  # one per step
    model_s: list[float] = field(default_factory=list)
    sample_s: list[float] = field(default_factory=list)
    grammar_s: list[float] = field(default_factory=list)  # bitmask fill + apply, in steps that had one
    iteration_tokens: list[int] = field(default_factory=list)  # tokens computed per step
    num_prompt_tokens: int = 0  # of requests whose first token came out
    num_generation_tokens: int = 0
    ttfts_s: list[float] = field(default_factory=list)
    itls_s: list[float] = field(default_factory=list)
    finished: list[FinishedRequestStats] = field(default_factory=list)

    def observe_step(self, schedule_s: float, model_s: float, sample_s: float, num_tokens: int,
                     grammar_s: float | None = None) -> None:
        self.schedule_s.append(schedule_s)
        if grammar_s is not None:
            self.grammar_s.append(grammar_s)
        self.model_s.append(model_s)
        self.sample_s.append(sample_s)
        self.iteration_tokens.append(num_tokens)

    def observe_token(self, request: Request, now: float, first_of_step: bool = True) -> None:
        """Call before the token is appended to the request. The tokens a step gives one
        request at once (speculative decoding's accepted run) count, but only the first is
        timed: one inter-token latency per step, as vLLM records them."""
        self.num_generation_tokens += 1
        if not first_of_step:
            return
        if request.last_token_time is None:
            self.num_prompt_tokens += request.num_prompt_tokens
            self.ttfts_s.append(now - request.arrival_time)
        else:
            self.itls_s.append(now - request.last_token_time)

    def observe_decodes(self, requests: list[Request], now: float) -> None:
        """`observe_token` for requests that get one token each this step, none its first."""
        self.num_generation_tokens += len(requests)
        self.itls_s += [now - r.last_token_time for r in requests if r.last_token_time is not None]

    def observe_finished(self, request: Request, now: float) -> None:
        queue_s = None if request.scheduled_time is None else request.scheduled_time - request.arrival_time
        reason = request.status.finish_reason
        self.finished.append(FinishedRequestStats(
            "error" if reason == "invalid" else reason, request.num_prompt_tokens, request.num_output_tokens,
            queue_s, now - request.arrival_time))
