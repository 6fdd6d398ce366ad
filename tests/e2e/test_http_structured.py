"""Structured output and tool calling over the HTTP APIs, end to end: the official `openai`
and `anthropic` SDKs against real engine and frontend processes (conftest's fixtures). What a
grammar enforces is checked with `jsonschema` across seeds and temperatures; tool calls are
checked streamed and whole. Every test ends with every KV block free."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from frontend.tool_calls.json_scan import INCOMPLETE, JsonScanner
from frontend.tool_calls.prompt import messages_as_text
from frontend.tool_calls.tools import Tool, ToolChoice, tool_use
from http_client import kv_free_after, model  # noqa: F401 - shared fixtures
from http_client import anthropic_client, openai_client, post, tokenize

pytestmark = pytest.mark.heavy(40)  # seconds on the 2-core CI machine: scheduled first

QUESTION = [{"role": "user", "content": "Give me a city and its population."}]
CITY = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                         "population": {"type": "integer", "minimum": 0, "maximum": 99999}},
        "required": ["name", "population"], "additionalProperties": False}
# Nesting, arrays, enums, required fields and a pattern, all bounded so a call always ends.
ORDER = {
    "type": "object",
    "properties": {
        "customer": {"type": "object", "additionalProperties": False, "required": ["name", "email"],
                     "properties": {"name": {"type": "string", "maxLength": 8},
                                    "email": {"type": "string", "pattern": "^[a-z]{1,6}@[a-z]{1,6}\\.com$"}}},
        "items": {"type": "array", "minItems": 1, "maxItems": 2,
                  "items": {"type": "object", "additionalProperties": False, "required": ["sku", "qty"],
                            "properties": {"sku": {"type": "string", "enum": ["A1", "B2", "C3"]},
                                           "qty": {"type": "integer", "minimum": 1, "maximum": 9}}}},
        "express": {"type": "boolean"},
    },
    "required": ["customer", "items", "express"],
    "additionalProperties": False,
}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
           "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "place_order", "description": "Order items", "parameters": ORDER}},
         {"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER}}]
SCHEMAS = {"place_order": ORDER, "get_weather": WEATHER}
ORDER_ASK = [{"role": "user", "content": "Order two A1 for bob@shop.com, express."}]
CALL_TOKENS = 110  # enough for the longest ORDER call and its wrapper


@pytest.fixture(scope="module")
def client(frontend):
    with openai_client(frontend) as c:
        yield c


def assert_json_prefix(text: str) -> None:
    """A sample cut off by max_tokens: still the start of a JSON document."""
    scanner = JsonScanner()
    assert scanner.feed(text) == len(text) and scanner.state == INCOMPLETE, text


def streamed_calls(chunks) -> tuple[str, list[dict], str]:
    """(content, calls, finish_reason) from an SDK chat stream, accumulated as OpenAI's docs
    say: by index; id, type and name from the first entry, the arguments concatenated."""
    content, calls, finish = "", {}, None
    for chunk in chunks:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for entry in choice.delta.tool_calls or []:
                if entry.index not in calls:
                    assert entry.id.startswith("call_") and entry.type == "function" and entry.function.name
                    calls[entry.index] = {"id": entry.id, "name": entry.function.name, "arguments": ""}
                else:
                    assert entry.id is None and entry.function.name is None
                calls[entry.index]["arguments"] += entry.function.arguments or ""
            finish = choice.finish_reason or finish
    assert sorted(calls) == list(range(len(calls)))
    return content, [calls[i] for i in sorted(calls)], finish


def assert_valid_call(name: str, arguments: str) -> dict:
    args = json.loads(arguments)
    jsonschema.validate(args, SCHEMAS[name])
    return args


# -- response_format and structured_outputs --------------------------------------------------

class City(BaseModel):
    name: str = Field(max_length=10)
    population: int = Field(ge=0, le=99999)


def test_sdk_parse_returns_the_pydantic_object(client, model):
    r = client.chat.completions.parse(model=model, messages=QUESTION, response_format=City, max_tokens=40,
                                      temperature=0)
    message = r.choices[0].message
    assert isinstance(message.parsed, City), message
    assert r.choices[0].finish_reason == "stop"
    assert City.model_validate_json(message.content) == message.parsed


@pytest.mark.parametrize("temperature,seed", [(0.0, None), (0.8, 11), (1.3, 12)])
def test_json_schema_validates_across_samples(client, model, temperature, seed):
    r = client.chat.completions.create(
        model=model, messages=QUESTION, n=3, temperature=temperature, seed=seed, max_tokens=40,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}})
    for choice in r.choices:
        assert choice.finish_reason == "stop", choice  # the bounded schema always ends in time
        jsonschema.validate(json.loads(choice.message.content), CITY)


@pytest.mark.parametrize("temperature,seed", [(0.0, None), (1.0, 5)])
def test_json_object(client, model, temperature, seed):
    r = client.chat.completions.create(model=model, messages=QUESTION, n=2, temperature=temperature, seed=seed,
                                       max_tokens=24, response_format={"type": "json_object"})
    for choice in r.choices:
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content), dict)
        else:
            assert_json_prefix(choice.message.content)


def test_completions_route_and_streaming(client, model):
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}}
    r = client.completions.create(model=model, prompt="A city, as JSON:", max_tokens=40, temperature=0.7, seed=3,
                                  extra_body={"response_format": fmt})
    jsonschema.validate(json.loads(r.choices[0].text), CITY)
    chunks = list(client.chat.completions.create(model=model, messages=QUESTION, max_tokens=40, temperature=0,
                                                 response_format=fmt, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), CITY)


def test_structured_outputs_choice_regex_grammar(client, model):
    def ask(**so):
        r = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=16, temperature=1.0, seed=7,
                                           n=2, extra_body={"structured_outputs": so})
        return [c.message.content for c in r.choices]
    assert set(ask(choice=["red", "green", "blue"])) <= {"red", "green", "blue"}
    assert all(re.fullmatch(r"[A-Z][a-z]{2,5}-[0-9]{2}", t) for t in ask(regex=r"[A-Z][a-z]{2,5}-[0-9]{2}"))
    assert all(t in ("yes!", "no.") for t in ask(grammar='start: answer\nanswer: "yes!" | "no."'))
    assert all(isinstance(json.loads(t), dict) for t in ask(json='{"type": "object", "maxProperties": 0}'))
    text = client.completions.create(model=model, prompt="Pick:", max_tokens=4, temperature=0,
                                     extra_body={"structured_outputs": {"choice": ["up", "down"]}}).choices[0].text
    assert text in ("up", "down")



# -- a constraint the model's vocabulary cannot write ----------------------------------------
# The bundled tokenizer has no token holding the byte 0xF1, which starts U+40000's UTF-8.
UNWRITABLE = "\U00040000"
UNWRITABLE_FORMAT = {"type": "json_schema", "json_schema": {"name": "k", "schema": {
    "type": "object", "properties": {"k": {"const": UNWRITABLE}}, "required": ["k"]}}}


def test_a_constraint_the_vocabulary_cannot_write_is_a_400_naming_its_field(client, model):
    """At its start (refused when it compiles) or on the way (after `{"k":"` or `a`): a 400
    whose `param` is the request's own field, no 500, no block left; the next request runs."""
    chat, completions = client.chat.completions.create, client.completions.create
    common = {"model": model, "max_tokens": 16, "temperature": 1.0, "seed": 2}
    in_format = {"response_format": UNWRITABLE_FORMAT}
    for create, kwargs, param in [
        (chat, {"messages": QUESTION, **in_format}, "response_format.json_schema.schema"),
        (completions, {"prompt": "Say:", "extra_body": in_format}, "response_format.json_schema.schema"),
        (chat, {"messages": QUESTION, "extra_body": {"structured_outputs": {"regex": UNWRITABLE}}},
         "structured_outputs.regex"),
        (completions, {"prompt": "Say:", "extra_body": {"structured_outputs": {"regex": "a" + UNWRITABLE}}},
         "structured_outputs.regex"),
    ]:
        with pytest.raises(openai.BadRequestError) as info:
            create(**common, **kwargs)
        assert info.value.status_code == 400 and info.value.param == param, info.value
        assert f" {param}: " in info.value.message and "vocabulary" in info.value.message, info.value
    r = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=4, temperature=0)
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.content


def test_a_stream_the_vocabulary_cannot_finish_ends_with_an_error_event(client, model):
    """Its status is sent already: the stream ends with an error event naming the field."""
    stream = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=8, stream=True,
                                            extra_body={"structured_outputs": {"regex": "a" + UNWRITABLE}})
    text = ""
    with pytest.raises(openai.APIError) as info:
        for chunk in stream:
            text += "".join(c.delta.content or "" for c in chunk.choices)
    assert text in ("", "a")  # ("a" may share the last delta, which the error replaces)
    assert info.value.param == "structured_outputs.regex" and "vocabulary" in info.value.message, info.value


# -- tools: forced by the grammar ------------------------------------------------------------

def test_tool_choice_required(client, model):
    r = client.chat.completions.create(model=model, messages=ORDER_ASK, tools=TOOLS, tool_choice="required",
                                       parallel_tool_calls=False, max_tokens=CALL_TOKENS, temperature=0.9, seed=21)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function" and call.function.name in SCHEMAS
    assert_valid_call(call.function.name, call.function.arguments)


def test_tool_choice_named_streamed_and_whole(client, model):
    """Greedy, streamed and not: the same call, its streamed pieces adding up to the arguments."""
    ask = dict(model=model, messages=ORDER_ASK, tools=TOOLS, max_tokens=CALL_TOKENS, temperature=0,
               tool_choice={"type": "function", "function": {"name": "place_order"}})
    whole = client.chat.completions.create(**ask).choices[0]
    [call] = whole.message.tool_calls
    assert whole.finish_reason == "tool_calls" and call.function.name == "place_order"
    assert_valid_call("place_order", call.function.arguments)
    chunks = list(client.chat.completions.create(**ask, stream=True))
    content, calls, finish = streamed_calls(chunks)
    assert content == "" and finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls] == [("place_order", call.function.arguments)]
    pieces = [e for c in chunks if c.choices for e in c.choices[0].delta.tool_calls or []]
    assert len(pieces) > 3, "the arguments streamed in pieces, not at the end"


def test_tool_choice_required_several_tools_seeded(client, model):
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Weather in Rome?"}],
                                       tools=TOOLS, tool_choice="required", parallel_tool_calls=False, n=2,
                                       max_tokens=CALL_TOKENS, temperature=1.0, seed=4)
    for choice in r.choices:
        [call] = choice.message.tool_calls
        assert_valid_call(call.function.name, call.function.arguments)


# -- tools: auto, parsed from free text ------------------------------------------------------

FORCED_HERMES = ('start: "Checking. <tool_call>\\n" call "\\n</tool_call>"\n'
                 'call: %json {"type": "object", "properties": {"name": {"const": "get_weather"}, '
                 '"arguments": ' + json.dumps(WEATHER) + '}, "required": ["name", "arguments"], '
                 '"additionalProperties": false}')


def test_auto_parses_hermes_text(client, model):
    """The model must write a Hermes block (a grammar makes it, whatever the model): with
    tool_choice auto the parser turns it into a call, streamed or not."""
    ask = dict(model=model, messages=[{"role": "user", "content": "Weather in Rome?"}], tools=TOOLS, max_tokens=40,
               temperature=0, extra_body={"structured_outputs": {"grammar": FORCED_HERMES}})
    whole = client.chat.completions.create(**ask).choices[0]
    assert whole.message.content == "Checking." and whole.finish_reason == "tool_calls"
    [call] = whole.message.tool_calls
    assert call.function.name == "get_weather"
    args = assert_valid_call("get_weather", call.function.arguments)
    content, calls, finish = streamed_calls(client.chat.completions.create(**ask, stream=True))
    assert content == "Checking." and finish == "tool_calls"
    assert json.loads(calls[0]["arguments"]) == args and calls[0]["name"] == "get_weather"


def test_auto_leaves_malformed_blocks_as_content(client, model):
    text = "<tool_call>{oops}</tool_call>"
    ask = dict(model=model, messages=QUESTION, tools=TOOLS, max_tokens=20, temperature=0,
               extra_body={"structured_outputs": {"regex": re.escape(text)}})
    whole = client.chat.completions.create(**ask).choices[0]
    assert whole.message.content == text and not whole.message.tool_calls and whole.finish_reason == "stop"
    assert streamed_calls(client.chat.completions.create(**ask, stream=True)) == (text, [], "stop")


def test_tool_choice_none_is_plain_text(client, model):
    r = client.chat.completions.create(model=model, messages=QUESTION, tools=TOOLS, tool_choice="none",
                                       max_tokens=8, temperature=0,
                                       extra_body={"structured_outputs": {"regex": "<tool_call>.*"}})
    choice = r.choices[0]
    assert choice.message.content.startswith("<tool_call>") and not choice.message.tool_calls
    assert choice.finish_reason == "length"


def test_tools_rendered_as_text_for_this_template(client, model, frontend):
    """SmolLM2's template knows no tools: they, the earlier call and its result are written
    into the prompt as Hermes text, token for token."""
    history = [*ORDER_ASK, {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                     "arguments": '{"city": "Rome"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    r = client.chat.completions.create(model=model, messages=history, tools=TOOLS, max_tokens=1, temperature=0)
    use = tool_use([Tool(t["function"]["name"], t["function"]["description"], t["function"]["parameters"])
                    for t in TOOLS], ToolChoice("auto"))
    history[1]["content"] = ""
    rendered = messages_as_text(history, use)
    assert r.usage.prompt_tokens == len(tokenize(frontend, messages=rendered))
    assert "<tool_response>\nsunny\n</tool_response>" in rendered[-1]["content"]


# -- Anthropic -------------------------------------------------------------------------------

A_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
            "input_schema": t["function"]["parameters"]} for t in TOOLS]


def test_anthropic_tool_choice_any(frontend, model):
    with anthropic_client(frontend) as client:
        m = client.messages.create(model=model, max_tokens=CALL_TOKENS, messages=ORDER_ASK, tools=A_TOOLS,
                                   tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                   extra_body={"temperature": 0.8, "seed": 2})
    assert m.stop_reason == "tool_use"
    [block] = m.content
    assert block.type == "tool_use" and block.id.startswith("toolu_")
    jsonschema.validate(block.input, SCHEMAS[block.name])


def test_anthropic_named_tool_streamed_then_answered(frontend, model):
    with anthropic_client(frontend) as client:
        ask = dict(model=model, max_tokens=CALL_TOKENS, messages=ORDER_ASK, tools=A_TOOLS,
                   tool_choice={"type": "tool", "name": "place_order"}, extra_body={"temperature": 0})
        whole = client.messages.create(**ask)
        with client.messages.stream(**ask) as stream:
            events = list(stream)
            final = stream.get_final_message()
        partial = "".join(e.delta.partial_json for e in events
                          if e.type == "content_block_delta" and e.delta.type == "input_json_delta")
        [block] = final.content
        assert final.stop_reason == "tool_use" and block.type == "tool_use" and block.name == "place_order"
        assert json.loads(partial) == block.input == whole.content[0].input
        jsonschema.validate(block.input, ORDER)
        starts = [e for e in events if e.type == "content_block_start"]
        assert [s.content_block.type for s in starts] == ["tool_use"] and starts[0].content_block.input == {}
        # The call's result goes back; the conversation goes on.
        answer = client.messages.create(model=model, max_tokens=3, tools=A_TOOLS, extra_body={"temperature": 0},
                                        messages=[*ORDER_ASK, {"role": "assistant", "content": final.content},
                                                  {"role": "user", "content": [
                                                      {"type": "tool_result", "tool_use_id": block.id,
                                                       "content": "order 7 placed"}]}])
    assert answer.content[0].type == "text" and answer.usage.output_tokens <= 3


def test_anthropic_errors(frontend, model):
    body = {"model": model, "max_tokens": 4, "messages": ORDER_ASK, "tools": A_TOOLS}
    for extra, words in [({"tool_choice": {"type": "tool", "name": "nope"}}, ["nope"]),
                         ({"tool_choice": {"type": "tool"}}, ["tool_choice.name"]),
                         ({"tools": [A_TOOLS[0], A_TOOLS[0]]}, ["twice"]),
                         ({"tools": [{**A_TOOLS[0], "input_schema": {"type": "object", "dependentSchemas": {}}}],
                           "tool_choice": {"type": "any"}}, ["tools[0].input_schema", "dependentSchemas"])]:
        r = post(frontend, "/v1/messages", {**body, **extra})
        assert r.status_code == 400, r.text
        assert r.json()["type"] == "error" and all(w in r.json()["error"]["message"] for w in words), r.text
