"""Anthropic's Messages API (POST /v1/messages), streamed or not, with tools.

    stop_reason: eos -> end_turn (tool_use when calls were made), a stop sequence ->
                 stop_sequence, max_tokens -> max_tokens
    stream events: message_start, then per content block (thinking, text, tool_use)
                   content_block_start, content_block_delta* (thinking_delta then signature_delta,
                   text_delta, input_json_delta), content_block_stop, then message_delta
                   (stop_reason, output_tokens), message_stop
    tools: the same machinery as OpenAI's chat (frontend/tool_calls); in the input, assistant
           tool_use blocks become the chat's tool_calls, user tool_result blocks tool messages
    thinking: the reasoning parser's (frontend/reasoning) reasoning, as thinking blocks; the
              request's `thinking` is the template's enable_thinking; thinking blocks sent
              back become the assistant message's reasoning_content
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from common.errors import InvalidRequest
from frontend.async_llm import Generation
from frontend.http.context import HttpContext, parse_body
from frontend.http.errors import from_exception
from frontend.http.params import anthropic_template_kwargs, anthropic_tool_use, messages_params
from frontend.http.protocol import (AnthropicMessage, Base64Source, ImageBlock, MessagesRequest, TextPart,
                                    ThinkingBlock, ToolResultBlock, ToolUseBlock, UrlSource)
from frontend.http.runner import run_to_end, unless_disconnected
from frontend.http.sample_output import AnthropicBlocks, anthropic_blocks
from frontend.multimodal.parts import ImageRef, collapse, image_part, load_images, only_in_user, text_part, url_ref
from frontend.output_processor import EOS, LENGTH, STOP_STRING, STOPPED
from frontend.sample_parser import SampleParser
from frontend.tool_calls import arguments as call_arguments

_STOP_REASONS = {EOS: "end_turn", STOP_STRING: "stop_sequence", LENGTH: "max_tokens"}


def _event(kind: str, data: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n"


def _text(content) -> str:
    return content if isinstance(content, str) else "".join(part.text for part in content)


def _stop_reason(reason: str | None, num_calls: int) -> str:
    if num_calls and reason in STOPPED:
        return "tool_use"
    return _STOP_REASONS.get(reason, "end_turn")


def _chat_messages(m: AnthropicMessage, i: int) -> list[dict]:
    """messages[i] as chat messages: tool results first (each a tool message), then the text,
    with the assistant's tool_use blocks as its tool_calls and its thinking as its
    reasoning_content."""
    if isinstance(m.content, str):
        return [{"role": m.role, "content": m.content}]
    for j, b in enumerate(m.content):
        if isinstance(b, ToolUseBlock):
            call_arguments.check(b.input, f"messages[{i}].content[{j}].input")
        elif isinstance(b, ToolResultBlock) and not isinstance(b.content, str):
            k = next((k for k, c in enumerate(b.content) if isinstance(c, ImageBlock)), None)
            if k is not None:
                raise InvalidRequest(f"messages[{i}].content[{j}].content[{k}]: images in a tool_result are not "
                                     "supported; send them in the user message's content")
    results = [{"role": "tool", "tool_call_id": b.tool_use_id, "content": _text(b.content)}
               for b in m.content if isinstance(b, ToolResultBlock)]
    parts = [text_part(b.text) if isinstance(b, TextPart) else image_part(_image_ref(b, f"messages[{i}].content[{j}]"))
             for j, b in enumerate(m.content) if isinstance(b, (TextPart, ImageBlock))]
    only_in_user(parts, m.role, f"messages[{i}].content")
    content = collapse(parts)
    calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
             for b in m.content if isinstance(b, ToolUseBlock)]
    thinking = "".join(b.thinking for b in m.content if isinstance(b, ThinkingBlock))
    message = {"role": m.role, "content": content, **({"tool_calls": calls} if calls else {}),
               **({"reasoning_content": thinking} if thinking else {})}
    return results + ([message] if content or calls or not results else [])


def _image_ref(block: ImageBlock, where: str) -> ImageRef:
    source = block.source
    if isinstance(source, Base64Source):
        return ImageRef(f"{where}.source.data", data=source.data, media_type=source.media_type)
    if isinstance(source, UrlSource):
        return url_ref(source.url, f"{where}.source.url")
    raise InvalidRequest(f"{where}.source: file sources (the Files API) are not supported; send the image as "
                         "base64 or a url")


async def create_message(ctx: HttpContext, request: Request):
    body = await parse_body(request, MessagesRequest)
    lora_name = ctx.resolve_model(body.model)
    processor = ctx.llm.require_ready()
    tools = anthropic_tool_use(body)
    template_kwargs = anthropic_template_kwargs(body)
    messages = [{"role": "system", "content": _text(body.system)}] if body.system else []
    messages += [chat for i, m in enumerate(body.messages) for chat in _chat_messages(m, i)]
    messages = await load_images(messages, ctx.media.load, processor.check_images)
    # A conversation ending with the assistant's words asks the model to continue them.
    continue_final = messages[-1]["role"] == "assistant" if messages else False
    messages, template_tools = processor.chat_with_tools(messages, tools)
    prompt, images = await processor.chat_prompt_async(
        messages, add_generation_prompt=not continue_final, continue_final_message=continue_final,
        chat_template_kwargs=template_kwargs, tools=template_tools)
    params = messages_params(body, tools, processor, ctx.parser_names(tools)[0], prompt)
    generation = ctx.llm.admit(prompt, params, lora_name=lora_name, images=images)
    message_id = f"msg_{uuid.uuid4().hex}"
    omit_thinking = body.thinking is not None and body.thinking.display == "omitted"
    if body.stream:
        parser = ctx.sample_parser(tools)
        blocks = AnthropicBlocks(_event, omit_thinking)
        return StreamingResponse(ctx.counted(_stream(ctx, generation, message_id, body.model, parser, blocks)),
                                 media_type="text/event-stream")
    [[sample]] = await unless_disconnected(request, ctx.counted_call(run_to_end(ctx.llm, [generation])))
    content = anthropic_blocks(ctx.parse_sample(sample.text, tools, sample.token_ids), omit_thinking)
    num_calls = sum(b["type"] == "tool_use" for b in content)
    return JSONResponse({
        "id": message_id, "type": "message", "role": "assistant", "model": body.model,
        "content": content or [{"type": "text", "text": ""}],
        "stop_reason": _stop_reason(sample.finish_reason, num_calls),
        "stop_sequence": sample.stop_reason if sample.finish_reason == STOP_STRING else None,
        "usage": _usage(generation)})


def _usage(generation: Generation) -> dict:
    return {"input_tokens": len(generation.state.prompt), "output_tokens": generation.state.num_completion_tokens,
            "cache_read_input_tokens": generation.state.num_cached_tokens}


async def _stream(ctx: HttpContext, generation: Generation, message_id: str, model: str,
                  parser: SampleParser, blocks: AnthropicBlocks) -> AsyncIterator[str]:
    yield _event("message_start", {"message": {
        "id": message_id, "type": "message", "role": "assistant", "model": model, "content": [],
        "stop_reason": None, "stop_sequence": None, "usage": {**_usage(generation), "output_tokens": 0}}})
    reason, stop = None, None
    try:
        async for deltas in ctx.llm.generate(generation):
            for d in deltas:
                final = d.finish_reason is not None
                for event in blocks.send(parser.feed(d.text, final, d.token_ids)):
                    yield event
                if final:
                    reason, stop = d.finish_reason, d.stop_reason
    except Exception as e:  # noqa: BLE001 - the stream has started: Anthropic's in-band error event
        yield _event("error", {"error": from_exception(e).body()["error"]})
        return
    for event in blocks.close():
        yield event
    yield _event("message_delta", {
        "delta": {"stop_reason": _stop_reason(reason, parser.num_calls),
                  "stop_sequence": stop if reason == STOP_STRING else None},
        "usage": {"output_tokens": generation.state.num_completion_tokens}})
    yield _event("message_stop", {})
