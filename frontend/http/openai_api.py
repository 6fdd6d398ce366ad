"""OpenAI's /v1/completions and /v1/chat/completions, with vLLM's extras, streamed or not.

Each route parses its body, turns it into prompts and `SamplingParams`, admits every
generation before the response starts (so a bad request gets a real 400 even when it asked
to stream), then runs them through AsyncLLM and writes OpenAI's shapes.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from common.errors import InvalidRequest
from frontend.async_llm import Generation
from frontend.http.context import HttpContext, parse_body
from frontend.http.errors import from_exception
from frontend.http.params import chat_params, chat_template_kwargs, completion_params, openai_tool_use
from frontend.http.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest, ImageUrlPart, TextPart
from frontend.http.runner import SampleResult, merged, run_to_end, unless_disconnected
from frontend.http.sample_output import OpenAIDeltas, openai_message
from frontend.multimodal.parts import ImageRef, collapse, image_part, load_images, only_in_user, text_part, url_ref
from frontend.output_processor import STOPPED, PositionLogprobs, SampleDelta
from frontend.tool_calls import arguments as call_arguments


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


def finish_reason(reason: str | None, num_calls: int = 0) -> str | None:
    """OpenAI's names: eos, stop strings and stop tokens are all "stop", or "tool_calls" when
    the sample made calls; vLLM's "abort" stays, and so does "length" (a call may be cut off)."""
    if reason in STOPPED:
        return "tool_calls" if num_calls else "stop"
    return reason


def stop_reason(reason: str | None, value: str | int | None) -> str | int | None:
    return None if reason not in STOPPED or reason == "eos" else value  # vLLM: eos is not a stop_reason


async def create_completion(ctx: HttpContext, request: Request):
    body = await parse_body(request, CompletionRequest)
    lora_name = ctx.resolve_model(body.model)
    processor = ctx.llm.require_ready()
    params = completion_params(body, processor)
    prompts = _completion_prompts(processor, body)
    generations = [ctx.llm.admit(p, params, priority=body.priority, lora_name=lora_name) for p in prompts]
    response = _Response(ctx, "cmpl", "text_completion", body.model, generations, body.stream_options)
    if body.stream:
        return StreamingResponse(ctx.counted(response.stream(_completion_chunk(body, ctx))),
                                 media_type="text/event-stream")
    results = await unless_disconnected(request, ctx.counted_call(run_to_end(ctx.llm, generations)))
    choices = []
    for g, samples in zip(generations, results):
        for s in samples:
            choices.append(_completion_choice(ctx, body, g, s, len(choices)))
    return JSONResponse(response.body(choices))


async def create_chat_completion(ctx: HttpContext, request: Request):
    body = await parse_body(request, ChatCompletionRequest)
    lora_name = ctx.resolve_model(body.model)
    processor = ctx.llm.require_ready()
    tools = openai_tool_use(body)
    messages = await chat_messages(ctx, body.messages, processor.check_images)
    messages, template_tools = processor.chat_with_tools(messages, tools)
    prompt, images = await processor.chat_prompt_async(
        messages, add_generation_prompt=body.add_generation_prompt and not body.continue_final_message,
        continue_final_message=body.continue_final_message, chat_template_kwargs=chat_template_kwargs(body),
        tools=template_tools)
    params = chat_params(body, tools, processor, ctx.parser_names(tools)[0], prompt)
    generation = ctx.llm.admit(prompt, params, priority=body.priority, lora_name=lora_name, images=images)
    response = _Response(ctx, "chatcmpl", "chat.completion", body.model, [generation], body.stream_options)
    if body.stream:
        return StreamingResponse(ctx.counted(response.stream(_chat_chunk(ctx, tools), role_first=True)),
                                 media_type="text/event-stream")
    [samples] = await unless_disconnected(request, ctx.counted_call(run_to_end(ctx.llm, [generation])))
    choices = [_chat_choice(ctx, s, params.logprobs is not None, tools) for s in samples]
    return JSONResponse(response.body(choices))


def _chat_choice(ctx: HttpContext, s: SampleResult, logprobs: bool, tools) -> dict:
    reasoning, tool_parser = ctx.parser_names(tools)
    message = {"role": "assistant", **openai_message(ctx.parse_sample(s.text, tools, s.token_ids),
                                                     reasoning is not None, tool_parser is not None)}
    return {"index": s.index, "message": message,
            "logprobs": _chat_logprobs(ctx, s.logprobs) if logprobs else None,
            "finish_reason": finish_reason(s.finish_reason, len(message.get("tool_calls", ()))),
            "stop_reason": stop_reason(s.finish_reason, s.stop_reason)}


class _Response:
    """What the chunks and the final body of one response share: id, model, usage."""

    def __init__(self, ctx: HttpContext, prefix: str, obj: str, model: str | None,
                 generations: list[Generation], stream_options) -> None:
        self.llm = ctx.llm
        self.id, self.object, self.created = f"{prefix}-{uuid.uuid4().hex}", obj, int(time.time())
        self.model = model or ctx.served_name
        self.generations = generations
        self.include_usage = bool(stream_options and stream_options.include_usage)
        self.continuous_usage = bool(stream_options and stream_options.continuous_usage_stats)

    def usage(self) -> dict:
        prompt = sum(len(g.state.prompt) for g in self.generations)
        completion = sum(g.state.num_completion_tokens for g in self.generations)
        cached = sum(g.state.num_cached_tokens for g in self.generations)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def body(self, choices: list[dict]) -> dict:
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": choices, "usage": self.usage()}

    async def stream(self, make_choice, role_first: bool = False) -> AsyncIterator[str]:
        n = self.generations[0].state.params.n
        chunk_object = self.object + ".chunk" if self.object == "chat.completion" else self.object
        try:
            if role_first:  # chat: every choice's first chunk names the role
                yield sse(self._chunk(chunk_object, [
                    {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                     "finish_reason": None} for i in range(n)]))
            async for which, deltas in merged(self.llm, self.generations):
                choices = [make_choice(self.generations[which], which * n + d.index, d) for d in deltas]
                yield sse(self._chunk(chunk_object, choices))
            if self.include_usage:
                yield sse({**self._chunk(chunk_object, []), "usage": self.usage()})
        except Exception as e:  # noqa: BLE001 - the response has started: report in-band
            yield sse(from_exception(e).body())
        yield sse("[DONE]")

    def _chunk(self, obj: str, choices: list[dict]) -> dict:
        chunk = {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}
        if self.continuous_usage and choices:
            chunk["usage"] = self.usage()
        return chunk


def _completion_prompts(processor, body: CompletionRequest) -> list[list[int]]:
    prompt = body.prompt
    if isinstance(prompt, str):
        return [processor.tokenize(prompt, body.add_special_tokens, field="prompt")]
    if not prompt:
        raise InvalidRequest("prompt: must not be empty")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    if all(isinstance(p, str) for p in prompt):
        return [processor.tokenize(p, body.add_special_tokens, field=f"prompt[{i}]") for i, p in enumerate(prompt)]
    return [list(p) for p in prompt]


def _completion_choice(ctx: HttpContext, body: CompletionRequest, g: Generation, s: SampleResult, index: int) -> dict:
    text, logprobs = _completion_output(ctx, body, g, s.text, s.logprobs, s.token_ids, body.echo)
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason(s.finish_reason),
            "stop_reason": stop_reason(s.finish_reason, s.stop_reason)}


def _completion_chunk(body: CompletionRequest, ctx: HttpContext):
    offsets: dict[int, int] = {}  # per choice: the length of its text so far, where text_offset goes on

    def make(g: Generation, index: int, d: SampleDelta) -> dict:
        echo = body.echo and index not in offsets  # the prompt comes first, in the choice's first chunk
        start = offsets.setdefault(index, 0)
        text, logprobs = _completion_output(ctx, body, g, d.text, d.logprobs, d.token_ids, echo, start)
        if logprobs is not None:
            offsets[index] = start + sum(len(t) for t in logprobs["tokens"])
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason(d.finish_reason),
                "stop_reason": stop_reason(d.finish_reason, d.stop_reason)}
    return make


def _completion_output(ctx: HttpContext, body: CompletionRequest, g: Generation, text: str,
                       positions: list[PositionLogprobs], ids: list[int], echo: bool,
                       start: int = 0) -> tuple[str, dict | None]:
    """A choice's text and legacy logprobs; with `echo`, the prompt's first (lm-evaluation-harness's
    loglikelihood reads the prompt's logprobs there)."""
    if echo:
        text = ctx.llm.tokenizer.decode(g.state.prompt, skip_special_tokens=body.skip_special_tokens) + text
    if body.logprobs is None:
        return text, None
    positions, ids = list(positions), list(ids)
    if echo:
        positions = list(g.state.prompt_logprobs or [None] * len(g.state.prompt)) + positions
        ids = g.state.prompt + ids
    return text, _completion_logprobs(ctx, positions, ids, start)


def _chat_chunk(ctx: HttpContext, tools):
    streams: dict[int, OpenAIDeltas] = {}  # per choice

    def make(g: Generation, index: int, d: SampleDelta) -> dict:
        logprobs = _chat_logprobs(ctx, d.logprobs) if g.state.params.logprobs is not None else None
        stream = streams.get(index) or streams.setdefault(index, OpenAIDeltas(ctx.sample_parser(tools)))
        delta = stream.delta(d.text, d.finish_reason is not None, d.token_ids)
        return {"index": index, "delta": delta, "logprobs": logprobs,
                "finish_reason": finish_reason(d.finish_reason, stream.parser.num_calls),
                "stop_reason": stop_reason(d.finish_reason, d.stop_reason)}
    return make


def _completion_logprobs(ctx: HttpContext, positions: list[PositionLogprobs | None], ids: list[int],
                         start: int = 0) -> dict:
    """OpenAI's legacy shape; the first prompt token (with echo) has no logprob: null. A stream's
    chunks go on from `start`, the length of the text before them."""
    text = ctx.token_text
    tokens = [text(t) for t in ids]
    offsets, offset = [], start
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    return {"tokens": tokens,
            "token_logprobs": [None if p is None else p.sampled.logprob for p in positions],
            "top_logprobs": [None if p is None else {text(t.token_id): t.logprob for t in p.top} for p in positions],
            "text_offset": offsets}


def _chat_logprobs(ctx: HttpContext, positions: list[PositionLogprobs]) -> dict:
    def entry(token_id: int, logprob: float) -> dict:
        token = ctx.token_text(token_id)
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}
    return {"content": [{**entry(p.sampled.token_id, p.sampled.logprob),
                         "top_logprobs": [entry(t.token_id, t.logprob) for t in p.top]} for p in positions]}


async def chat_messages(ctx: HttpContext, messages: list[ChatMessage], check=None) -> list[dict]:
    """The request's messages as the template takes them, every image fetched and decoded
    (`check`: as load_images')."""
    return await load_images([_chat_message(m, i) for i, m in enumerate(messages)], ctx.media.load, check)


def chat_content(m: ChatMessage, i: int) -> str | list[dict]:
    """messages[i]'s content: its text, or its parts where it holds an image (multimodal/parts.py)."""
    if not isinstance(m.content, list):
        return m.content or ""
    parts = [text_part(p.text) if isinstance(p, TextPart) else image_part(_image_ref(p, f"messages[{i}].content[{j}]"))
             for j, p in enumerate(m.content)]
    only_in_user(parts, m.role, f"messages[{i}].content")
    return collapse(parts)


def _image_ref(part: ImageUrlPart, where: str) -> ImageRef:
    if isinstance(part.image_url, str):
        return url_ref(part.image_url, f"{where}.image_url")
    return url_ref(part.image_url.url, f"{where}.image_url.url")


def _chat_message(m: ChatMessage, i: int) -> dict:
    if m.role not in ("system", "user", "assistant", "tool", "developer"):
        raise InvalidRequest(f"messages[{i}].role: {m.role!r} is not one of system, user, assistant, tool, developer")
    message = {**(m.model_extra or {}), "role": m.role, "content": chat_content(m, i)}
    calls = message.get("tool_calls")
    for j, call in enumerate(calls if isinstance(calls, list) else []):
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict) and "arguments" in function:
            call_arguments.check(function["arguments"], f"messages[{i}].tool_calls[{j}].function.arguments")
    return message

