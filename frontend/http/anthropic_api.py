"""Anthropic's Messages API (POST /v1/messages), streamed or not.

    stop_reason: eos -> end_turn, a stop sequence -> stop_sequence, max_tokens -> max_tokens
    stream events: message_start, content_block_start, content_block_delta*, content_block_stop,
                   message_delta (stop_reason, output_tokens), message_stop
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from frontend.async_llm import Generation
from frontend.http.context import HttpContext, parse_body
from frontend.http.errors import from_exception
from frontend.http.params import messages_params
from frontend.http.protocol import MessagesRequest
from frontend.http.runner import run_to_end, unless_disconnected
from frontend.output_processor import EOS, LENGTH, STOP_STRING

_STOP_REASONS = {EOS: "end_turn", STOP_STRING: "stop_sequence", LENGTH: "max_tokens"}


def _event(kind: str, data: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n"


def _text(content) -> str:
    return content if isinstance(content, str) else "".join(part.text for part in content)


async def create_message(ctx: HttpContext, request: Request):
    body = await parse_body(request, MessagesRequest)
    ctx.check_model(body.model)
    processor = ctx.llm.require_ready()
    params = messages_params(body)
    messages = [{"role": "system", "content": _text(body.system)}] if body.system else []
    messages += [{"role": m.role, "content": _text(m.content)} for m in body.messages]
    # A conversation ending with the assistant's words asks the model to continue them.
    continue_final = messages[-1]["role"] == "assistant" if messages else False
    prompt = processor.tokenize_chat(messages, add_generation_prompt=not continue_final,
                                     continue_final_message=continue_final)
    generation = ctx.llm.admit(prompt, params)
    message_id = f"msg_{uuid.uuid4().hex}"
    if body.stream:
        return StreamingResponse(ctx.counted(_stream(ctx, generation, message_id, body.model)),
                                 media_type="text/event-stream")
    [[sample]] = await unless_disconnected(request, ctx.counted_call(run_to_end(ctx.llm, [generation])))
    return JSONResponse({
        "id": message_id, "type": "message", "role": "assistant", "model": body.model,
        "content": [{"type": "text", "text": sample.text}],
        "stop_reason": _STOP_REASONS.get(sample.finish_reason, "end_turn"),
        "stop_sequence": sample.stop_reason if sample.finish_reason == STOP_STRING else None,
        "usage": _usage(generation)})


def _usage(generation: Generation) -> dict:
    return {"input_tokens": len(generation.state.prompt), "output_tokens": generation.state.num_completion_tokens,
            "cache_read_input_tokens": generation.state.num_cached_tokens}


async def _stream(ctx: HttpContext, generation: Generation, message_id: str, model: str) -> AsyncIterator[str]:
    yield _event("message_start", {"message": {
        "id": message_id, "type": "message", "role": "assistant", "model": model, "content": [],
        "stop_reason": None, "stop_sequence": None, "usage": {**_usage(generation), "output_tokens": 0}}})
    yield _event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})
    reason, stop = None, None
    try:
        async for deltas in ctx.llm.generate(generation):
            for d in deltas:
                if d.text:
                    yield _event("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": d.text}})
                if d.finish_reason is not None:
                    reason, stop = d.finish_reason, d.stop_reason
    except Exception as e:  # noqa: BLE001 - the stream has started: Anthropic's in-band error event
        yield _event("error", {"error": from_exception(e).body()["error"]})
        return
    yield _event("content_block_stop", {"index": 0})
    yield _event("message_delta", {
        "delta": {"stop_reason": _STOP_REASONS.get(reason, "end_turn"),
                  "stop_sequence": stop if reason == STOP_STRING else None},
        "usage": {"output_tokens": generation.state.num_completion_tokens}})
    yield _event("message_stop", {})
