"""gpt-oss's harmony format over every HTTP API, end to end: a real `pagedserve serve` of a
tiny random-weight gpt-oss with gpt-oss's own tokenizer (tests/harmony_model.py), harmony
chosen by `auto`, driven by the `openai` and `anthropic` SDKs and the Agents SDK.

A random model writes no harmony of its own, so vLLM's `structured_outputs` grammar (it holds
the whole output, special tokens by name) makes it write each channel: analysis, then a final
answer or a call to functions.get_weather. Chat completions, Anthropic messages and Responses
must give the reasoning, the calls and the answer in their own fields, streamed and whole;
the prompt is openai-harmony's rendering token for token; tool_choice required is harmony's
own call message. Every test ends with every KV block free and no server error logged.
"""

from __future__ import annotations

import asyncio
import datetime
import json
from typing import Literal

import httpx
import pytest
from openai_harmony import Conversation, DeveloperContent, Message, Role, SystemContent

from harmony_model import save_tiny_gpt_oss
from http_client import kv_free_after  # noqa: F401 - shared fixture
from http_client import anthropic_client, async_openai_client, model_name, openai_client

ASK = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]
THOUGHT, ANSWER, ARGS = "The user wants the weather.", "Sunny in Paris.", {"city": "Paris"}
ANSWERING = {"grammar": f'start: <|channel|> "analysis" <|message|> "{THOUGHT}" <|end|> <|start|> "assistant" '
                        f'<|channel|> "final" <|message|> "{ANSWER}" <|return|>'}
CALLING = {"grammar": f'start: <|channel|> "analysis" <|message|> "{THOUGHT}" <|end|> <|start|> "assistant" '
                      '<|channel|> "commentary to=functions.get_weather " <|constrain|> "json" <|message|> '
                      + json.dumps(json.dumps(ARGS)) + " <|call|>"}
PARAMETERS = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
              "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                            "parameters": PARAMETERS}}


@pytest.fixture(scope="module")
def frontend(procs, tmp_path_factory):
    folder = save_tiny_gpt_oss(tmp_path_factory.mktemp("gpt_oss_harmony"))
    # The default --engine-timeout-s (3 s): this engine once went 3 s without answering a
    # heartbeat under a loaded `make test`, on its first constrained request (the grammar
    # library building its 201k-token tokenizer held the GIL); a served engine now builds it
    # at start (engine/structured_output/manager.py).
    with procs.serving("--model", str(folder), "--dtype", "float32", "--num-kv-blocks", "256",
                       "--max-model-len", "512", "--num-threads", "1",
                       timeout_s=300) as fe:
        yield fe


@pytest.fixture(scope="module")
def model(frontend):
    return model_name(frontend)


@pytest.fixture(scope="module")
def client(frontend):
    with openai_client(frontend) as c:
        yield c


def chat(client, model, forced, stream=False, **kw):
    return client.chat.completions.create(model=model, messages=ASK, temperature=0, max_tokens=80, stream=stream,
                                          extra_body={"structured_outputs": forced}, **kw)


def test_the_prompt_is_harmonys_rendering(frontend, client, model):
    from frontend.harmony.encoding import load
    from frontend.tokenizer import Tokenizer
    from harmony_model import tokenizer_folder
    encoding = load(Tokenizer.from_dir(tokenizer_folder()))
    system = SystemContent.new().with_conversation_start_date(datetime.date.today().isoformat())
    expected = encoding.render_conversation_for_completion(Conversation.from_messages([
        Message.from_role_and_content(Role.SYSTEM, system),
        Message.from_role_and_content(Role.DEVELOPER, DeveloperContent.new().with_instructions("Be brief.")),
        Message.from_role_and_content(Role.USER, "Weather in Paris?")]), Role.ASSISTANT)
    tokens = httpx.post(f"{frontend.http_url}/tokenize", json={"messages": ASK}, timeout=30).json()["tokens"]
    assert tokens == expected
    r = chat(client, model, ANSWERING)
    assert r.usage.prompt_tokens == len(expected)


def test_chat_gives_reasoning_and_answer_streamed_and_whole(client, model):
    r = chat(client, model, ANSWERING)
    message = r.choices[0].message
    assert (message.reasoning_content, message.content, r.choices[0].finish_reason) == (THOUGHT, ANSWER, "stop")
    assert not message.tool_calls
    reasoning = content = ""
    for chunk in chat(client, model, ANSWERING, stream=True):
        for choice in chunk.choices:
            reasoning += getattr(choice.delta, "reasoning_content", None) or ""
            content += choice.delta.content or ""
    assert (reasoning, content) == (THOUGHT, ANSWER)


def test_chat_gives_a_call_streamed_and_whole(client, model):
    r = chat(client, model, CALLING, tools=[WEATHER])
    choice = r.choices[0]
    [call] = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", ARGS)
    assert (choice.finish_reason, choice.message.reasoning_content, choice.message.content) == \
        ("tool_calls", THOUGHT, None)
    names, arguments, finish = [], "", None
    for chunk in chat(client, model, CALLING, stream=True, tools=[WEATHER]):
        for c in chunk.choices:
            for delta in c.delta.tool_calls or []:
                names += [delta.function.name] if delta.function.name else []
                arguments += delta.function.arguments or ""
            finish = c.finish_reason or finish
    assert (names, json.loads(arguments), finish) == (["get_weather"], ARGS, "tool_calls")


def test_a_tool_result_goes_back_and_the_call_is_required(client, model):
    """The call and its result in the conversation; tool_choice required: harmony's own call
    message, its arguments held to the schema."""
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(ARGS)}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "clear"}'}]
    r = client.chat.completions.create(model=model, messages=history, tools=[WEATHER], tool_choice="required",
                                       temperature=0, max_tokens=40)
    [call] = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in ("Paris", "Rome")
    assert r.choices[0].finish_reason == "tool_calls"


def test_an_unknown_reasoning_effort_is_a_400(client, model):
    import openai
    with pytest.raises(openai.BadRequestError, match="reasoning_effort"):
        client.chat.completions.create(model=model, messages=ASK, max_tokens=4, reasoning_effort="minimal")
    r = client.chat.completions.create(model=model, messages=ASK, max_tokens=4, reasoning_effort="low",
                                       extra_body={"structured_outputs": ANSWERING})
    assert r.choices[0].message.reasoning_content  # the prompt said "Reasoning: low"; the output is forced


def test_anthropic_gives_thinking_text_and_tool_use(frontend, model):
    with anthropic_client(frontend) as claude:
        r = claude.messages.create(model=model, max_tokens=80, messages=ASK[1:], system="Be brief.",
                                   extra_body={"structured_outputs": ANSWERING})
        assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in r.content] == \
            [("thinking", THOUGHT), ("text", ANSWER)]
        tool = {"name": "get_weather", "description": "The weather in a city.", "input_schema": PARAMETERS}
        with claude.messages.stream(model=model, max_tokens=80, messages=ASK[1:], tools=[tool],
                                    extra_body={"structured_outputs": CALLING}) as stream:
            final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "tool_use"] and final.stop_reason == "tool_use"
    assert (final.content[1].name, final.content[1].input) == ("get_weather", ARGS)


def test_responses_give_reasoning_items_calls_and_keep_the_conversation(client, model):
    r = client.responses.create(model=model, input="Weather in Paris?", instructions="Be brief.",
                                max_output_tokens=80, extra_body={"structured_outputs": ANSWERING})
    assert [i.type for i in r.output] == ["reasoning", "message"] and r.output_text == ANSWER
    assert r.output[0].content[0].text == THOUGHT
    call = client.responses.create(model=model, input="And in Rome?", previous_response_id=r.id, tools=[
        {"type": "function", "name": "get_weather", "parameters": PARAMETERS}],
        max_output_tokens=80, extra_body={"structured_outputs": CALLING})
    assert [i.type for i in call.output] == ["reasoning", "function_call"]
    assert (call.output[1].name, json.loads(call.output[1].arguments)) == ("get_weather", ARGS)


def test_agents_sdk_tool_loop(frontend, model):
    """openai-agents' runner over Responses: a required call (harmony's call message), our
    tool, its result back in the prompt, then the answer."""
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    calls = []

    @agents.function_tool
    def get_weather(city: Literal["Paris", "Rome"]) -> str:
        """The weather now in a city."""
        calls.append(city)
        return f"sunny in {city}"

    class Scripted(agents.OpenAIResponsesModel):
        """A random model writes no answer of its own: after the tool's result, a grammar
        writes it (the call before it is tool_choice required's own grammar)."""

        async def get_response(self, system_instructions, input, model_settings, *args, **kwargs):
            if any(isinstance(i, dict) and i.get("type") == "function_call_output" for i in input):
                model_settings = model_settings.resolve(agents.ModelSettings(
                    extra_body={"structured_outputs": ANSWERING}))
            return await super().get_response(system_instructions, input, model_settings, *args, **kwargs)

    async def run():
        async with async_openai_client(frontend) as c:
            agent = agents.Agent(name="weather", instructions="Answer briefly.", tools=[get_weather],
                                 model=Scripted(model=model, openai_client=c),
                                 model_settings=agents.ModelSettings(tool_choice="required", parallel_tool_calls=False,
                                                                     temperature=0, max_tokens=80))
            return await agents.Runner.run(agent, "What is the weather in Rome?", max_turns=3)
    result = asyncio.run(run())
    assert len(calls) == 1 and calls[0] in ("Paris", "Rome")
    assert [type(i).__name__ for i in result.new_items] == \
        ["ToolCallItem", "ToolCallOutputItem", "ReasoningItem", "MessageOutputItem"]
    assert result.final_output == ANSWER
