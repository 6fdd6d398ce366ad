"""OpenAI's Responses API (/v1/responses) end to end: the official, unmodified `openai` SDK
against real engine and frontend processes (conftest's module fixtures), stateless and stored,
streamed, with function tools, text.format, background runs and bad requests. Every test
ends with every KV block free and no 500 logged (kv_free_after)."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from grpc_client import wait_info
from http_client import kv_free_after, model  # noqa: F401 - shared fixtures
from http_client import assert_error, async_openai_client, openai_client, post, tokenize

pytestmark = pytest.mark.heavy(60)  # seconds on the 2-core CI machine: scheduled first

GREEDY = dict(temperature=0, max_output_tokens=10)
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
           "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather now", "parameters": WEATHER,
          "strict": True}]
CITY = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                         "population": {"type": "integer", "minimum": 0, "maximum": 99999}},
        "required": ["name", "population"], "additionalProperties": False}
# A schema no short answer can close: the output runs until max_output_tokens, whatever the model.
ENDLESS = {"format": {"type": "json_schema", "name": "long", "schema": {
    "type": "object", "properties": {"s": {"type": "string", "minLength": 3000}}, "required": ["s"]}}}


@pytest.fixture(scope="module")
def client(frontend):
    with openai_client(frontend) as c:
        yield c


def message_text(response) -> str:
    [item] = [i for i in response.output if i.type == "message"]
    return "".join(part.text for part in item.content)


# -- create ---------------------------------------------------------------------------------

def test_string_input_with_instructions_is_a_chat(client, model):
    """instructions + a string are the chat [system, user]: the same prompt, the same greedy text."""
    r = client.responses.create(model=model, input="Name a fruit.", instructions="Be brief.", metadata={"k": "v"},
                                **GREEDY)
    chat = client.chat.completions.create(model=model, max_tokens=10, temperature=0, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a fruit."}])
    assert r.id.startswith("resp_") and r.object == "response" and r.model == model
    assert r.output_text == message_text(r) == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    assert (r.instructions, r.metadata, r.temperature, r.max_output_tokens, r.store) == \
        ("Be brief.", {"k": "v"}, 0, 10, True)
    [item] = r.output
    assert item.id.startswith("msg_") and item.role == "assistant" and item.content[0].annotations == []


def test_item_list_input(client, model, frontend):
    """Messages of every role, as strings or parts; developer is the template's system."""
    items = [{"role": "developer", "content": "Answer in one word."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Capital of "},
                                                             {"type": "input_text", "text": "Italy?"}]},
             {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
              "content": [{"type": "output_text", "text": "Rome.", "annotations": []}]},
             {"role": "user", "content": "And of France?"}]
    r = client.responses.create(model=model, input=items, **GREEDY)
    as_chat = [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Capital of Italy?"},
               {"role": "assistant", "content": "Rome."}, {"role": "user", "content": "And of France?"}]
    assert r.usage.input_tokens == len(tokenize(frontend, messages=as_chat))
    assert r.output_text


def test_stream_events_in_order(client, model):
    whole = client.responses.create(model=model, input="Tell me a story.", **GREEDY)
    with client.responses.stream(model=model, input="Tell me a story.", **GREEDY) as stream:
        events = list(stream)
    kinds = [e.type for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * deltas,
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.incomplete"], kinds  # 10 tokens: cut by max_output_tokens
    assert deltas >= 3 and [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text
    assert events[-1].response.status == "incomplete" and events[0].response.status == "in_progress"
    with client.responses.stream(model=model, input="Say OK.", temperature=0, max_output_tokens=200) as stream:
        final = stream.get_final_response()  # the helper needs response.completed: a sample that ends
    assert final.status == "completed" and final.output_text == message_text(final)
    assert client.responses.retrieve(final.id).output_text == final.output_text  # stored at the end


# -- tools -----------------------------------------------------------------------------------

def test_function_call_then_its_output(client, model):
    """A forced call, then its result back by previous_response_id: the same prompt as the
    whole conversation sent again (stateless), and the same answer."""
    first = client.responses.create(model=model, input="Weather in Rome?", tools=TOOLS, tool_choice="required",
                                    parallel_tool_calls=False, temperature=0, max_output_tokens=40)
    [call] = first.output
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
    second = client.responses.create(model=model, previous_response_id=first.id, input=[result], tools=TOOLS,
                                     **GREEDY)
    assert [i.type for i in second.output] == ["message"] and second.previous_response_id == first.id
    replay = client.responses.create(model=model, input=[{"role": "user", "content": "Weather in Rome?"},
                                                         call.model_dump(exclude_none=True), result],
                                     tools=TOOLS, store=False, **GREEDY)
    assert replay.usage.input_tokens == second.usage.input_tokens > first.usage.input_tokens
    assert replay.output_text == second.output_text


def test_streamed_named_call(client, model):
    ask = dict(model=model, input="Weather in Paris?", tools=TOOLS, temperature=0, max_output_tokens=40,
               tool_choice={"type": "function", "name": "get_weather"})
    with client.responses.stream(**ask) as stream:
        events = list(stream)
        final = stream.get_final_response()
    [call] = final.output
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert "".join(pieces) == done.arguments == call.arguments and len(pieces) > 1
    assert call.parsed_arguments == json.loads(call.arguments)  # strict: the SDK parses them
    assert [e.type for e in events][2] == "response.output_item.added" and events[2].item.arguments == ""


# -- reasoning -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def thinking(servers):
    """A second frontend on the same engine that reads answers as DeepSeek-R1's (its prompt
    opens `<think>`): SmolLM2 never closes it, so everything it writes is reasoning."""
    return servers.frontend("--reasoning-parser", "deepseek_r1")


def test_reasoning_items(thinking, model):
    ask = dict(model=model, input="Tell me a story.", reasoning={"effort": "low", "summary": "auto"}, **GREEDY)
    with openai_client(thinking) as client:
        r = client.responses.create(**ask)
        with client.responses.stream(**ask) as stream:
            events = list(stream)
        later = client.responses.create(model=model, input="Go on.", previous_response_id=r.id, **GREEDY)
    [thought] = r.output  # cut while thinking: no message yet
    assert thought.type == "reasoning" and thought.id.startswith("rs_") and thought.summary == []
    assert thought.content[0].type == "reasoning_text" and thought.content[0].text and r.output_text == ""
    assert r.status == "incomplete" and thought.status == "incomplete" and r.reasoning.effort == "low"
    assert 0 < r.usage.output_tokens_details.reasoning_tokens
    kinds = [e.type for e in events]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == thought.content[0].text
    assert "response.reasoning_text.done" in kinds and kinds[-1] == "response.incomplete"
    assert later.previous_response_id == r.id and later.output[0].type == "reasoning"  # reasoning items go back


# -- text.format -----------------------------------------------------------------------------

class City(BaseModel):
    name: str = Field(max_length=10)
    population: int = Field(ge=0, le=99999)


def test_text_format_json_schema(client, model):
    r = client.responses.create(model=model, input="A city and its population.", temperature=0.8,
                                max_output_tokens=40, text={"format": {"type": "json_schema", "name": "city",
                                                                       "schema": CITY, "strict": True}})
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), CITY)
    parsed = client.responses.parse(model=model, input="A city.", text_format=City, temperature=0,
                                    max_output_tokens=40)
    assert isinstance(parsed.output_parsed, City)


# -- stored responses ------------------------------------------------------------------------

def test_retrieve_and_delete(client, model, frontend):
    r = client.responses.create(model=model, input="Hi", **GREEDY)
    assert client.responses.retrieve(r.id).model_dump() == r.model_dump()
    client.responses.delete(r.id)
    for gone in (lambda: client.responses.retrieve(r.id), lambda: client.responses.delete(r.id)):
        with pytest.raises(openai.NotFoundError) as info:
            gone()
        assert r.id in info.value.body["message"]
    unstored = client.responses.create(model=model, input="Hi", store=False, **GREEDY)
    assert unstored.store is False
    assert_error(httpx.get(f"{frontend.http_url}/v1/responses/{unstored.id}"), 404, "not_found_error", unstored.id)
    r = post(frontend, "/v1/responses", {"model": model, "input": "Hi", "previous_response_id": unstored.id})
    assert assert_error(r, 404, "not_found_error", unstored.id)["param"] == "previous_response_id"


def poll(client, response_id: str, until, timeout_s: float = 60):
    deadline = time.monotonic() + timeout_s
    while not until(r := client.responses.retrieve(response_id)):
        assert time.monotonic() < deadline, r
        time.sleep(0.1)
    return r


def test_background_then_cancel(client, model, frontend):
    short = client.responses.create(model=model, input="Tell me a story.", background=True, **GREEDY)
    assert short.status == "queued" and short.background
    done = poll(client, short.id, lambda r: r.status not in ("queued", "in_progress"))
    assert done.status == "incomplete" and done.output_text and done.usage.output_tokens == 10
    assert client.responses.cancel(short.id).status == "incomplete"  # it had ended: unchanged
    long = client.responses.create(model=model, input="Write.", background=True, text=ENDLESS, max_output_tokens=400)
    assert poll(client, long.id, lambda r: r.status == "in_progress").status == "in_progress"
    assert wait_info(frontend, lambda i: i.num_running == 1).num_running == 1
    assert client.responses.cancel(long.id).status == "cancelled"
    frontend.wait_kv_free(timeout_s=5)  # the engine request was aborted, not run to its end
    assert client.responses.retrieve(long.id).status == "cancelled"
    foreground = client.responses.create(model=model, input="Hi", **GREEDY)
    r = post(frontend, f"/v1/responses/{foreground.id}/cancel", {})
    assert assert_error(r, 400, "invalid_request_error", "background")


def test_client_leaving_a_stream_aborts_it(model, frontend):
    body = {"model": model, "input": "Write.", "text": ENDLESS, "max_output_tokens": 400, "stream": True}
    with httpx.stream("POST", f"{frontend.http_url}/v1/responses", json=body, timeout=60) as r:
        lines = r.iter_lines()  # kept: a closed line iterator closes the stream
        next(line for line in lines if "response.output_text.delta" in line)
        assert wait_info(frontend, lambda i: i.num_running == 1).num_running == 1
    frontend.wait_kv_free(timeout_s=5)


# -- errors ----------------------------------------------------------------------------------

BAD = [  # (body fields, the field the 400 names)
    ({"input": [{"role": "user", "content": "Hi"}, {"type": "function_call_output", "call_id": "c9", "output": "x"}]},
     "input[1].call_id"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
    ({"input": [{"role": "robot", "content": "Hi"}]}, "input[0].role"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "x"}]}]}, "input[0].content[0].type"),
    # the bundled model reads no images: refused as such, before the URL is looked at
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
    ({"input": [{"type": "web_search_call"}]}, "input[0].type"),
    ({"input": [], "instructions": "x"}, "input"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"tools": TOOLS * 2}, "tools[1].name"),
    ({"tools": [{"type": "function", "function": TOOLS[0]}]}, "tools[0]"),  # chat's shape
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object", "dependentSchemas": {}}}}},
     "text.format.schema"),
    ({"text": {"format": {"type": "yaml"}}}, "text.format.type"),
    ({"text": {"format": {"type": "json_object"}}, "tools": TOOLS, "tool_choice": "required"}, "text"),
    ({"reasoning": {"effort": "extreme"}}, "reasoning.effort"),
    ({"background": True, "store": False}, "background"),
    ({"truncation": "auto"}, "truncation"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"temperature": "hot"}, "temperature"),
]


@pytest.mark.parametrize("fields,param", BAD, ids=[p for _, p in BAD])
def test_bad_requests(frontend, model, fields, param):
    r = post(frontend, "/v1/responses", {"model": model, "input": "Hi", **fields})
    assert assert_error(r, 400, "invalid_request_error", param.split(".")[0])["param"] == param


def test_include_takes_only_the_apis_values(client, model):
    """`include`'s values are the API's (the SDK's ResponseIncludable): accepted, as nothing
    here has more output to add; a value the API does not define is a 400, as OpenAI answers."""
    r = client.responses.create(model=model, input="Hi", include=["reasoning.encrypted_content",
                                                                  "message.output_text.logprobs"], **GREEDY)
    assert r.status in ("completed", "incomplete") and r.output_text
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=model, input="Hi", include=["nonsense.field"], **GREEDY)
    assert info.value.param == "include.0" and "reasoning.encrypted_content" in info.value.message


def test_unknown_ids_are_404(frontend):
    for method, path in [("GET", "/v1/responses/resp_nope"), ("DELETE", "/v1/responses/resp_nope"),
                         ("POST", "/v1/responses/resp_nope/cancel")]:
        assert_error(httpx.request(method, f"{frontend.http_url}{path}", timeout=10), 404, "not_found_error",
                     "resp_nope")


# -- the Agents SDK ----------------------------------------------------------------------------

def test_agents_sdk_tool_loop(frontend, model):
    """openai-agents' runner over OpenAIResponsesModel: a forced call, our tool, then the answer."""
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    calls = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather now in a city."""
        calls.append(city)
        return f"sunny in {city}"

    async def run():
        async with async_openai_client(frontend) as client:
            agent = agents.Agent(name="weather", instructions="Answer briefly.", tools=[get_weather],
                                 model=agents.OpenAIResponsesModel(model=model, openai_client=client),
                                 model_settings=agents.ModelSettings(tool_choice="required", parallel_tool_calls=False,
                                                                     temperature=0, max_tokens=60))
            return await agents.Runner.run(agent, "What is the weather in Rome?", max_turns=3)
    result = asyncio.run(run())
    assert calls == ["Rome"]  # after a call the runner resets tool_choice, so the next turn answers
    assert [type(i).__name__ for i in result.new_items] == ["ToolCallItem", "ToolCallOutputItem", "MessageOutputItem"]
    assert isinstance(result.final_output, str) and result.final_output
