"""One Generate stream: engine outputs in, GenerateResponse messages out.

Per sample it detokenizes incrementally and matches stop strings on the text, holding
back what might still begin one. Whatever has queued up since the last message is
coalesced, so under load one Chunk carries several tokens. A time limit ends every
unfinished sample with FINISH_REASON_TIME_LIMIT and stops them in the engine.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

from engine.detokenizer import IncrementalDetokenizer, StopStringMatcher
from engine.sampling_params import SamplingParams
from engine.validation import EngineOverloaded
from frontend.engine_client import EngineLost
from pagedserve.v1 import engine_ipc_pb2 as ipc
from pagedserve.v1 import generation_pb2 as gen

ABORTED = object()  # queued by the Abort RPC
_TIME_LIMIT = object()  # the request's time_limit_ms ran out
FR = gen.FinishReason
_ERRORS = (EngineLost, EngineOverloaded, ValueError)  # queued by the engine client: raised here


class _Sample:
    def __init__(self, index: int, tokenizer, prompt: list[int], params: SamplingParams) -> None:
        self.index = index
        self.detok = IncrementalDetokenizer(tokenizer, prompt, params.skip_special_tokens)
        self.stops = StopStringMatcher(params.stop, params.include_stop_str_in_output)
        self.num_tokens = 0
        self.finished: gen.Finished | None = None
        self.reported = False  # its Finished message went out


class Stream:
    def __init__(self, request_id: str, engine_id: str, prompt: list[int], params: SamplingParams, tokenizer,
                 eos_token_ids: set[int], abort: Callable[[int | None], None]) -> None:
        self.request_id = request_id  # the caller's
        self.engine_id = engine_id  # the engine's: fresh per stream
        self.prompt = prompt
        self.prompt_len = len(prompt)
        self.params = params
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.abort = abort  # stops one sample in the engine (a stop string hit), or all (None)
        self.samples = [_Sample(i, tokenizer, prompt, params) for i in range(params.n)]
        self.num_cached_tokens = 0
        self.started = False
        self.first_token_time: float | None = None  # time.monotonic() of the first token

    @property
    def done(self) -> bool:
        return all(s.finished is not None for s in self.samples)

    async def responses(self, queue: asyncio.Queue, time_limit_s: float | None = None
                        ) -> AsyncIterator[gen.GenerateResponse]:
        deadline = None if time_limit_s is None else time.monotonic() + time_limit_s
        while not self.done:
            items = [await self._next(queue, deadline)]
            while not queue.empty():
                items.append(queue.get_nowait())
            for response in self._handle(items):
                yield response

    @staticmethod
    async def _next(queue: asyncio.Queue, deadline: float | None):
        if deadline is None:
            return await queue.get()
        try:
            return await asyncio.wait_for(queue.get(), max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            return _TIME_LIMIT

    def summary(self) -> dict[str, object]:
        """For the request log: token counts and how each sample ended."""
        reasons = [FR.Name(s.finished.reason).removeprefix("FINISH_REASON_").lower()
                   if s.finished is not None else "none" for s in self.samples]
        return {"finish_reason": reasons[0] if len(reasons) == 1 else ",".join(reasons),
                "prompt_tokens": self.prompt_len, "cached_tokens": self.num_cached_tokens,
                "completion_tokens": sum(s.num_tokens for s in self.samples), "n": len(self.samples)}

    def _handle(self, items: list) -> list[gen.GenerateResponse]:
        chunks: dict[int, gen.Chunk] = {}
        for item in items:
            if isinstance(item, _ERRORS):
                raise item
            if item is ABORTED or item is _TIME_LIMIT:
                reason = FR.FINISH_REASON_ABORTED if item is ABORTED else FR.FINISH_REASON_TIME_LIMIT
                self._end_all(reason, chunks)
                continue
            self.num_cached_tokens = item.num_cached_tokens
            self._apply(item, chunks)
        if self.first_token_time is None and any(c.token_ids for c in chunks.values()):
            self.first_token_time = time.monotonic()
        out = []
        if not self.started and (chunks or self.done):
            self.started = True
            out.append(gen.GenerateResponse(started=gen.Started(
                request_id=self.request_id, prompt_tokens=self.prompt_len, cached_tokens=self.num_cached_tokens)))
        out += [gen.GenerateResponse(chunk=c) for c in chunks.values() if c.token_ids or c.text]
        for s in self.samples:
            if s.finished is not None and not s.reported:
                s.reported = True
                out.append(gen.GenerateResponse(finished=s.finished))
        return out

    def _end_all(self, reason: int, chunks: dict[int, gen.Chunk]) -> None:
        """End every unfinished sample, with the text it still held back."""
        if self.done:
            return
        for s in self.samples:
            if s.finished is None:
                text, stop = s.stops.add(s.detok.flush())
                chunk = chunks.setdefault(s.index, gen.Chunk(index=s.index))
                chunk.text += text if stop is not None else text + s.stops.flush()
                s.finished = self._finished(s, reason)
        if reason == FR.FINISH_REASON_TIME_LIMIT:  # the Abort RPC stops the engine itself
            self.abort(None)

    def _apply(self, out: ipc.RequestOutput, chunks: dict[int, gen.Chunk]) -> None:
        s = self.samples[out.sample_index]
        if s.finished is not None:
            return  # a stop string already ended it; the engine's last tokens are moot
        chunk = chunks.setdefault(s.index, gen.Chunk(index=s.index))
        s.num_tokens += len(out.new_token_ids)
        chunk.token_ids.extend(out.new_token_ids)
        if self.params.logprobs is not None:
            chunk.logprobs.extend(self._logprobs(out.logprobs))
        delta = s.detok.add(list(out.new_token_ids)) + (s.detok.flush() if out.finish_reason else "")
        text, stop = s.stops.add(delta)
        chunk.text += text
        if stop is not None:
            s.finished = self._finished(s, FR.FINISH_REASON_STOP_STRING, stop_string=stop)
            if not out.finish_reason:
                self.abort(s.index)
        elif out.finish_reason:
            chunk.text += s.stops.flush()
            s.finished = self._finished(s, self._reason(out), out)

    def _reason(self, out: ipc.RequestOutput) -> int:
        if out.finish_reason == "length":
            return FR.FINISH_REASON_LENGTH
        if out.finish_reason == "abort":
            return FR.FINISH_REASON_ABORTED
        if out.stop_token_id in self.eos_token_ids and not self.params.ignore_eos:
            return FR.FINISH_REASON_EOS
        return FR.FINISH_REASON_STOP_TOKEN

    def _finished(self, s: _Sample, reason: int, out: ipc.RequestOutput | None = None,
                  stop_string: str | None = None) -> gen.Finished:
        msg = gen.Finished(index=s.index, reason=reason, usage=gen.Usage(
            prompt_tokens=self.prompt_len, completion_tokens=s.num_tokens,
            cached_tokens=self.num_cached_tokens))
        if stop_string is not None:
            msg.stop_string = stop_string
        elif out is not None and out.HasField("stop_token_id"):
            msg.stop_token_id = out.stop_token_id
        return msg

    def _logprobs(self, positions) -> list[gen.PositionLogprobs]:
        result = []
        for pos in positions:
            top = [t for t in pos.top][:self.params.logprobs]
            entry = gen.PositionLogprobs(sampled=pos.sampled, top=top)
            entry.sampled.token = self.tokenizer.convert_ids_to_tokens(entry.sampled.token_id)
            for t in entry.top:
                t.token = self.tokenizer.convert_ids_to_tokens(t.token_id)
            result.append(entry)
        return result
