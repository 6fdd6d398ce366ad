"""The Responses API's parts without a server: output items and stream events from a sample's
events (reasoning too, which the bundled model never writes), items -> chat messages, and
the bounded store (LRU, TTL, background tasks cancelled when dropped)."""

from __future__ import annotations

import asyncio

import pytest

from common.errors import InvalidRequest
from frontend.http.errors import HTTPError
from frontend.http.responses.items import CallOutput, FunctionCall, Message, Thought, chat_messages, parse_input
from frontend.http.responses.output import OutputItems
from frontend.http.responses.store import ResponseStore
from frontend.output_events import CallArguments, CallStart, Content, Reasoning


def streamed(events, cut=False):
    seen = []
    output = OutputItems(lambda kind, data: seen.append((kind, data.get("output_index"))))
    for e in events:
        output.send([e])
    output.close(cut)
    return output.items, seen


def test_reasoning_message_and_calls_in_order():
    items, seen = streamed([Reasoning("Let me "), Reasoning("think."), Content("Checking."),
                            CallStart(0, "f"), CallArguments(0, '{"a":'), CallArguments(0, " 1}"),
                            CallStart(1, "g"), CallArguments(1, "{}")])
    assert [i["type"] for i in items] == ["reasoning", "message", "function_call", "function_call"]
    assert items[0]["content"] == [{"type": "reasoning_text", "text": "Let me think."}] and items[0]["summary"] == []
    assert items[1]["content"][0] == {"type": "output_text", "text": "Checking.", "annotations": [], "logprobs": []}
    assert [(i["name"], i["arguments"]) for i in items[2:]] == [("f", '{"a": 1}'), ("g", "{}")]
    assert items[2]["call_id"].startswith("call_") and items[2]["id"].startswith("fc_")
    assert all(i["status"] == "completed" for i in items)
    assert seen == [
        ("response.output_item.added", 0), ("response.content_part.added", 0),
        ("response.reasoning_text.delta", 0), ("response.reasoning_text.delta", 0),
        ("response.reasoning_text.done", 0), ("response.content_part.done", 0), ("response.output_item.done", 0),
        ("response.output_item.added", 1), ("response.content_part.added", 1), ("response.output_text.delta", 1),
        ("response.output_text.done", 1), ("response.content_part.done", 1), ("response.output_item.done", 1),
        ("response.output_item.added", 2), ("response.function_call_arguments.delta", 2),
        ("response.function_call_arguments.delta", 2), ("response.function_call_arguments.done", 2),
        ("response.output_item.done", 2), ("response.output_item.added", 3),
        ("response.function_call_arguments.delta", 3), ("response.function_call_arguments.done", 3),
        ("response.output_item.done", 3)]


def test_a_cut_sample_leaves_its_last_item_incomplete_and_nothing_is_an_empty_message():
    items, _ = streamed([Reasoning("Hm"), Content("Par")], cut=True)
    assert [i["status"] for i in items] == ["completed", "incomplete"]
    items, seen = streamed([])
    assert [(i["type"], i["content"][0]["text"]) for i in items] == [("message", "")]
    assert "response.output_text.delta" not in [kind for kind, _ in seen]


def test_an_added_item_is_serialized_as_it_was():
    """The stream writes each event when it is emitted: the item added is still empty."""
    added = []
    output = OutputItems(lambda kind, data: added.append(repr(data)) if kind.endswith("item.added") else None)
    output.send([Content("Hello")])
    output.close(False)
    assert "'content': []" in added[0] and "Hello" not in added[0]


def test_an_assistant_turn_is_one_chat_message():
    items = parse_input([{"role": "developer", "content": "Be kind."}, {"role": "user", "content": "Hi"},
                         {"type": "reasoning", "id": "rs_1", "summary": [],
                          "content": [{"type": "reasoning_text", "text": "A call."}]},
                         {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Ok."}]},
                         {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                         {"type": "function_call_output", "call_id": "c1", "output": "2"}], [])
    assert items[2:4] == [Thought("A call."), Message("assistant", "Ok.")]
    assert chat_messages(items, "Rules.") == [
        {"role": "system", "content": "Rules."}, {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Ok.", "reasoning_content": "A call.",
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "2"}]


def test_an_output_may_answer_a_call_of_the_earlier_conversation():
    earlier = [Message("user", "Hi"), FunctionCall("c1", "f", "{}")]
    assert parse_input([{"type": "function_call_output", "call_id": "c1", "output": "2"}], earlier) == \
        [CallOutput("c1", "2")]
    with pytest.raises(InvalidRequest, match=r"input\[0\]\.call_id"):
        parse_input([{"type": "function_call_output", "call_id": "c2", "output": "2"}], earlier)


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def body(i: int) -> dict:
    return {"id": f"resp_{i}", "status": "completed"}


def test_store_drops_the_least_recently_used_first():
    store = ResponseStore(2, 100, Clock())
    for i in range(2):
        store.put(body(i), [])
    store.get("resp_0")  # now resp_1 is the least recently used
    store.put(body(2), [])
    assert [i for i in ("resp_0", "resp_1", "resp_2") if i in store.entries] == ["resp_0", "resp_2"]
    with pytest.raises(HTTPError) as info:
        store.conversation("resp_1")
    assert info.value.status == 404 and info.value.param == "previous_response_id" and "resp_1" in info.value.message


def test_store_forgets_after_the_ttl_and_keeps_its_expiry_queue_bounded():
    clock = Clock()
    store = ResponseStore(3, 10, clock)
    store.put(body(0), [])
    clock.now = 5
    store.put(body(1), [])
    clock.now = 10
    with pytest.raises(HTTPError):
        store.get("resp_0")
    assert store.get("resp_1")
    for i in range(2, 50):
        store.put(body(i), [])
    assert len(store.entries) == 3 and len(store.expiry) <= 6


def test_dropping_a_running_background_response_cancels_it():
    async def run():
        store = ResponseStore(1, 100, Clock())
        task = asyncio.ensure_future(asyncio.sleep(60))
        store.put({"id": "resp_0", "status": "in_progress"}, [], task)
        with pytest.raises(InvalidRequest, match="still in_progress"):  # running: it can't be continued yet
            store.conversation("resp_0")
        store.put(body(1), [])  # evicts resp_0
        await asyncio.sleep(0)
        return task.cancelled()
    assert asyncio.run(run())
