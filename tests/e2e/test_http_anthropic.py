"""End to end over the Anthropic-compatible Messages API (POST /v1/messages): real engine and
frontend processes on loopback, driven by the official, unmodified `anthropic` SDK. Every test
ends with every KV block free (over gRPC)."""

from __future__ import annotations

import anthropic
import pytest

from http_client import kv_free_after, model  # noqa: F401 - shared fixtures
from http_client import anthropic_client, stop_inside, tokenize

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
SHORT = [{"role": "user", "content": "Reply with one word: yes or no. Is the sky blue?"}]
GREEDY = {"temperature": 0}  # not a parameter of this SDK's create(): sent as an extra field


@pytest.fixture(scope="module")
def client(frontend):
    with anthropic_client(frontend) as c:
        yield c


def test_create_max_tokens(client, model, frontend):
    m = client.messages.create(model=model, max_tokens=6, messages=QUESTION, extra_body=GREEDY)
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_") and m.model == model
    [block] = m.content
    assert block.type == "text" and block.text
    assert m.stop_reason == "max_tokens" and m.stop_sequence is None
    assert m.usage.output_tokens == 6
    assert m.usage.input_tokens == len(tokenize(frontend, messages=QUESTION))


def test_create_end_turn(client, model):
    m = client.messages.create(model=model, max_tokens=32, messages=SHORT, extra_body=GREEDY)
    assert m.stop_reason == "end_turn" and m.stop_sequence is None
    assert 0 < m.usage.output_tokens < 32 and m.content[0].text


def test_stream(client, model):
    whole = client.messages.create(model=model, max_tokens=5, messages=QUESTION, extra_body=GREEDY)
    with client.messages.stream(model=model, max_tokens=5, messages=QUESTION, extra_body=GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == final.content[0].text == whole.content[0].text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 5
    assert final.usage.input_tokens == whole.usage.input_tokens

    with client.messages.stream(model=model, max_tokens=5, messages=QUESTION, extra_body=GREEDY) as stream:
        # the SDK adds its own derived events ("text", ...) beside the server's
        kinds = [e.type for e in stream if e.type not in ("text", "citation", "input_json", "thinking", "signature")]
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"} and len(kinds) >= 7, kinds


def test_stream_raw_events(client, model):
    """The events as sent (stream=True on create): message_start carries the input usage,
    message_delta the stop reason and the output tokens."""
    events = list(client.messages.create(model=model, max_tokens=4, messages=SHORT, stream=True,
                                         extra_body=GREEDY))
    start, delta = events[0], [e for e in events if e.type == "message_delta"][0]
    assert start.message.role == "assistant" and start.message.content == []
    assert start.message.usage.input_tokens > 0
    assert delta.delta.stop_reason in ("end_turn", "max_tokens") and delta.usage.output_tokens <= 4
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    whole = client.messages.create(model=model, max_tokens=4, messages=SHORT, extra_body=GREEDY)
    assert text == whole.content[0].text and delta.delta.stop_reason == whole.stop_reason


def test_system(client, model, frontend):
    system = "You are a pirate. Answer like one."
    m = client.messages.create(model=model, max_tokens=4, system=system, messages=QUESTION, extra_body=GREEDY)
    with_system = [{"role": "system", "content": system}, *QUESTION]
    assert m.usage.input_tokens == len(tokenize(frontend, messages=with_system))
    plain = client.messages.create(model=model, max_tokens=4, messages=QUESTION, extra_body=GREEDY)
    assert plain.usage.input_tokens != m.usage.input_tokens
    blocks = client.messages.create(model=model, max_tokens=4, messages=QUESTION, extra_body=GREEDY,
                                    system=[{"type": "text", "text": system}])
    assert blocks.content[0].text == m.content[0].text and blocks.usage.input_tokens == m.usage.input_tokens


def test_stop_sequences(client, model):
    full = client.messages.create(model=model, max_tokens=16, messages=QUESTION, extra_body=GREEDY).content[0].text
    stop, at = stop_inside(full)
    m = client.messages.create(model=model, max_tokens=16, messages=QUESTION, stop_sequences=[stop, "zzzq"],
                               extra_body=GREEDY)
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert m.content[0].text == full[:at]
    with client.messages.stream(model=model, max_tokens=16, messages=QUESTION, stop_sequences=[stop],
                                extra_body=GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == full[:at] and final.stop_reason == "stop_sequence" and final.stop_sequence == stop


def test_assistant_prefill_continues(client, model):
    """A conversation that ends with the assistant's words asks for their continuation."""
    prefill = "The capital of France is"
    m = client.messages.create(model=model, max_tokens=3, extra_body=GREEDY,
                               messages=[*QUESTION, {"role": "assistant", "content": prefill}])
    answered = client.messages.create(model=model, max_tokens=3, messages=QUESTION, extra_body=GREEDY)
    assert m.content[0].text != answered.content[0].text
    assert "Paris" in m.content[0].text


def test_content_blocks_and_sampling_fields(client, model):
    m = client.messages.create(model=model, max_tokens=3, extra_body={"temperature": 0.7, "top_p": 0.9, "top_k": 20},
                               messages=[{"role": "user", "content": [{"type": "text", "text": "Hello"},
                                                                      {"type": "text", "text": " there"}]}],
                               metadata={"user_id": "u-1"})
    assert m.usage.output_tokens == 3 or m.stop_reason == "end_turn"


def test_errors_in_anthropic_shape(client, model):
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(model=model, max_tokens=0, messages=QUESTION)
    assert info.value.status_code == 400
    body = info.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(model=model, max_tokens=4, messages=QUESTION, extra_body={"temperature": -1})
    assert "temperature" in info.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(model=model, max_tokens=4, messages=[{"role": "system", "content": "x"}])
    assert "role" in info.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(model=model, max_tokens=4, messages=QUESTION,
                               tools=[{"name": "f g", "description": "d", "input_schema": {"type": "object"}}])
    assert "tools[0].name" in info.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError) as info:
        client.messages.create(model="no-such-model", max_tokens=4, messages=QUESTION)
    assert info.value.body["type"] == "error" and info.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError):  # a bad streaming request fails before any event
        with client.messages.stream(model=model, max_tokens=-5, messages=QUESTION) as stream:
            list(stream)
