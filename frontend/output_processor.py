"""Engine outputs -> per-sample deltas of text: the one place where generated tokens become
text, for gRPC, HTTP and the offline `LLM` alike (vLLM v1's OutputProcessor).

Per sample it detokenizes incrementally, matches stop strings on the text (holding back what
might still begin one), decides the finish reason, and decodes logprobs. When a stop string
ends a sample the engine does not know it yet: `process` returns the engine ids to stop.

    engine outputs ──► RequestState.process ──► [SampleDelta per changed sample], ids to stop
                         └ SampleState × n: IncrementalDetokenizer ─► StopStringMatcher
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from common.errors import InvalidRequest, RequestFailed
from common.outputs import EngineCoreOutput, PlainTokens, plain_output, sample_request_id
from common.sampling_params import SamplingParams
from common.structured_output.params import named
from frontend.detokenizer import IncrementalDetokenizer, StopStringMatcher

# Why a sample ended. Each API maps these onto its own names (gRPC's FinishReason, OpenAI's
# "stop"/"length", Anthropic's stop_reason, the offline API's vLLM names).
LENGTH = "length"  # max_tokens or the model's max length
EOS = "eos"
STOP_STRING = "stop_string"
STOP_TOKEN = "stop_token"  # one of stop_token_ids
ABORT = "abort"  # an Abort call, or the engine aborted it
TIME_LIMIT = "time_limit"
STOPPED = (EOS, STOP_STRING, STOP_TOKEN)  # what OpenAI and vLLM call "stop"


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    token: str  # the vocabulary entry (e.g. "Ġthe"), as convert_ids_to_tokens gives it


@dataclass(slots=True)
class PositionLogprobs:
    """One position's logprobs: the chosen token, then the top-N most likely first."""

    sampled: TokenLogprob
    top: list[TokenLogprob]


@dataclass(slots=True)
class SampleDelta:
    """What one sample gained since the last delta; all `text`s concatenate to its text."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] = field(default_factory=list)  # one per token, when asked
    finish_reason: str | None = None  # set on the sample's last delta
    stop_reason: str | int | None = None  # the stop string or stop/eos token id that ended it
    num_tokens: int = 0  # completion tokens so far


class SampleState:
    def __init__(self, index: int, tokenizer, prompt: list[int], params: SamplingParams) -> None:
        self.index = index
        self.detok = IncrementalDetokenizer(tokenizer, prompt, params.skip_special_tokens)
        self.stops = StopStringMatcher(params.stop, params.include_stop_str_in_output)
        self.num_tokens = 0
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def finish(self, delta: SampleDelta, reason: str, stop_reason: str | int | None = None) -> None:
        self.finish_reason = delta.finish_reason = reason
        self.stop_reason = delta.stop_reason = stop_reason


class RequestState:
    """The text state of one request's n samples, fed with its engine outputs."""

    def __init__(self, engine_id: str, prompt: list[int], params: SamplingParams, tokenizer,
                 eos_token_ids: Iterable[int]) -> None:
        self.engine_id = engine_id  # the id the engine knows the request by
        self.prompt = prompt
        self.params = params
        self.tokenizer = tokenizer
        self.eos_token_ids = set(eos_token_ids)
        self.samples = [SampleState(i, tokenizer, prompt, params) for i in range(params.n)]
        self.num_cached_tokens = 0
        # Position 0 has none; set once, from the engine's first output, when asked for.
        self.prompt_logprobs: list[PositionLogprobs | None] | None = None
        # Most outputs are one token of a sample that goes on: with no stop strings or
        # logprobs to mind, `process` takes a short way for them (a few us a token, for each
        # stream, every step).
        self._plain = not params.stop and params.logprobs is None and params.prompt_logprobs is None

    @property
    def done(self) -> bool:
        return all(s.finished for s in self.samples)

    @property
    def num_completion_tokens(self) -> int:
        return sum(s.num_tokens for s in self.samples)

    def process(self, outputs: list[EngineCoreOutput]) -> tuple[list[SampleDelta], list[str]]:
        """Apply engine outputs in order. Returns one coalesced delta per sample that changed,
        and the engine ids of samples a stop string ended (the engine must stop them)."""
        if self._plain and len(outputs) == 1:
            out = outputs[0]
            if out.finish_reason is None and len(out.new_token_ids) == 1:
                delta = self.process_plain(out.sample_index, out.new_token_ids[0], out.num_cached_tokens)
                if delta is not None:
                    return [delta], []
        deltas: dict[int, SampleDelta] = {}
        to_stop: list[str] = []
        for out in outputs:
            self.num_cached_tokens = out.num_cached_tokens
            if out.prompt_logprobs is not None and self.prompt_logprobs is None:
                self.prompt_logprobs = [None] + [self._decode_logprobs(t, lp, self.params.prompt_logprobs)
                                                 for t, lp in zip(self.prompt[1:], out.prompt_logprobs[1:])]
            s = self.samples[out.sample_index]
            if s.finished:
                continue  # a stop string ended it; the engine's last tokens are moot
            delta = deltas.get(s.index)
            if delta is None:
                delta = deltas[s.index] = SampleDelta(s.index)
            if self._apply(s, out, delta):
                to_stop.append(self.sample_engine_id(s.index))
        for delta in deltas.values():
            delta.num_tokens = self.samples[delta.index].num_tokens
        return list(deltas.values()), to_stop

    def process_plain(self, index: int, token_id: int, num_cached_tokens: int) -> SampleDelta | None:
        """One token of sample `index` that ends nothing, the short way: the delta, or None
        where `process` must take it (stop strings or logprobs to mind, the sample ended)."""
        s = self.samples[index]
        if not self._plain or s.finished:
            return None
        self.num_cached_tokens = num_cached_tokens
        s.num_tokens += 1
        return SampleDelta(index, s.detok.add([token_id]), [token_id], num_tokens=s.num_tokens)

    def finish_all(self, reason: str) -> list[SampleDelta]:
        """End every unfinished sample (abort, time limit) with the text it still held back."""
        deltas = []
        for s in self.samples:
            if s.finished:
                continue
            delta = SampleDelta(s.index, num_tokens=s.num_tokens)
            text, stop = s.stops.add(s.detok.flush())
            delta.text = text if stop is not None else text + s.stops.flush()
            s.finish(delta, reason)
            deltas.append(delta)
        return deltas

    def sample_engine_id(self, index: int) -> str:
        return self.engine_id if self.params.n == 1 else sample_request_id(self.engine_id, index)

    def _apply(self, s: SampleState, out: EngineCoreOutput, delta: SampleDelta) -> bool:
        """True if a stop string ended the sample before the engine did. Raises InvalidRequest
        or RequestFailed if the engine ended it with an error."""
        if out.finish_reason == "invalid":  # its grammar did not compile, or the vocabulary can't write it
            constraint = self.params.structured_outputs
            raise InvalidRequest(named(out.error or "the engine refused the request",
                                       constraint.param if constraint is not None else ""))
        if out.finish_reason == "error":
            raise RequestFailed(out.error or "the engine could not finish the request")
        tokens = out.new_token_ids
        # Several tokens (speculative decoding's accepted run) with stop strings: one at a time,
        # so the sample ends at the token that completes a stop string, as it would unbatched.
        step = 1 if self.params.stop else max(1, len(tokens))
        for start in range(0, len(tokens), step):
            last = start + step >= len(tokens)
            chunk = tokens if start == 0 and last else tokens[start:start + step]
            s.num_tokens += len(chunk)
            delta.token_ids += chunk
            if self.params.logprobs is not None and out.new_logprobs:
                delta.logprobs += [self._decode_logprobs(t, lp, self.params.logprobs)
                                   for t, lp in zip(chunk, out.new_logprobs[start:start + step])]
            text = s.detok.add(chunk)
            if out.finished and last:
                text += s.detok.flush()
            text, stop = s.stops.add(text)
            delta.text += text
            if stop is not None:
                s.finish(delta, STOP_STRING, stop)
                return not out.finished
        if out.finished:
            delta.text += s.stops.flush()
            s.finish(delta, self._reason(out), out.stop_token_id)
        return False

    def _reason(self, out: EngineCoreOutput) -> str:
        if out.finish_reason == "length":
            return LENGTH
        if out.finish_reason == "abort":
            return ABORT
        if out.stop_token_id in self.eos_token_ids and not self.params.ignore_eos:
            return EOS
        if out.stop_token_id is None:  # its grammar was complete: the end, as eos would be
            return EOS
        return STOP_TOKEN

    def _decode_logprobs(self, token_id: int, logprobs: dict[int, float], top_n: int | None) -> PositionLogprobs:
        # The engine's dict holds the top-N plus the chosen token, which may lie outside them.
        convert = self.tokenizer.convert_ids_to_tokens
        top = sorted(logprobs.items(), key=lambda kv: -kv[1])[:top_n or 0]
        return PositionLogprobs(TokenLogprob(token_id, logprobs[token_id], convert(token_id)),
                                [TokenLogprob(t, lp, convert(t)) for t, lp in top])


class OutputProcessor:
    """Many requests' states, for a caller that steps the engine itself (the offline `LLM`);
    the frontend keeps one RequestState per stream instead."""

    def __init__(self, tokenizer, eos_token_ids: Iterable[int]) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = tuple(eos_token_ids)
        self.requests: dict[str, RequestState] = {}

    def add_request(self, engine_id: str, prompt: list[int], params: SamplingParams) -> RequestState:
        state = RequestState(engine_id, prompt, params, self.tokenizer, self.eos_token_ids)
        self.requests[engine_id] = state
        return state

    def process_outputs(self, outputs: list[EngineCoreOutput], plain: PlainTokens | None = None
                        ) -> tuple[dict[str, list[SampleDelta]], list[str]]:
        """Deltas by request id, and the engine ids a stop string ended. Finished requests
        are forgotten. `plain`: the step's packed plain tokens (EngineCore.step_packed), if any."""
        deltas: dict[str, list[SampleDelta]] = {}
        by_request: dict[str, list[EngineCoreOutput]] = {}
        if plain is not None:
            requests = self.requests
            for request_id, token_id, num_cached in zip(plain.request_ids, plain.token_ids, plain.num_cached_tokens):
                delta = requests[request_id].process_plain(0, token_id, num_cached)
                if delta is not None:
                    deltas[request_id] = [delta]
                else:
                    by_request[request_id] = [plain_output(request_id, token_id, num_cached)]
        for out in outputs:
            by_request.setdefault(out.request_id, []).append(out)
        to_stop = []
        for request_id, outs in by_request.items():
            new, stop = self.requests[request_id].process(outs)
            deltas[request_id] = deltas.get(request_id, []) + new
            to_stop += stop
        for request_id in by_request:  # (a plain token ends nothing)
            if self.requests[request_id].done:
                del self.requests[request_id]
        return deltas, to_stop
