"""Reasoning over the HTTP APIs, end to end: a frontend with `--reasoning-parser qwen3` on the
bundled SmolLM2 (which does not think by itself), driven by the official `openai` and
`anthropic` SDKs. vLLM's `structured_outputs` regex, which constrains the whole output from the
first token, makes the model write `<think>...</think>answer`; the reply must split it into
reasoning_content / thinking blocks and content, streamed and not, and a reply cut off inside
its thinking has no content. response_format waits for the end of the reasoning: from the first
token where the prompt already ended it, never where the model does not think. Every test ends
with every KV block free."""

from __future__ import annotations

import json
import re

import anthropic
import pytest

from http_client import kv_free_after, model  # noqa: F401 - shared fixtures
from http_client import anthropic_client, openai_client

ASK = [{"role": "user", "content": "What is the capital of France?"}]
THOUGHT, ANSWER = "[a-z]{2,8}( [a-z]{2,8}){1,3}", "[A-Z][a-z]{1,8}( [a-z]{1,8}){0,3}[.]"
# The template-like newlines around the tags are not part of reasoning_content nor content.
THINKING = {"regex": f"<think>\n{THOUGHT}\n</think>\n\n{ANSWER}"}
OPENED = 5  # tokens of "<think>\n" and a little: cut off inside the thinking
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def frontend(servers):
    return servers.frontend("--reasoning-parser", "qwen3")


@pytest.fixture(scope="module")
def client(frontend):
    with openai_client(frontend) as c:
        yield c


@pytest.fixture(scope="module")
def claude(frontend):
    with anthropic_client(frontend) as c:
        yield c


def chat(client, model, **kw):
    return client.chat.completions.create(model=model, messages=ASK, temperature=0,
                                          **{"max_tokens": 48, "extra_body": {"structured_outputs": THINKING}, **kw})


def streamed(chunks) -> tuple[str, str, str | None]:
    """(reasoning, content, finish_reason) of a chat stream; the reasoning all comes first."""
    reasoning, content, finish, order = "", "", None, ""
    for chunk in chunks:
        for choice in chunk.choices:
            piece = getattr(choice.delta, "reasoning_content", None) or ""
            reasoning += piece
            content += choice.delta.content or ""
            order += ("r" if piece else "") + ("c" if choice.delta.content else "")
            finish = choice.finish_reason or finish
    assert re.fullmatch("r*c*", order), order
    return reasoning, content, finish


def test_chat_splits_reasoning_from_content(client, model):
    whole = chat(client, model).choices[0]
    assert re.fullmatch(THOUGHT, whole.message.reasoning_content), whole.message
    assert re.fullmatch(ANSWER, whole.message.content) and whole.finish_reason == "stop"
    assert streamed(chat(client, model, stream=True)) == (whole.message.reasoning_content,
                                                         whole.message.content, "stop")


def test_chat_cut_off_while_thinking_has_no_content(client, model):
    whole = chat(client, model, max_tokens=OPENED).choices[0]
    assert whole.message.reasoning_content and whole.message.content == ""
    assert whole.finish_reason == "length"
    assert streamed(chat(client, model, max_tokens=OPENED, stream=True)) == (
        whole.message.reasoning_content, "", "length")


def test_chat_without_thinking_has_no_reasoning(client, model):
    plain = client.chat.completions.create(model=model, messages=ASK, max_tokens=8, temperature=0)
    assert plain.choices[0].message.reasoning_content is None and plain.choices[0].message.content


def test_response_format_waits_for_the_end_of_the_reasoning(client, model):
    """The model never writes </think>: the format never applies, the reply is as without it."""
    free = client.chat.completions.create(model=model, messages=ASK, max_tokens=12, temperature=0)
    waited = client.chat.completions.create(model=model, messages=ASK, max_tokens=12, temperature=0,
                                            response_format={"type": "json_object"})
    assert waited.choices[0].message.content == free.choices[0].message.content


def test_response_format_applies_at_once_after_a_prompt_that_ended_the_reasoning(client, model):
    """As Qwen3's template writes `<think>\\n\\n</think>\\n\\n` for enable_thinking false."""
    ended = ASK + [{"role": "assistant", "content": "<think>\n\n</think>\n\n"}]
    reply = client.chat.completions.create(
        model=model, messages=ended, max_tokens=40, temperature=0, response_format={"type": "json_object"},
        extra_body={"continue_final_message": True, "add_generation_prompt": False})
    assert isinstance(json.loads(reply.choices[0].message.content), dict)


def message(claude, model, **kw):
    return claude.messages.create(model=model, messages=ASK, **{
        "max_tokens": 48, "extra_body": {"structured_outputs": THINKING, **GREEDY}, **kw})


def test_messages_give_thinking_blocks(claude, model):
    whole = message(claude, model)
    thinking, text = whole.content
    assert isinstance(thinking, anthropic.types.ThinkingBlock) and thinking.signature == ""
    assert re.fullmatch(THOUGHT, thinking.thinking) and re.fullmatch(ANSWER, text.text)
    assert whole.stop_reason == "end_turn"
    with claude.messages.stream(model=model, messages=ASK, max_tokens=48,
                                extra_body={"structured_outputs": THINKING, **GREEDY}) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in whole.content]
    kinds = [(e.type, getattr(getattr(e, "delta", None), "type", None)) for e in events
             if e.type.startswith("content_block")]
    assert kinds[0] == ("content_block_start", None) and kinds[1] == ("content_block_delta", "thinking_delta")
    assert kinds.index(("content_block_delta", "signature_delta")) < kinds.index(("content_block_stop", None))
    assert kinds.count(("content_block_start", None)) == 2 and kinds[-1] == ("content_block_stop", None)


def test_messages_cut_off_while_thinking(claude, model):
    whole = message(claude, model, max_tokens=OPENED)
    [thinking] = whole.content
    assert thinking.type == "thinking" and thinking.thinking and whole.stop_reason == "max_tokens"
    with claude.messages.stream(model=model, messages=ASK, max_tokens=OPENED,
                                extra_body={"structured_outputs": THINKING, **GREEDY}) as stream:
        final = stream.get_final_message()
    assert final.content == whole.content and final.stop_reason == "max_tokens"


def test_messages_thinking_field_and_thinking_sent_back(claude, model):
    """`thinking` is the template's enable_thinking (SmolLM2's ignores it); an earlier turn's
    thinking block goes back as its reasoning_content; omitted display empties the blocks."""
    history = ASK + [{"role": "assistant", "content": [
        {"type": "thinking", "thinking": "easy", "signature": ""}, {"type": "text", "text": "Paris."}]},
        {"role": "user", "content": "And of Italy?"}]
    for thinking in ({"type": "enabled", "budget_tokens": 1024}, {"type": "disabled"}, {"type": "adaptive"}):
        m = claude.messages.create(model=model, messages=history, max_tokens=1100, thinking=thinking,
                                   stop_sequences=["."], extra_body=GREEDY)
        assert m.content[-1].type == "text"
    omitted = message(claude, model, thinking={"type": "enabled", "budget_tokens": 1024, "display": "omitted"},
                      max_tokens=1100)
    assert omitted.content[0].type == "thinking" and omitted.content[0].thinking == ""
    with pytest.raises(anthropic.BadRequestError, match="budget_tokens"):
        claude.messages.create(model=model, messages=ASK, max_tokens=1000,
                               thinking={"type": "enabled", "budget_tokens": 1024})
