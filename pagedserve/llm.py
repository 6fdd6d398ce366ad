"""The offline API: `LLM(model).generate(prompts, SamplingParams(...))`, as in vLLM; for a
pooling model (task embed or score), `LLM(model).embed(texts)` and `.score(query, documents)`
(pagedserve/pooling.py).

It plays the frontend's part in-process with the frontend's own input and output
processors (tokenization and the prompt check; detokenization, stop strings, finish
reasons), and drives `EngineCore.step()` until every request is done.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from tqdm import tqdm

from common.errors import InvalidRequest, Unavailable
from common.multimodal import ImageInput
from common.sampling_params import SamplingParams
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.lora.adapter import LoraAdapter
from engine.models.loader import eos_token_ids, load_tokenizer
from engine.models.source import check_models, model_files, tokenizer_path
from engine.vision import multimodal_info
from frontend.input_processor import InputProcessor
from frontend.multimodal.parts import offline_image, offline_messages
from frontend.multimodal.processor import MultiModalProcessor
from frontend.output_processor import STOPPED, OutputProcessor, SampleDelta
from frontend.pooling import as_inputs, require_task
from pagedserve.pooling import EmbeddingOutput, OfflinePooling, ScoringOutput

# A text, token ids, or (as in vLLM) {"prompt": text, "multi_modal_data": {"image": images}}:
# one image (a PIL image or a path) or a list, one per image placeholder in the text.
Prompt = str | list[int] | dict


@dataclass
class CompletionOutput:
    """One of the n samples of a prompt."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    logprobs: list[dict[int, float]] | None = None  # per token: top-N and the chosen one

    def add(self, delta: SampleDelta) -> None:
        self.text += delta.text
        self.token_ids += delta.token_ids
        if self.logprobs is not None:
            self.logprobs += [{t.token_id: t.logprob for t in (*p.top, p.sampled)} for p in delta.logprobs]
        if delta.finish_reason is not None:
            self.finish_reason = "stop" if delta.finish_reason in STOPPED else delta.finish_reason
            self.stop_reason = delta.stop_reason


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0
    prompt_logprobs: list[dict[int, float] | None] | None = None  # position 0 has none

    @property
    def finished(self) -> bool:
        return all(o.finish_reason is not None for o in self.outputs)


class LLM:
    """An engine in this process. `model=None` loads the bundled SmolLM2-135M-Instruct."""

    def __init__(self, model: str | None = None, **engine_config: object) -> None:
        self.config = EngineConfig.from_kwargs(model=model, **engine_config)
        check_models(self.config)  # a bad model: ModelError (a ValueError) before anything loads
        path = model_files(self.config)
        self.tokenizer = load_tokenizer(path, tokenizer_path(self.config))
        self.engine = EngineCore(self.config, eos_token_ids(self.tokenizer), tokenizer=self.tokenizer)
        info = multimodal_info(self.engine)
        self.input = InputProcessor(self.tokenizer, self.engine.limits,
                                    sampling_defaults=self.engine.sampling_defaults,
                                    multimodal=None if info is None else MultiModalProcessor(info, self.tokenizer))
        self.pooling = OfflinePooling(self.engine, self.tokenizer)
        self._ids = map(str, itertools.count())

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False, lora_name: str | None | Sequence[str | None] = None
                 ) -> list[RequestOutput]:
        """Run every prompt to completion; one RequestOutput per prompt, in order. A bad
        prompt or parameter raises InvalidRequest (a ValueError) and runs nothing.
        `lora_name`: the LoRA adapter for every prompt, or one per prompt (None: the base
        model); one not loaded raises LoraError (a ValueError). No `sampling_params`: the
        model's defaults (`get_default_sampling_params`)."""
        require_task(self.pooling.pooler, "generate")
        prompts = [prompts] if isinstance(prompts, dict) else as_inputs(prompts)
        return self._generate(prompts, [self._prompt(p, f"prompts[{i}]") for i, p in enumerate(prompts)],
                              sampling_params, use_tqdm, lora_name)

    def chat(self, messages: list[dict] | Sequence[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, use_tqdm: bool = False,
             lora_name: str | None | Sequence[str | None] = None, *, add_generation_prompt: bool = True,
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of messages) or several, through the
        model's chat template. A message's content is text, or a list of parts: {"type":
        "text", "text"}, {"type": "image", "image": a PIL image or a path}, or OpenAI's
        {"type": "image_url", "image_url": {"url": a data URL}} (frontend/multimodal/parts.py)."""
        require_task(self.pooling.pooler, "generate")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        inputs = [self.input.chat_prompt(offline_messages(c), add_generation_prompt=add_generation_prompt,
                                         chat_template_kwargs=chat_template_kwargs) for c in conversations]
        return self._generate([None] * len(inputs), inputs, sampling_params, use_tqdm, lora_name)

    def _prompt(self, prompt: Prompt, field: str) -> tuple[list[int], list[ImageInput]]:
        """A prompt's token ids and images."""
        if isinstance(prompt, str):
            return self.input.tokenize(prompt, field=field), []
        if not isinstance(prompt, dict):
            return list(prompt), []
        unknown = set(prompt) - {"prompt", "multi_modal_data"}
        if unknown or set(prompt.get("multi_modal_data") or {}) - {"image"}:
            raise InvalidRequest(f"{field}: a dict prompt is {{'prompt': text, 'multi_modal_data': {{'image': "
                                 f"images}}}}, got keys {sorted(prompt)}")
        images = (prompt.get("multi_modal_data") or {}).get("image", [])
        images = list(images) if isinstance(images, (list, tuple)) else [images]
        images = [offline_image(im, f"{field}.multi_modal_data.image[{i}]") for i, im in enumerate(images)]
        if not images:
            return self.input.tokenize(prompt.get("prompt"), field=f"{field}.prompt"), []
        return self.input.prompt_with_images(prompt.get("prompt"), images, f"{field}.prompt")

    def _generate(self, prompts: list, inputs: list[tuple[list[int], list[ImageInput]]],
                  sampling_params, use_tqdm: bool, lora_name) -> list[RequestOutput]:
        if self.engine.sleep_level:
            raise Unavailable("the engine is asleep: call wake_up() first")
        params = sampling_params or self.get_default_sampling_params()
        params = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(params) != len(prompts):
            raise InvalidRequest(f"sampling_params: got {len(params)} for {len(prompts)} prompts")
        loras = [lora_name] * len(prompts) if lora_name is None or isinstance(lora_name, str) else list(lora_name)
        if len(loras) != len(prompts):
            raise InvalidRequest(f"lora_name: got {len(loras)} for {len(prompts)} prompts")
        for name in set(loras):
            self.engine.lora_block_keys(name)  # raises for an adapter not loaded
        for (ids, _), p in zip(inputs, params):
            self.input.check(ids, p)
        processor = OutputProcessor(self.tokenizer, self.engine.eos_token_ids)
        results = {}
        for prompt, (ids, images), p, lora in zip(prompts, inputs, params, loras):
            request_id = next(self._ids)
            self.engine.add_request(request_id, ids, p, lora_name=lora, images=images)
            processor.add_request(request_id, ids, p)
            results[request_id] = RequestOutput(
                request_id, prompt if isinstance(prompt, str) else prompt.get("prompt") if isinstance(prompt, dict)
                else None, ids,
                [CompletionOutput(i, logprobs=[] if p.logprobs is not None else None) for i in range(p.n)])
        self._run(processor, results, use_tqdm)
        return list(results.values())

    def embed(self, inputs: Prompt | Sequence[Prompt], *, truncate_prompt_tokens: int | None = None,
              dimensions: int | None = None, use_tqdm: bool = False) -> list[EmbeddingOutput]:
        """One embedding per input (a text, or token ids taken as they are), in order, for a
        model that serves the embed task. `truncate_prompt_tokens`: keep each input's first k
        tokens (-1: as many as the model takes); unset, a longer input raises InvalidRequest.
        `dimensions`: a Matryoshka model's vectors cut to their first n values."""
        return self.pooling.embed(inputs, self._ids, truncate_prompt_tokens, dimensions, use_tqdm)

    def score(self, query: str, documents: str | Sequence[str], *, truncate_prompt_tokens: int | None = None,
              use_tqdm: bool = False) -> list[ScoringOutput]:
        """Each document's relevance to `query`, in order: a cross-encoder's (task score)
        sigmoid of its logit, or an embedding model's cosine of the two embeddings."""
        return self.pooling.score(query, documents, self._ids, truncate_prompt_tokens, use_tqdm)

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation config (engine option generation_config)
        where it sets a field, SamplingParams' own defaults elsewhere, as vLLM's."""
        return self.input.sampling_params()

    def load_lora(self, name: str, path: str) -> list[LoraAdapter]:
        """Load a PEFT adapter (needs enable_lora); returns the adapters loaded now."""
        return self.engine.load_lora(name, path)

    def unload_lora(self, name: str) -> list[LoraAdapter]:
        return self.engine.unload_lora(name)

    def lora_adapters(self) -> list[LoraAdapter]:
        return self.engine.lora_adapters()

    def sleep(self, level: int = 1) -> None:
        """Free the KV cache (level 1: keep the weights, in host memory; level 2: free them too),
        e.g. while an RL loop trains; generate() refuses until `wake_up` (docs/engine.md)."""
        self.engine.sleep(level)

    def wake_up(self) -> None:
        """Allocate the KV cache again (level 2: load the weights again, from the last path)."""
        self.engine.wake_up()

    def update_weights(self, path: str) -> None:
        """Serve the weights at `path` (a checkpoint of the same architecture and shapes) from
        now on; InvalidRequest (a ValueError) if they do not fit, and the old ones stay."""
        self.engine.update_weights(path)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; False (and nothing done) while requests are running."""
        return self.engine.reset_prefix_cache()

    def _run(self, processor: OutputProcessor, results: dict[str, RequestOutput], use_tqdm: bool) -> None:
        states = dict(processor.requests)
        bar = tqdm(total=sum(len(r.outputs) for r in results.values()), desc="generating", unit="seq",
                   disable=not use_tqdm)
        while processor.requests:
            deltas, to_stop = processor.process_outputs(*self.engine.step_packed())
            self.engine.abort_requests(to_stop, stopped=True)  # stop strings the engine can't see
            for request_id, request_deltas in deltas.items():
                result = results[request_id]
                result.num_cached_tokens = states[request_id].num_cached_tokens
                for delta in request_deltas:
                    result.outputs[delta.index].add(delta)
                    bar.update(delta.finish_reason is not None)
        for request_id, result in results.items():
            lps = states[request_id].prompt_logprobs
            if lps is not None:
                result.prompt_logprobs = [None if p is None else {t.token_id: t.logprob for t in (*p.top, p.sampled)}
                                          for p in lps]
        bar.close()
