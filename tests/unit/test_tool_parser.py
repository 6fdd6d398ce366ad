"""The Hermes tool-call parser and its JSON scanner (frontend/tool_calls), CPU only: streamed
piece by piece at every split, several calls, content around them, arguments before the name,
malformed blocks; plus the forced-call grammar and the tools-as-text prompt."""

from __future__ import annotations

import json

import llguidance
import pytest
from hypothesis import given, settings, strategies as st

from common.errors import InvalidRequest
from frontend.tool_calls.grammar import forced_calls_grammar
from frontend.tool_calls.hermes import CallArguments, CallStart, Content, HermesParser, parse, tags_are_special
from frontend.tool_calls.json_scan import COMPLETE, INCOMPLETE, INVALID, JsonScanner
from frontend.tool_calls.prompt import chat_with_tools, messages_as_text
from frontend.tool_calls.tools import Tool, ToolChoice, tool_use

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8)
    | st.floats(allow_nan=False, allow_infinity=False, allow_subnormal=False),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8)
ARGUMENTS = st.dictionaries(st.text(max_size=6), JSON_VALUES, max_size=3)
FORMATS = st.sampled_from([{}, {"indent": 1}, {"separators": (",", ":")}, {"ensure_ascii": False}])


def collect(events) -> tuple[str, list[list[str]]]:
    """(all content, [[name, arguments text], ...]), checking the events' order on the way."""
    content, calls = "", []
    for e in events:
        if isinstance(e, Content):
            assert e.text
            content += e.text
        elif isinstance(e, CallStart):
            assert e.index == len(calls)
            calls.append([e.name, ""])
        else:
            assert isinstance(e, CallArguments) and e.index == len(calls) - 1 and e.text
            calls[e.index][1] += e.text
    return content, calls


def streamed(text: str, cuts) -> list:
    parser, events, start = HermesParser(), [], 0
    for cut in sorted(set(cuts)) + [len(text)]:
        events += parser.feed(text[start:cut])
        start = cut
    return events + parser.finish()


def call_block(name: str, arguments: dict, fmt: dict, arguments_first: bool = False) -> tuple[str, str]:
    """(the block's text, its arguments' text as written)."""
    args = json.dumps(arguments, **fmt)
    pairs = [f'"name": {json.dumps(name)}', f'"arguments": {args}']
    body = "{" + ", ".join(pairs[::-1] if arguments_first else pairs) + "}"
    return f"<tool_call>\n{body}\n</tool_call>", args


# -- the JSON scanner ------------------------------------------------------------------------

@given(value=JSON_VALUES, fmt=FORMATS)
def test_scanner_every_prefix_of_valid_json(value, fmt):
    text = json.dumps(value, **fmt)
    whole = JsonScanner()
    assert whole.feed(text) == len(text)
    scalar_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    assert whole.state == (INCOMPLETE if scalar_number else COMPLETE)  # a number ends at what follows
    if scalar_number:
        assert whole.feed(",") == 0 and whole.state == COMPLETE
    assert json.loads(whole.text) == value
    for cut in range(len(text)):
        prefix = JsonScanner()
        prefix.feed(text[:cut])
        assert prefix.state == INCOMPLETE, text[:cut]


@given(text=st.text(alphabet='{}[]":,. 0123456789-+eEtrufalsn\\x', max_size=30))
@settings(max_examples=300)
def test_scanner_agrees_with_json_on_any_text(text):
    scanner = JsonScanner()
    taken = scanner.feed(text + " ")  # a space ends a top-level number
    assert scanner.text == (text + " ")[:taken]
    if scanner.state == COMPLETE and not (text + " ")[taken:].strip():
        assert json.loads(text) == json.loads(scanner.text)
    else:  # invalid, unfinished, or followed by more: not one JSON document
        with pytest.raises(json.JSONDecodeError):
            json.loads(text)


@pytest.mark.parametrize("bad", ['{"a" 1}', '{"a":01}', "[1,]", '{"a":tru}', '{,}', '"\\q"', '{"a":1]'])
def test_scanner_catches_bad_syntax(bad):
    scanner = JsonScanner()
    scanner.feed(bad)
    assert scanner.state == INVALID


# -- the Hermes parser -----------------------------------------------------------------------

WHOLE = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}\n'
         '</tool_call>\n<tool_call>\n{"arguments": {"q": "a}b\\"</tool_call>"}, "name": "search"}\n</tool_call>\n'
         'Done.')


def test_two_calls_content_around_and_arguments_first():
    content, calls = collect(parse(WHOLE))
    assert content == "Let me check.\nDone."
    assert calls == [["get_weather", '{"city": "Paris", "days": [1, 2]}'],
                     ["search", '{"q": "a}b\\"</tool_call>"}']]


@pytest.mark.parametrize("cut", range(len(WHOLE) + 1))
def test_split_at_every_offset(cut):
    """In two pieces, wherever the cut falls (inside a tag, a key, an escape): the same result."""
    assert collect(streamed(WHOLE, [cut])) == collect(parse(WHOLE))


def test_one_character_at_a_time_streams_arguments_early():
    parser, seen = HermesParser(), []
    for i, c in enumerate(WHOLE):
        for e in parser.feed(c):
            seen.append((i, e))
    first_arguments = next(i for i, e in seen if isinstance(e, CallArguments))
    assert first_arguments == WHOLE.index('{"city"'), "arguments go out from their first character"
    assert collect([e for _, e in seen] + parser.finish()) == collect(parse(WHOLE))


@given(pieces=st.lists(st.one_of(
           st.text(alphabet=st.characters(blacklist_characters="<"), max_size=12),
           st.tuples(st.from_regex(r"[a-z_]{1,8}", fullmatch=True), ARGUMENTS, FORMATS, st.booleans())),
           max_size=5),
       cuts=st.lists(st.integers(0, 400), max_size=8))
@settings(max_examples=200)
def test_any_mix_streamed_anyhow(pieces, cuts):
    """Content and calls in any order, any chunking: the calls come out with their arguments
    text exactly as written, and the content is the text outside them (bar the whitespace
    that joins blocks to the text)."""
    text, want_calls, want_content = "", [], ""
    for piece in pieces:
        if isinstance(piece, str):
            text += piece
            want_content += piece
        else:
            block, args = call_block(piece[0], piece[1], piece[2], piece[3])
            text += block
            want_calls.append([piece[0], args])
    content, calls = collect(streamed(text, [c for c in cuts if c <= len(text)]))
    assert calls == want_calls
    assert [json.loads(args) for _, args in calls] == [p[1] for p in pieces if not isinstance(p, str)]
    assert "".join(content.split()) == "".join(want_content.split())
    assert (content, calls) == collect(parse(text))


@pytest.mark.parametrize("text", [
    "<tool_call>hello</tool_call> world",
    '<tool_call>\n{"name": 5, "arguments": {}}\n</tool_call>',
    '<tool_call>\n{"arguments": {"a": 1}}\n</tool_call>',
    '<tool_call>\n{"name": "f", "arguments": [1]}\n</tool_call>',
    '<tool_call>\n{"name": "f", "arguments": {"a": 1,}}\n</tool_call>',
    '<tool_call>\n{"name": "f", "name": "g", "arguments": {}}\n</tool_call>',
    '<tool_call>\n{"name": "f", "arguments": {"a": 1',
    "<tool_call",
])
def test_malformed_or_cut_off_block_is_content(text):
    content, calls = collect(parse(text))
    assert calls == [] and content == text


def test_malformed_block_then_a_good_one():
    content, calls = collect(parse('<tool_call>{oops}\n<tool_call>{"name": "f", "arguments": {}}</tool_call>'))
    assert content == "<tool_call>{oops}" and calls == [["f", "{}"]]


def test_stream_cannot_take_back_an_announced_call():
    """Arguments that turn bad after the stream announced the call: the call keeps what was
    sent, the rest is content; nothing is lost or doubled."""
    parser = HermesParser()
    first = parser.feed('<tool_call>{"name": "f", "arguments": {"a": 1')
    rest = parser.feed(' x}}</tool_call>') + parser.finish()
    content, calls = collect(first + rest)
    assert calls == [["f", '{"a": 1 ']] and content == 'x}}</tool_call>'


def test_call_without_arguments_or_closing_tag():
    assert collect(parse('<tool_call>{"name": "now"}')) == ("", [["now", "{}"]])
    assert collect(parse('<tool_call>{"name": "f", "arguments": {}}\nThanks')) == ("Thanks", [["f", "{}"]])


GARBAGE = st.lists(st.sampled_from(["<tool_call>", "</tool_call>", "<tool", "{", "}", '"name"', '"arguments"',
                                   ":", ",", '"f"', " ", "\n", "x", "[", "]", "1"]), max_size=40).map("".join)


@given(text=GARBAGE, cuts=st.lists(st.integers(0, 200), max_size=6))
@settings(max_examples=300)
def test_garbage_never_crashes(text, cuts):
    collect(streamed(text, [c for c in cuts if c <= len(text)]))
    content, calls = collect(parse(text))
    assert all(isinstance(json.loads(args), dict) for _, args in calls)


# -- grammar, tools, prompt ------------------------------------------------------------------

NESTED = {"type": "object", "properties": {"item": {"$ref": "#/$defs/Item"}},
          "required": ["item"], "$defs": {"Item": {"type": "object", "properties": {"n": {"type": "integer"}}}}}


@pytest.mark.parametrize("one", [True, False])
def test_forced_grammar_compiles_with_refs(one):
    tools = (Tool("a", None, NESTED), Tool("b", "bee", {"type": "object", "properties": {}}))
    grammar = forced_calls_grammar(tools, one)
    assert llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_lark(grammar)) == ""
    assert ("(\"\\n\" call)*" in grammar) is not one


def test_tool_checks():
    f = Tool("f", None, {"type": "object"})
    with pytest.raises(InvalidRequest, match=r"tools\[1\].name: 'f' is given twice"):
        tool_use([f, f], ToolChoice())
    with pytest.raises(InvalidRequest, match=r"tools\[0\].name"):
        tool_use([Tool("a b", None, {})], ToolChoice())
    with pytest.raises(InvalidRequest, match="no tool is named 'g'"):
        tool_use([f], ToolChoice("named", "g"))
    with pytest.raises(InvalidRequest, match="parameters"):
        tool_use([Tool("f", None, {"type": "array"})], ToolChoice())
    assert tool_use([], ToolChoice("auto")) is None
    assert tool_use([f], ToolChoice("none")).constraint() is None


def test_tools_as_text_for_a_template_without_tools():
    use = tool_use([Tool("f", "does f", {"type": "object"})], ToolChoice("auto"))
    history = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
               {"role": "assistant", "content": "",
                "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "42"}, {"role": "tool", "content": "43"}]
    out = messages_as_text(history, use)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"].startswith("Be brief.") and '"name": "f"' in out[0]["content"]
    assert "<tools>" in out[0]["content"] and "<tool_call>" in out[0]["content"]
    assert collect(parse(out[2]["content"])) == ("", [["f", '{"a": 1}']])
    assert out[3]["content"] == "<tool_response>\n42\n</tool_response>\n<tool_response>\n43\n</tool_response>"
    assert all(set(m) == {"role", "content"} for m in out)


def test_template_choice():
    use = tool_use([Tool("f", None, {"type": "object"})], ToolChoice("auto"))
    plain = [{"role": "user", "content": "hi"}]
    assert chat_with_tools("{{ messages }}", plain, None) == (plain, None)
    messages, tools = chat_with_tools("{% if tools %}{{ tools }}{% endif %}", plain, use)
    assert messages == plain
    assert tools == [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    messages, tools = chat_with_tools("{{ messages }}", plain, use)
    assert tools is None and messages[0]["role"] == "system"
    with pytest.raises(InvalidRequest, match="no chat template"):
        chat_with_tools(None, plain, use)


def test_tags_as_special_tokens_are_noticed():
    """Hermes 2 Pro's tokenizer has <tool_call> as a special token: output must keep those."""
    from types import SimpleNamespace

    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import models
    backend = RustTokenizer(models.WordLevel({"a": 0}, unk_token="a"))
    assert not tags_are_special(SimpleNamespace(backend=backend))
    backend.add_tokens(["<tool_call>"])
    assert not tags_are_special(SimpleNamespace(backend=backend))
    backend.add_special_tokens(["</tool_call>"])
    assert tags_are_special(SimpleNamespace(backend=backend))
    assert not tags_are_special(object())
