"""A tool-call parser other than Hermes through the HTTP APIs, end to end: a frontend started
with `--tool-call-parser llama3_json` (real engine and frontend processes), the model's output
forced into Llama 3's JSON format by vLLM's `structured_outputs` regex, and tool_choice auto:
the parser must turn the text into calls for chat completions and Anthropic messages, whole
and streamed. Every test ends with every KV block free."""

from __future__ import annotations

import json
import re

import pytest

from http_client import kv_free_after, model  # noqa: F401 - shared fixtures
from http_client import anthropic_client, openai_client

pytestmark = pytest.mark.heavy(30)  # seconds on the 2-core CI machine: scheduled first

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": CITY}}]
ASK = [{"role": "user", "content": "Weather in Rome and Paris?"}]
# Two parallel calls after some text, as Llama 3.1 writes them.
OUTPUT = ('Checking. {"name": "get_weather", "parameters": {"city": "Rome"}}; '
          '{"name": "get_weather", "parameters": {"city": "Paris"}}')
FORCED = {"structured_outputs": {"regex": re.escape(OUTPUT)}}
WANT = [("get_weather", {"city": "Rome"}), ("get_weather", {"city": "Paris"})]


@pytest.fixture(scope="module")
def frontend(servers):
    return servers.frontend("--tool-call-parser", "llama3_json")


def test_chat_completions_whole_and_streamed(frontend, model):
    ask = dict(model=model, messages=ASK, tools=TOOLS, tool_choice="auto", max_tokens=80, temperature=0,
               extra_body=FORCED)
    with openai_client(frontend) as client:
        whole = client.chat.completions.create(**ask).choices[0]
        chunks = list(client.chat.completions.create(**ask, stream=True))
    assert whole.finish_reason == "tool_calls" and whole.message.content == "Checking."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls] == WANT
    assert all(c.id.startswith("call_") for c in whole.message.tool_calls)
    content, calls = "", {}
    for chunk in chunks:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for entry in choice.delta.tool_calls or []:
                call = calls.setdefault(entry.index, {"name": entry.function.name, "arguments": ""})
                call["arguments"] += entry.function.arguments or ""
    assert content == "Checking." and chunks[-1].choices[0].finish_reason == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())] == WANT


def test_anthropic_tool_use_whole_and_streamed(frontend, model):
    tools = [{"name": "get_weather", "description": "Weather now", "input_schema": CITY}]
    ask = dict(model=model, max_tokens=80, messages=ASK, tools=tools, tool_choice={"type": "auto"},
               extra_body={"temperature": 0, **FORCED})
    with anthropic_client(frontend) as client:
        whole = client.messages.create(**ask)
        with client.messages.stream(**ask) as stream:
            events = list(stream)
            final = stream.get_final_message()
    for message in (whole, final):
        assert message.stop_reason == "tool_use"
        assert [b.type for b in message.content] == ["text", "tool_use", "tool_use"]
        assert message.content[0].text == "Checking."
        assert [(b.name, b.input) for b in message.content[1:]] == WANT
    partial = {}
    for e in events:
        if e.type == "content_block_delta" and e.delta.type == "input_json_delta":
            partial[e.index] = partial.get(e.index, "") + e.delta.partial_json
    assert [json.loads(p) for _, p in sorted(partial.items())] == [args for _, args in WANT]
