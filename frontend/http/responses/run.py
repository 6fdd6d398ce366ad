"""One admitted response, run one of three ways: whole (the JSON answer), streamed (the SDK's
events over SSE) or in the background (a task; GET shows how far it is, cancel aborts it).
Each stores its result when the request said store (the default)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from fastapi import Request

from frontend.async_llm import Generation
from frontend.http.context import HttpContext
from frontend.http.errors import HTTPError, from_exception
from frontend.http.responses.items import Item, parse_item
from frontend.http.responses.output import OutputItems, ResponseShell, usage
from frontend.http.responses.request import ResponsesRequest
from frontend.http.responses.store import ResponseStore, Stored
from frontend.http.runner import run_to_end, unless_disconnected
from frontend.output_processor import LENGTH
from frontend.tool_calls.tools import ToolUse

# ResponseError.code for what ended a response: the closest of OpenAI's codes.
_ERROR_CODES = {400: "invalid_prompt", 429: "rate_limit_exceeded"}


class Run:
    def __init__(self, ctx: HttpContext, store: ResponseStore, req: ResponsesRequest, tools: ToolUse | None,
                 conversation: list[Item], generation: Generation) -> None:
        self.ctx, self.store, self.req, self.tools = ctx, store, req, tools
        self.conversation = conversation  # the items its prompt was made of
        self.generation = generation
        params = generation.state.params
        self.shell = ResponseShell(req, req.model or ctx.served_name, params.temperature, params.top_p)
        self.stored: Stored | None = None  # a background response's entry

    async def whole(self, request: Request) -> dict:
        """Run to the end; a client that leaves first aborts it (unless_disconnected)."""
        body = await unless_disconnected(request, self.ctx.counted_call(self._complete()))
        if self.req.keeps:
            self.store.put(body, self._after(body))
        return body

    def background(self) -> dict:
        """Start it in a task and answer at once: the response, queued."""
        body = self.shell.body("queued")
        self.stored = self.store.put(body, self.conversation, asyncio.ensure_future(self._in_background()))
        return body

    async def stream(self) -> AsyncIterator[str]:
        """The SDK's events: response.created, response.in_progress, each item's (output.py),
        then response.completed or response.incomplete; after a failure, error and response.failed."""
        events = _Events()
        output = OutputItems(events.add)
        for kind in ("response.created", "response.in_progress"):
            events.add(kind, {"response": self.shell.body("in_progress")})
        yield events.flush()
        parser, reason = self.ctx.sample_parser(self.tools), None
        try:
            async for deltas in self.ctx.llm.generate(self.generation):
                for d in deltas:
                    output.send(parser.feed(d.text, d.finish_reason is not None, d.token_ids))
                    reason = d.finish_reason or reason
                chunk = events.flush()
                if chunk:  # text a parser holds back (a possible tag) makes no event yet
                    yield chunk
        except Exception as e:  # noqa: BLE001 - the stream has started: report in-band
            error = from_exception(e)
            events.add("error", {"code": error.code or error.type, "message": error.message, "param": error.param})
            events.add("response.failed", {"response": self.shell.body("failed", output.items, error=_error(error))})
            yield events.flush()
            return
        body = self._finish(output, reason)
        if self.req.keeps:
            self.store.put(body, self._after(body))
        events.add("response.completed" if body["status"] == "completed" else "response.incomplete", {"response": body})
        yield events.flush()

    async def _in_background(self) -> None:
        stored = self.stored  # set by background() before this task first runs
        stored.body = self.shell.body("in_progress")
        try:
            body = await self.ctx.counted_call(self._complete())
            stored.conversation = self._after(body)
        except asyncio.CancelledError:  # cancelled, deleted or dropped from the store
            stored.body = self.shell.body("cancelled")
            raise
        except Exception as e:  # noqa: BLE001 - no client is waiting: the stored response says it failed
            body = self.shell.body("failed", error=_error(from_exception(e)))
        stored.body = body

    async def _complete(self) -> dict:
        [[sample]] = await run_to_end(self.ctx.llm, [self.generation])
        output = OutputItems()
        output.send(self.ctx.parse_sample(sample.text, self.tools, sample.token_ids))
        return self._finish(output, sample.finish_reason)

    def _finish(self, output: OutputItems, reason: str | None) -> dict:
        """The finished Response object: incomplete when the length cut it."""
        output.close(cut=reason == LENGTH)
        state, reasoning = self.generation.state, output.reasoning_text
        # Thinking is not counted apart as it streams: its tokens are its text's, re-tokenized.
        reasoning_tokens = len(self.ctx.llm.tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning else 0
        return self.shell.body("incomplete" if reason == LENGTH else "completed", output.items, usage(
            len(state.prompt), state.num_cached_tokens, state.num_completion_tokens, reasoning_tokens))

    def _after(self, body: dict) -> list[Item]:
        """The conversation a later previous_response_id continues: the prompt's items, then the output."""
        return self.conversation + [parse_item(item, "output") for item in body["output"]]


def _error(error: HTTPError) -> dict:
    """A failed response's `error` (OpenAI's ResponseError)."""
    return {"code": _ERROR_CODES.get(error.status, "server_error"), "message": error.message}


class _Events:
    """Server-sent events, each {type, sequence_number, ...}, serialized as it is added."""

    def __init__(self) -> None:
        self.sequence_number, self.pending = 0, []

    def add(self, kind: str, data: dict) -> None:
        event = {"type": kind, "sequence_number": self.sequence_number, **data}
        self.pending.append(f"event: {kind}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n")
        self.sequence_number += 1

    def flush(self) -> str:
        out, self.pending = "".join(self.pending), []
        return out
