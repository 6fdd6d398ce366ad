"""Protobuf <-> engine dataclasses: the one place where the engine's messages are converted.

The frontend uses `sampling_params_from_proto` too, so a request is validated by exactly
the same code on both sides of the socket.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from common.errors import InvalidRequest
from common.multimodal import MAX_PIXEL_BYTES, ImageInput
from common.outputs import EngineCoreOutput, PlainTokens, plain_output
from common.sampling_defaults import DEFAULTABLE, NO_DEFAULTS, sampling_params
from common.sampling_params import SamplingParams
from common.structured_output.params import StructuredOutputsParams
from common.v1 import engine_ipc_pb2 as ipc
from common.v1 import generation_pb2 as gen

# SamplingParams fields that proto3 marks `optional` (their default is not zero, or a model's
# generation config may set it).
_OPTIONAL = ("n", "temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "logprobs", "repetition_penalty",
             "prompt_logprobs")
_PLAIN = ("min_tokens", "ignore_eos", "presence_penalty", "frequency_penalty", "disable_speculation")
_INTEGERS = ("top_k", "max_tokens")  # of DEFAULTABLE; the others are floats


def sampling_params_from_proto(msg: gen.SamplingParams, *, defaults: Mapping[str, float | int] = NO_DEFAULTS,
                               skip_special_tokens: bool = True, include_stop_str_in_output: bool = False,
                               structured_outputs: StructuredOutputsParams | None = None,
                               bad_words_token_ids: list[list[int]] | None = None) -> SamplingParams:
    """An unset field takes the model's default (`defaults`, the frontend's), then SamplingParams'
    own; unset max_tokens means "until eos or the model's length", not vLLM's 16. Raises
    ValueError naming the field, as SamplingParams does."""
    kwargs: dict = {name: getattr(msg, name) for name in _PLAIN}
    kwargs.update({name: None for name in DEFAULTABLE})
    kwargs.update({name: getattr(msg, name) for name in _OPTIONAL if msg.HasField(name)})
    return sampling_params(
        defaults, stop=list(msg.stop), stop_token_ids=list(msg.stop_token_ids),
        logit_bias=dict(msg.logit_bias) or None, bad_words=list(msg.bad_words),
        allowed_token_ids=list(msg.allowed_token_ids) or None, bad_words_token_ids=bad_words_token_ids,
        skip_special_tokens=skip_special_tokens, include_stop_str_in_output=include_stop_str_in_output,
        structured_outputs=structured_outputs, **kwargs)


def sampling_params_to_proto(params: SamplingParams) -> gen.SamplingParams:
    msg = gen.SamplingParams(stop=params.stop, stop_token_ids=params.stop_token_ids, logit_bias=params.logit_bias,
                             bad_words=params.bad_words, allowed_token_ids=params.allowed_token_ids,
                             **{name: getattr(params, name) for name in _PLAIN})
    for name in _OPTIONAL:
        value = getattr(params, name)
        if value is not None:
            setattr(msg, name, value)
    return msg


def bad_words_to_proto(params: SamplingParams) -> list[gen.TokenIds]:
    """AddRequest.bad_words_token_ids."""
    return [gen.TokenIds(ids=ids) for ids in params.bad_words_token_ids]


def bad_words_from_proto(msg: ipc.AddRequest) -> list[list[int]]:
    return [list(word.ids) for word in msg.bad_words_token_ids]


def sampling_defaults_to_proto(defaults: Mapping[str, float | int]) -> gen.SamplingParams:
    """Welcome.sampling_defaults."""
    return gen.SamplingParams(**{name: defaults[name] for name in DEFAULTABLE if name in defaults})


def sampling_defaults_from_proto(msg: gen.SamplingParams) -> dict[str, float | int]:
    """The defaults, floats back to the shortest decimal that makes the same float32 (the
    wire's 0.6 arrives as 0.6000000238...)."""
    return {name: getattr(msg, name) if name in _INTEGERS else float(f"{getattr(msg, name):.7g}")
            for name in DEFAULTABLE if msg.HasField(name)}


def structured_to_proto(params: StructuredOutputsParams | None) -> ipc.StructuredOutputs | None:
    if params is None:
        return None
    kind = params.kind
    value = gen.Choices(choices=params.choice) if kind == "choice" else getattr(params, kind)
    return ipc.StructuredOutputs(**{kind: value}, starts_after=params.starts_after)


def structured_from_proto(msg: ipc.StructuredOutputs) -> StructuredOutputsParams | None:
    """Raises InvalidRequest as StructuredOutputsParams does."""
    kind = msg.WhichOneof("kind")
    if kind is None:
        return None
    value = tuple(msg.choice.choices) if kind == "choice" else getattr(msg, kind)
    return StructuredOutputsParams(**{kind: value}, starts_after=tuple(msg.starts_after))


def output_to_proto(out: EngineCoreOutput, request_id: str, batch: ipc.OutputBatch | None = None
                    ) -> ipc.RequestOutput:
    """`out` as a message; with `batch`, built in place as its next output (half the cost of
    building one and appending a copy: this runs for every request every step)."""
    fields = dict(request_id=request_id, sample_index=out.sample_index, new_token_ids=out.new_token_ids,
                  finish_reason=out.finish_reason or "", num_prompt_tokens=out.num_prompt_tokens,
                  num_cached_tokens=out.num_cached_tokens, error=out.error or "")
    msg = ipc.RequestOutput(**fields) if batch is None else batch.outputs.add(**fields)
    if out.stop_token_id is not None:
        msg.stop_token_id = out.stop_token_id
    for token_id, logprobs in zip(out.new_token_ids, out.new_logprobs or ()):
        msg.logprobs.append(logprobs_to_proto(token_id, logprobs))
    if out.prompt_logprobs is not None:  # position 0 has none, so the message starts at 1
        msg.prompt_logprobs.extend(logprobs_to_proto(token_id, logprobs) for token_id, logprobs
                                   in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:]))
    if out.pooled is not None:
        msg.pooled.extend(out.pooled)
    return msg


def is_plain_token(out: EngineCoreOutput) -> bool:
    """One new token of sample 0 of a request that goes on, with nothing else to say: it
    travels in OutputBatch's packed lists (`add_plain_tokens`), not as a RequestOutput."""
    return (out.finish_reason is None and out.sample_index == 0 and len(out.new_token_ids) == 1
            and out.new_logprobs is None and out.prompt_logprobs is None)


def add_plain_tokens(batch: ipc.OutputBatch, plain: PlainTokens) -> None:
    """Plain tokens (engine.outputs.PlainTokens; an `is_plain_token` output is one too) into
    the batch's packed lists."""
    batch.token_request_ids.extend(plain.request_ids)
    batch.token_ids.extend(plain.token_ids)
    batch.token_num_cached_tokens.extend(plain.num_cached_tokens)


def plain_tokens_from_batch(batch: ipc.OutputBatch) -> list[EngineCoreOutput]:
    """The frontend's side of `add_plain_tokens`."""
    return list(map(plain_output, batch.token_request_ids, batch.token_ids, batch.token_num_cached_tokens))


def outputs_from_batch(batch: ipc.OutputBatch) -> list[EngineCoreOutput]:
    """Every output of a batch, packed ones included (for readers of raw engine replies)."""
    return [output_from_proto(msg) for msg in batch.outputs] + plain_tokens_from_batch(batch)


def logprobs_to_proto(token_id: int, logprobs: dict[int, float]) -> gen.PositionLogprobs:
    """The sampled token, then the others most likely first (the dict may hold the sampled
    token outside the top-N)."""
    top = sorted(logprobs.items(), key=lambda kv: -kv[1])
    return gen.PositionLogprobs(
        sampled=gen.TokenLogprob(token_id=token_id, logprob=logprobs[token_id]),
        top=[gen.TokenLogprob(token_id=t, logprob=lp) for t, lp in top])


def output_from_proto(msg: ipc.RequestOutput) -> EngineCoreOutput:
    """The frontend's side of `output_to_proto`: back to the dataclass the output processor takes."""
    prompt_logprobs = None
    if msg.prompt_logprobs:  # positions 1..; position 0 has none
        prompt_logprobs = [None] + [logprobs_from_proto(p) for p in msg.prompt_logprobs]
    return EngineCoreOutput(
        request_id=msg.request_id, sample_index=msg.sample_index, new_token_ids=list(msg.new_token_ids),
        new_logprobs=[logprobs_from_proto(p) for p in msg.logprobs] or None,
        finish_reason=msg.finish_reason or None,
        stop_token_id=msg.stop_token_id if msg.HasField("stop_token_id") else None,
        num_prompt_tokens=msg.num_prompt_tokens, num_cached_tokens=msg.num_cached_tokens,
        prompt_logprobs=prompt_logprobs, error=msg.error or None, pooled=list(msg.pooled) if msg.pooled else None)


def pooler_to_proto(pooler, max_tokens: int) -> ipc.Pooler:
    """engine.pooling.Pooler (duck-typed: common imports no engine code) as Welcome.pooler."""
    return ipc.Pooler(task=pooler.task, mode=pooler.mode, normalize=pooler.normalize,
                      dimensions=pooler.dimensions, matryoshka=pooler.matryoshka, max_tokens=max_tokens,
                      sigmoid=pooler.sigmoid)


def logprobs_from_proto(msg: gen.PositionLogprobs) -> dict[int, float]:
    logprobs = {t.token_id: t.logprob for t in msg.top}
    logprobs[msg.sampled.token_id] = msg.sampled.logprob
    return logprobs




def image_to_proto(image: ImageInput) -> ipc.ImageInput:
    pixels = np.ascontiguousarray(image.pixels, dtype="<f4")
    return ipc.ImageInput(pixels=pixels.tobytes(), shape=pixels.shape, grid=image.grid or (), hash=image.hash,
                          offset=image.offset, length=image.length)


def image_from_proto(msg: ipc.ImageInput) -> ImageInput:
    """Raises InvalidRequest when the bytes are not the shape's float32s."""
    shape = tuple(msg.shape)
    count = math.prod(shape) if shape else 0
    if not shape or not 0 < count <= MAX_PIXEL_BYTES // 4 or len(msg.pixels) != 4 * count:
        raise InvalidRequest(f"images: {len(msg.pixels)} bytes of pixels do not make float32s of shape {shape}")
    if msg.grid and len(msg.grid) != 3:
        raise InvalidRequest(f"images: a grid is (t, h, w), got {tuple(msg.grid)}")
    pixels = np.frombuffer(msg.pixels, dtype="<f4").reshape(shape).astype(np.float32)  # a writable copy
    return ImageInput(pixels, tuple(msg.grid) or None, msg.hash, msg.offset, msg.length)
