"""The offline API: `LLM(model).generate(prompts, SamplingParams(...))`, as in vLLM.

It plays the frontend's part in-process: tokenizes, drives `EngineCore.step()`
until every request is done, detokenizes and applies stop strings.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from tqdm import tqdm

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.detokenizer import IncrementalDetokenizer, StopStringMatcher
from engine.models.loader import eos_token_ids, load_tokenizer, resolve_model_path
from engine.outputs import EngineCoreOutput
from engine.request import sample_request_id
from engine.sampling_params import SamplingParams

Prompt = str | list[int]


@dataclass
class CompletionOutput:
    """One of the n samples of a prompt."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    logprobs: list[dict[int, float]] | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return all(o.finish_reason is not None for o in self.outputs)


class _Sample:
    """Text state of one sample while it streams."""

    def __init__(self, tokenizer, request_id: str, prompt_ids: list[int], params: SamplingParams,
                 index: int) -> None:
        self.engine_id = request_id if params.n == 1 else sample_request_id(request_id, index)
        self.completion = CompletionOutput(index, logprobs=[] if params.logprobs is not None else None)
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids, params.skip_special_tokens)
        self.stops = StopStringMatcher(params.stop, params.include_stop_str_in_output)

    def update(self, out: EngineCoreOutput) -> bool:
        """Apply one engine output; True if a stop string ended the sample."""
        c = self.completion
        c.token_ids += out.new_token_ids
        if c.logprobs is not None and out.new_logprobs:
            c.logprobs += out.new_logprobs
        delta = self.detok.add(out.new_token_ids) + (self.detok.flush() if out.finished else "")
        text, stop = self.stops.add(delta)
        c.text += text
        if stop is not None:
            c.finish_reason, c.stop_reason = "stop", stop
            return True
        if out.finished:
            c.text += self.stops.flush()
            c.finish_reason, c.stop_reason = out.finish_reason, out.stop_token_id
        return False


class LLM:
    """An engine in this process. `model=None` loads the bundled SmolLM2-135M-Instruct."""

    def __init__(self, model: str | None = None, **engine_config: object) -> None:
        self.config = EngineConfig.from_kwargs(model=model, **engine_config)
        path = resolve_model_path(self.config.model)
        self.tokenizer = load_tokenizer(path, self.config.tokenizer)
        self.engine = EngineCore(self.config, eos_token_ids(self.tokenizer))
        self._ids = itertools.count()

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Run every prompt to completion; one RequestOutput per prompt, in order."""
        prompts = [prompts] if isinstance(prompts, str) or _is_token_list(prompts) else list(prompts)
        params = sampling_params or SamplingParams()
        params = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(params) != len(prompts):
            raise ValueError(f"sampling_params: got {len(params)} for {len(prompts)} prompts")
        results, samples = {}, {}
        try:
            for prompt, p in zip(prompts, params):
                self._add(prompt, p, results, samples)
        except ValueError:
            self.engine.abort_requests(list(results))
            raise
        self._run(samples, use_tqdm)
        return list(results.values())

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; False (and nothing done) while requests are running."""
        return self.engine.reset_prefix_cache()

    def _add(self, prompt: Prompt, params: SamplingParams, results: dict, samples: dict) -> None:
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        request_id = str(next(self._ids))
        self.engine.add_request(request_id, ids, params)
        group = [_Sample(self.tokenizer, request_id, ids, params, i) for i in range(params.n)]
        results[request_id] = RequestOutput(request_id, prompt if isinstance(prompt, str) else None,
                                            ids, [s.completion for s in group])
        for i, sample in enumerate(group):
            samples[(request_id, i)] = sample

    def _run(self, samples: dict, use_tqdm: bool) -> None:
        bar = tqdm(total=len(samples), desc="generating", unit="seq", disable=not use_tqdm)
        pending = len(samples)
        while pending:
            for out in self.engine.step():
                sample = samples[(out.request_id, out.sample_index)]
                if sample.update(out):  # a stop string: the engine still thinks it runs
                    self.engine.abort_requests([sample.engine_id])
                if sample.completion.finish_reason is not None:
                    pending -= 1
                    bar.update(1)
        bar.close()


def _is_token_list(x: object) -> bool:
    return isinstance(x, list) and bool(x) and all(isinstance(t, int) for t in x)
