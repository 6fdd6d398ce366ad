"""Harmony (frontend/harmony) against openai-harmony itself, on gpt-oss's real tokenizer
(o200k_harmony, built from the o200k_base ranks: tests/harmony_model.py).

- A conversation with instructions, tools, reasoning, a call and its result renders to
  exactly the tokens openai-harmony renders for the same messages built by hand.
- Output through every channel, fed whole and split at every token, gives the same events:
  analysis -> Reasoning, a message to functions.NAME -> a call, final -> Content.
- Output that breaks the format loses nothing (it is Content); a call cut off is Content in a
  whole parse; bad requests and a tokenizer that is not o200k are refused by name.
"""

from __future__ import annotations

import datetime
import logging

import pytest
from openai_harmony import (Author, Conversation, DeveloperContent, Message, ReasoningEffort, Role, SystemContent,
                            ToolDescription)

from common.errors import InvalidRequest
from common.validation import PromptLimits
from frontend.harmony import encoding as harmony_encoding
from frontend.harmony.parser import HarmonyParser, parse
from frontend.input_processor import InputProcessor
from frontend.output_events import CallArguments, CallStart, Content, Reasoning
from frontend.tokenizer import Tokenizer
from harmony_model import VOCAB_SIZE, tokenizer_folder

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather now in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
MESSAGES = [
    {"role": "system", "content": "Answer in French."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "reasoning_content": "I should call the tool.", "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "clear"}'},
]
ANSWER = ("<|channel|>analysis<|message|>The user wants the weather. 😀 Clear.<|end|>"
          "<|start|>assistant<|channel|>final<|message|>Il fait beau à Paris.<|return|>")
CALLING = ("<|channel|>analysis<|message|>Need the tool.<|end|>"
           "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
           '<|message|>{"city": "Paris"}<|call|>')


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_dir(tokenizer_folder())


@pytest.fixture(scope="module")
def encoding(tokenizer):
    return harmony_encoding.load(tokenizer)


@pytest.fixture(scope="module")
def processor(tokenizer, encoding):
    return InputProcessor(tokenizer, PromptLimits(VOCAB_SIZE, 4096, 256, 16), harmony=encoding)


def test_the_prompt_is_openai_harmonys_token_for_token(processor, encoding):
    ids = processor.tokenize_chat(MESSAGES, tools=[WEATHER], chat_template_kwargs={"reasoning_effort": "high"})
    system = (SystemContent.new().with_reasoning_effort(ReasoningEffort.HIGH)
              .with_conversation_start_date(datetime.date.today().isoformat()))
    developer = DeveloperContent.new().with_instructions("Answer in French.").with_function_tools([
        ToolDescription.new("get_weather", "The weather now in a city.", parameters=WEATHER["function"]["parameters"])])
    expected = encoding.render_conversation_for_completion(Conversation.from_messages([
        Message.from_role_and_content(Role.SYSTEM, system),
        Message.from_role_and_content(Role.DEVELOPER, developer),
        Message.from_role_and_content(Role.USER, "Weather in Paris?"),
        Message.from_role_and_content(Role.ASSISTANT, "I should call the tool.").with_channel("analysis"),
        Message.from_role_and_content(Role.ASSISTANT, '{"city": "Paris"}').with_channel("commentary")
        .with_recipient("functions.get_weather").with_content_type("<|constrain|>json"),
        Message.from_author_and_content(Author.new(Role.TOOL, "functions.get_weather"), '{"sky": "clear"}')
        .with_recipient("assistant").with_channel("commentary"),
    ]), Role.ASSISTANT)
    assert ids == expected
    text = processor.tokenizer.decode(ids)
    assert text.endswith("<|start|>assistant") and "Reasoning: high" in text and "# Instructions" in text
    # The analysis before a call stays (the model reasons on from there); after a final answer it goes.
    assert "I should call the tool." in text
    answered = MESSAGES[:2] + [{"role": "assistant", "content": "Beau.", "reasoning_content": "Easy."},
                               {"role": "user", "content": "Merci"}]
    text = processor.tokenizer.decode(processor.tokenize_chat(answered))
    assert "Easy." not in text and "<|channel|>final<|message|>Beau.<|end|>" in text and "Reasoning: medium" in text


def test_no_tools_and_no_instructions_leave_the_developer_message_out(processor):
    text = processor.tokenizer.decode(processor.tokenize_chat([{"role": "user", "content": "Hi"}]))
    assert "<|start|>developer" not in text and text.count("<|start|>") == 3  # system, user, assistant


def test_bad_chat_requests_are_refused_by_name(processor):
    with pytest.raises(InvalidRequest, match="reasoning_effort: 'minimal'"):
        processor.tokenize_chat(MESSAGES[:2], chat_template_kwargs={"reasoning_effort": "minimal"})
    orphan = [{"role": "user", "content": "Hi"}, {"role": "tool", "tool_call_id": "nope", "content": "1"}]
    with pytest.raises(InvalidRequest, match=r"messages\[1\]: a tool result needs"):
        processor.tokenize_chat(orphan)
    with pytest.raises(InvalidRequest, match="continue_final_message"):
        processor.tokenize_chat(MESSAGES[:2] + [{"role": "assistant", "content": "Il"}],
                                add_generation_prompt=False, continue_final_message=True)


def _events(encoding, text, reasoning=True, calls=True, split=None):
    ids = encoding.encode(text, allowed_special="all")
    if split is None:
        return parse(encoding, ids, reasoning, calls), ids
    parser = HarmonyParser(encoding, reasoning, calls)
    return parser.feed(ids[:split]) + parser.feed(ids[split:]) + parser.finish(), ids


def _joined(events):
    """Reasoning, content and each call's (name, arguments), however the events were cut."""
    reasoning = "".join(e.text for e in events if isinstance(e, Reasoning))
    content = "".join(e.text for e in events if isinstance(e, Content))
    calls = {e.index: [e.name, ""] for e in events if isinstance(e, CallStart)}
    for e in events:
        if isinstance(e, CallArguments):
            calls[e.index][1] += e.text
    return reasoning, content, [tuple(c) for _, c in sorted(calls.items())]


def test_every_channel_streamed_at_every_split_equals_whole(encoding):
    whole, ids = _events(encoding, ANSWER)
    assert _joined(whole) == ("The user wants the weather. 😀 Clear.", "Il fait beau à Paris.", [])
    for split in range(len(ids) + 1):
        assert _joined(_events(encoding, ANSWER, split=split)[0]) == _joined(whole), split
    whole, ids = _events(encoding, CALLING)
    assert _joined(whole) == ("Need the tool.", "", [("get_weather", '{"city": "Paris"}')])
    for split in range(len(ids) + 1):
        events = _events(encoding, CALLING, split=split)[0]
        assert _joined(events) == _joined(whole), split
        starts = [i for i, e in enumerate(events) if isinstance(e, CallStart)]
        assert starts and all(not isinstance(e, CallArguments) for e in events[:starts[0]])


def test_the_flags_keep_reasoning_and_calls_in_the_content(encoding):
    events, _ = _events(encoding, CALLING, reasoning=False, calls=False)
    assert _joined(events) == ("", 'Need the tool.{"city": "Paris"}', [])


def test_output_that_breaks_the_format_is_content_as_written(encoding):
    for text, content in (("Just words, no header.", "Just words, no header."),
                          ("<|channel|>final<|message|>Hi<|end|>stray words", "Histray words")):
        for split in (None, 1, 5):
            assert _joined(_events(encoding, text, split=split)[0]) == ("", content, []), (text, split)
    # A header cut off by max_tokens: its tokens are content, special ones as written.
    events, _ = _events(encoding, "<|channel|>analysis<|message|>Hm.<|end|><|start|>assistant<|channel|>fin")
    assert _joined(events) == ("Hm.", "<|start|>assistant<|channel|>fin", [])


def test_a_call_cut_off_is_content_whole_and_a_call_when_streamed(encoding):
    cut = CALLING[:CALLING.index('"Paris"')]
    reasoning, content, calls = _joined(_events(encoding, cut)[0])
    assert calls == [] and content == '{"city": '
    streamed, _ = _events(encoding, cut, split=3)
    assert _joined(streamed)[2] == [("get_weather", '{"city": ')]  # sent already: it stays a call
    empty = CALLING.replace('{"city": "Paris"}', "")
    assert _joined(_events(encoding, empty)[0])[2] == [("get_weather", "{}")]


def test_a_tokenizer_that_is_not_o200k_is_refused(bundled_tokenizer, caplog, monkeypatch, tmp_path):
    monkeypatch.delenv(harmony_encoding.VOCABULARY_FOLDER_ENV, raising=False)
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path))
    with pytest.raises(ValueError, match="not a byte-level BPE token|not o200k_base"):
        harmony_encoding.load(bundled_tokenizer)
    assert harmony_encoding.for_model("llama", bundled_tokenizer, None) is None
    with caplog.at_level(logging.WARNING):
        assert harmony_encoding.for_model("gpt_oss", bundled_tokenizer, None) is None
    assert "chat template instead" in caplog.text
    with pytest.raises(ValueError):
        harmony_encoding.for_model("llama", bundled_tokenizer, True)
    monkeypatch.setenv(harmony_encoding.VOCABULARY_FOLDER_ENV, str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="vocabulary folder"):
        harmony_encoding.load(bundled_tokenizer)


def test_the_vocabulary_written_from_the_tokenizer_is_o200k_base(tokenizer, tmp_path, monkeypatch):
    monkeypatch.delenv(harmony_encoding.VOCABULARY_FOLDER_ENV, raising=False)
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path))
    encoding = harmony_encoding.load(tokenizer)
    assert harmony_encoding._is_valid(tmp_path / "o200k" / harmony_encoding.FILE)
    text = "Grüße, 世界! <|start|>user<|message|>"
    assert tokenizer.encode(text, add_special_tokens=False) == encoding.encode(text, allowed_special="all")


def test_forced_call_grammar_takes_a_harmony_call(encoding, tokenizer):
    import llguidance
    import llguidance.hf
    from frontend.tool_calls.tools import Tool, ToolChoice, ToolUse
    from transformers import PreTrainedTokenizerFast
    tool = Tool("get_weather", "", WEATHER["function"]["parameters"])
    grammar = ToolUse((tool,), ToolChoice("required")).constraint(harmony=True).grammar
    hf = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_folder() / "tokenizer.json"))
    lltok = llguidance.hf.from_tokenizer(hf, n_vocab=VOCAB_SIZE, eos_token=[200002, 200012])
    compact = CALLING[CALLING.index("<|channel|>commentary"):].replace('{"city": "Paris"}', '{"city":"Paris"}')
    ids = encoding.encode(compact, allowed_special="all")
    matcher = llguidance.LLMatcher(lltok, grammar)
    assert not matcher.is_error(), matcher.get_error()
    assert matcher.consume_tokens(ids) and matcher.is_stopped(), matcher.get_error()


def test_a_format_holds_the_final_channel_and_a_forced_call_the_whole_output(processor, encoding):
    from common.structured_output.params import StructuredOutputsParams
    from frontend.http.params import after_reasoning
    fmt = StructuredOutputsParams(json_object=True, param="response_format")
    held = after_reasoning(fmt, processor, "harmony", [1, 2])
    assert held.starts_after == tuple(encoding.encode("<|channel|>final<|message|>", allowed_special="all"))
    forced = StructuredOutputsParams(grammar="start: x", param="tool_choice")
    assert after_reasoning(forced, processor, "harmony", [1, 2]) is forced
