"""A response's output items, from a sample's events (frontend.output_events), whole or
streamed, and the Response object around them.

Items come in the order the sample wrote them: `reasoning` {content: [reasoning_text]},
`message` {content: [output_text]}, `function_call` {call_id, name, arguments}; each event
adds to the open item, or closes it and opens the next. Streamed, each step is also one of
the SDK's events, handed to `emit(type, data)`, which must serialize it at once (the item
goes on changing):

    response.output_item.added
      message:       response.content_part.added, response.output_text.delta*,
                     response.output_text.done, response.content_part.done
      reasoning:     the same with response.reasoning_text.delta*/done
      function_call: response.function_call_arguments.delta*, response.function_call_arguments.done
    response.output_item.done
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

from frontend.http.responses.request import ResponsesRequest
from frontend.http.sample_output import call_id
from frontend.output_events import CallArguments, CallStart, Content, Event, Reasoning

Emit = Callable[[str, dict], None]
_PART = {"message": "output_text", "reasoning": "reasoning_text"}


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputItems:
    def __init__(self, emit: Emit | None = None) -> None:
        self.items: list[dict] = []
        self.emit = emit or (lambda kind, data: None)
        self.open = False  # is the last item still being written?
        self.calls: dict[int, int] = {}  # a call's index (its CallStart's) -> its place in `items`

    def send(self, events: list[Event]) -> None:
        for e in events:
            if isinstance(e, (Reasoning, Content)):
                if e.text:
                    self._text("reasoning" if isinstance(e, Reasoning) else "message", e.text)
            elif isinstance(e, CallStart):
                self.calls[e.index] = self._open({"id": new_id("fc"), "type": "function_call", "call_id":
                                                  call_id("call_"), "name": e.name, "arguments": ""})
            elif isinstance(e, CallArguments):
                where = self.calls[e.index]
                self.items[where]["arguments"] += e.text
                self.emit("response.function_call_arguments.delta", {
                    "item_id": self.items[where]["id"], "output_index": where, "delta": e.text})

    def close(self, cut: bool) -> None:
        """The sample has ended (`cut`: by the length, which leaves its last item incomplete).
        An answer with nothing in it still gets its (empty) message."""
        if not self.items:
            self._text("message", "")
        self._finish("incomplete" if cut else "completed")

    @property
    def reasoning_text(self) -> str:
        return "".join(i["content"][0]["text"] for i in self.items if i["type"] == "reasoning")

    def _text(self, kind: str, text: str) -> None:
        if not (self.open and self.items[-1]["type"] == kind):
            item = {"id": new_id("msg"), "type": "message", "role": "assistant", "content": []} \
                if kind == "message" else {"id": new_id("rs"), "type": "reasoning", "summary": [], "content": []}
            where = self._open(item)
            part = {"type": _PART[kind], "text": ""}
            if kind == "message":
                part |= {"annotations": [], "logprobs": []}
            item["content"].append(part)
            self.emit("response.content_part.added", self._at(where) | {"part": part})
        where = len(self.items) - 1
        self.items[where]["content"][0]["text"] += text
        if text:
            self.emit(f"response.{_PART[kind]}.delta", self._at(where) | {"delta": text} | self._logprobs(kind))

    def _open(self, item: dict) -> int:
        if self.open:
            self._finish("completed")
        item["status"] = "in_progress"
        self.items.append(item)
        self.open = True
        where = len(self.items) - 1
        self.emit("response.output_item.added", {"output_index": where, "item": self.items[where]})
        return where

    def _finish(self, status: str) -> None:
        where, item = len(self.items) - 1, self.items[-1]
        if item["type"] == "function_call":
            self.emit("response.function_call_arguments.done", {
                "item_id": item["id"], "output_index": where, "name": item["name"], "arguments": item["arguments"]})
        else:
            kind, part = item["type"], item["content"][0]
            self.emit(f"response.{_PART[kind]}.done", self._at(where) | {"text": part["text"]} | self._logprobs(kind))
            self.emit("response.content_part.done", self._at(where) | {"part": part})
        item["status"] = status
        self.open = False
        self.emit("response.output_item.done", {"output_index": where, "item": item})

    def _at(self, where: int) -> dict:
        return {"item_id": self.items[where]["id"], "output_index": where, "content_index": 0}

    @staticmethod
    def _logprobs(kind: str) -> dict:
        return {"logprobs": []} if kind == "message" else {}


class ResponseShell:
    """What every state of one response shares: its id, its creation time and the echo of its
    request's settings (OpenAI's Response object repeats them)."""

    def __init__(self, req: ResponsesRequest, model: str, temperature: float, top_p: float) -> None:
        self.id, self.created_at = new_id("resp"), int(time.time())
        self.echo = {
            "background": bool(req.background), "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens, "max_tool_calls": None, "metadata": req.metadata or {},
            "model": model, "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id, "reasoning": req.reasoning, "store": req.keeps,
            "temperature": temperature, "text": req.text or {"format": {"type": "text"}},
            "tool_choice": req.tool_choice or "auto", "tools": req.tools or [], "top_p": top_p,
            "truncation": "disabled", "user": req.user}

    def body(self, status: str, output: list[dict] = (), usage: dict | None = None,
             error: dict | None = None) -> dict:
        """The Response object in `status`; error: {code, message} when it failed."""
        done = status in ("completed", "incomplete")
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "completed_at": int(time.time()) if status == "completed" else None, "error": error,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "output": list(output), "usage": usage if done else None, **self.echo}


def usage(input_tokens: int, cached_tokens: int, output_tokens: int, reasoning_tokens: int) -> dict:
    return {"input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": cached_tokens},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": input_tokens + output_tokens}
