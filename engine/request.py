"""The engine's view of one sequence being generated."""

from __future__ import annotations

import enum
import itertools
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from common.multimodal import ImageInput
from common.pooling_params import PoolingParams
from common.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.structured_output.manager import StructuredRequest

_arrival_counter = itertools.count()


class RequestStatus(enum.IntEnum):
    WAITING_FOR_GRAMMAR = 0  # its structured-output grammar is compiling in a worker thread
    WAITING = 1
    RUNNING = 2
    PREEMPTED = 3  # waiting again, to be recomputed
    FINISHED_STOPPED = 4  # eos or a stop token
    FINISHED_LENGTH = 5  # max_tokens or max_model_len
    FINISHED_ABORTED = 6
    FINISHED_INVALID = 7  # the caller's to fix: its grammar did not compile, or the vocabulary can't write it
    FINISHED_ERROR = 8  # it failed on the way, the engine's fault (a sampled token its grammar's mask forbade)

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_INVALID: "invalid",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(eq=False)
class Request:
    """One sequence. A prompt with `n > 1` starts as one Request; after its
    prefill the scheduler forks `n - 1` siblings that share its prompt blocks."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    priority: int = 0  # lower runs first under the "priority" policy
    arrival_time: float = field(default_factory=time.monotonic)
    # Breaks ties between equal priorities in arrival order, and makes a
    # preempted request sort before everything that arrived after it.
    arrival_seq: int = field(default_factory=lambda: next(_arrival_counter))
    parent_id: str | None = None  # the caller's id for the n samples of one prompt
    sample_index: int = 0  # which of the n samples this is
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[dict[int, float]] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at first schedule
    num_preemptions: int = 0
    stop_token_id: int | None = None  # the eos/stop token that finished it
    scheduled_time: float | None = None  # first time it ran (monotonic), for queue-time metrics
    last_token_time: float | None = None  # when its latest token came out, for TTFT and ITL
    # Seeds are per sample: sample i of a seeded request uses seed + i.
    seed: int | None = None
    # With params.prompt_logprobs: entries for prompt positions 1.. computed so far, gathered
    # chunk by chunk until the first output carries them.
    prompt_logprobs: list[dict[int, float]] = field(default_factory=list)
    # With params.structured_outputs: its grammar (compiling, then compiled) and its matcher.
    structured: StructuredRequest | None = None
    error: str | None = None  # why it ended FINISHED_INVALID or FINISHED_ERROR
    # Speculative decoding: tokens proposed after its last one, verified in its next step.
    spec_token_ids: list[int] = field(default_factory=list)
    # Multi-LoRA: the adapter it runs with (None: the base model), and the prefix-cache extra
    # keys of its blocks (engine.lora.block_extra_keys), so no two adapters share KV.
    lora_name: str | None = None
    block_extra_keys: tuple = ()
    # The scheduler's decode lease (BlockManager.decode_lease): it decodes with no call to
    # the block manager while num_computed_tokens < decode_lease_end, each step reusing
    # decode_entry (its ScheduledRequest).
    decode_lease_end: int = 0
    decode_entry: object = None
    # A pooling request (task embed / score): its prompt runs in one step, which ends it.
    pooling: PoolingParams | None = None
    # A vision-language model's prompt images (common.multimodal.ImageInput), by offset; the
    # step that prefills an image's placeholder tokens puts its embeddings there.
    images: list[ImageInput] = field(default_factory=list)
    # M-RoPE (Qwen2-VL family), a prompt with images: its positions [3, prompt length], and the
    # delta of every later token's (sequence index + rope_delta in all three). None: 1-D.
    rope_table: np.ndarray | None = None
    rope_delta: int = 0
    # Its images' tokens attend to each other both ways (Gemma 3): a prefill chunk never ends
    # inside an image (engine/vision.py: whole_image_end).
    whole_images: bool = False

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        self.caller_id = self.parent_id or self.request_id  # the id its outputs go out under
        params = self.sampling_params
        if self.seed is None and params.seed is not None:
            self.seed = params.seed + self.sample_index
        # Cheap tests the scheduler makes each step before its full stop check: only a token
        # in stop_candidates, or reaching length_limit tokens, can end the request by itself.
        self.stop_candidates = frozenset(params.stop_token_ids).union(() if params.ignore_eos else self.eos_token_ids)
        self.length_limit = (len(self.prompt_token_ids) + params.max_tokens if params.max_tokens is not None
                             else sys.maxsize)
        # From which output token on each next token is its logits' argmax and nothing more,
        # the sampler's hot path (SamplingParams.plain_greedy; min_tokens masks eos before
        # it, a grammar always); sys.maxsize: never.
        self.greedy_from = (params.min_tokens if params.plain_greedy and params.structured_outputs is None
                            else sys.maxsize)
        # From this many outputs on, a step may sample its token on the device without the host
        # looking (plain greedy or plain random, engine/async_step.py); sys.maxsize: never.
        self.ahead_from = (params.min_tokens if (params.plain_greedy or params.plain_random)
                           and params.structured_outputs is None else sys.maxsize)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_seats(self) -> int:
        """Sequences this request will occupy: n for a prompt that has yet to fork."""
        return self.sampling_params.n if self.needs_fork else 1

    @property
    def needs_fork(self) -> bool:
        """The first sample of an n>1 prompt, before its siblings exist."""
        return self.sampling_params.n > 1 and self.sample_index == 0 and not self.output_token_ids

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Its prefill must score the prompt: asked for, and not yet emitted (they go out with
        the first output token). Only sample 0 runs an n>1 prompt, so only it scores it."""
        return (self.sampling_params.prompt_logprobs is not None and self.sample_index == 0
                and not self.output_token_ids)

    def append_output(self, token_id: int, logprobs: dict[int, float] | None) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if logprobs is not None:
            self.output_logprobs.append(logprobs)
