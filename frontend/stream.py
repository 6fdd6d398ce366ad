"""One Generate stream: engine outputs in, GenerateResponse messages out.

Per sample it detokenizes incrementally and matches stop strings on the text, holding
back what might still begin one. Whatever has queued up since the last message is
coalesced, so under load one Chunk carries several tokens.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from engine.detokenizer import IncrementalDetokenizer, StopStringMatcher
from engine.sampling_params import SamplingParams
from frontend.engine_client import EngineLost
from pagedserve.v1 import engine_ipc_pb2 as ipc
from pagedserve.v1 import generation_pb2 as gen

ABORTED = object()  # queued by the Abort RPC
FR = gen.FinishReason


class _Sample:
    def __init__(self, index: int, tokenizer, prompt: list[int], params: SamplingParams) -> None:
        self.index = index
        self.detok = IncrementalDetokenizer(tokenizer, prompt, params.skip_special_tokens)
        self.stops = StopStringMatcher(params.stop, params.include_stop_str_in_output)
        self.num_tokens = 0
        self.finished: gen.Finished | None = None
        self.reported = False  # its Finished message went out


class Stream:
    def __init__(self, request_id: str, prompt: list[int], params: SamplingParams, tokenizer,
                 eos_token_ids: set[int], abort_sample: Callable[[int], None]) -> None:
        self.request_id = request_id
        self.prompt_len = len(prompt)
        self.params = params
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.abort_sample = abort_sample  # tells the engine to stop one sample (a stop string hit)
        self.samples = [_Sample(i, tokenizer, prompt, params) for i in range(params.n)]
        self.num_cached_tokens = 0
        self.started = False

    @property
    def done(self) -> bool:
        return all(s.finished is not None for s in self.samples)

    async def responses(self, queue: asyncio.Queue) -> AsyncIterator[gen.GenerateResponse]:
        while not self.done:
            items = [await queue.get()]
            while not queue.empty():
                items.append(queue.get_nowait())
            for response in self._handle(items):
                yield response

    def _handle(self, items: list) -> list[gen.GenerateResponse]:
        chunks: dict[int, gen.Chunk] = {}
        for item in items:
            if isinstance(item, (EngineLost, ValueError)):
                raise item
            if item is ABORTED:
                for s in self.samples:
                    if s.finished is None:
                        s.finished = self._finished(s, FR.FINISH_REASON_ABORTED)
                continue
            self.num_cached_tokens = item.num_cached_tokens
            self._apply(item, chunks)
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
                self.abort_sample(s.index)
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
