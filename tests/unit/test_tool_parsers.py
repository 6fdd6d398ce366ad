"""Every family's tool-call parser (frontend/tool_calls/parsers.py), CPU only: real examples of
each format (one call, parallel calls, text before, no call, malformed, arguments that are no
JSON) read whole, then streamed split at every character and in random chunks, which must give
the same calls and content; generated mixes of text and calls in each format; how `auto`
picks a family from the chat template."""

from __future__ import annotations

import itertools
import json
import keyword
import re
from types import SimpleNamespace

import pytest
from hypothesis import given, settings, strategies as st

from common.errors import InvalidRequest
from frontend.http.sample_output import anthropic_blocks
from frontend.output_events import CallStart
from frontend.sample_parser import SampleParser, parse_sample
from frontend.tool_calls import arguments as call_arguments, parsers
from frontend.tool_calls.arguments import MAX_DEPTH
from frontend.tool_calls.tools import Tool
from test_tool_parser import collect  # the Hermes tests' event check, for every family

WEATHER = Tool("get_weather", "Weather now", {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
    "hours": {"type": "array"}, "where": {"type": "object"}, "scale": {"type": ["number", "null"]},
    "note": {"anyOf": [{"type": "integer"}, {"type": "string"}]}}})
TOOLS = (WEATHER, Tool("get_time", None, {"type": "object", "properties": {"zone": {"type": "string"}}}))


def streamed(family: str, text: str, cuts) -> list:
    """The events of `text` fed in pieces cut at `cuts`; `num_calls` counts the calls sent."""
    parser, events, start = parsers.make_parser(family, TOOLS), [], 0
    for cut in sorted(set(cuts)) + [len(text)]:
        events += parser.feed(text[start:cut])
        start = cut
        assert parser.num_calls == sum(isinstance(e, CallStart) for e in events)
    events += parser.finish()
    assert parser.num_calls == sum(isinstance(e, CallStart) for e in events)
    return events


def whole(family: str, text: str) -> tuple[str, list[list[str]]]:
    return collect(parsers.parse(family, text, TOOLS))


# -- real examples, per family: (text, content, [(name, arguments), ...]) ---------------------

PARIS = {"city": "Paris"}
EXAMPLES = {
    "hermes": {
        "single": ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', "",
                   [("get_weather", PARIS)]),
        "parallel": ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
                     '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>', "",
                     [("get_weather", PARIS), ("get_time", {"zone": "CET"})]),
        "text before": ('I will check the weather.\n<tool_call>\n{"name": "get_weather", "arguments": '
                        '{"city": "Paris"}}\n</tool_call>', "I will check the weather.", [("get_weather", PARIS)]),
        "whitespace around": ('\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n\nIt is noon.'
                              '\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n', "It is noon.",
                              [("get_time", {}), ("get_time", {})]),
        "no call": ("Paris is sunny today.", "Paris is sunny today.", []),
        "malformed": ('<tool_call>\n{"name": "get_weather", "arguments": "Paris"}\n</tool_call>',
                      '<tool_call>\n{"name": "get_weather", "arguments": "Paris"}\n</tool_call>', []),
    },
    "llama3_json": {
        "single": ('{"name": "get_weather", "parameters": {"city": "Paris"}}', "", [("get_weather", PARIS)]),
        "python tag": ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}', "",
                       [("get_weather", PARIS)]),
        "parallel": ('{"name": "get_weather", "parameters": {"city": "Paris"}}; '
                     '{"name": "get_time", "parameters": {"zone": "CET"}}', "",
                     [("get_weather", PARIS), ("get_time", {"zone": "CET"})]),
        "arguments key": ('<|python_tag|>{"name": "get_time", "arguments": {}}', "", [("get_time", {})]),
        "text before": ('Let me look that up. {"name": "get_weather", "parameters": {"city": "Paris"}}',
                        "Let me look that up.", [("get_weather", PARIS)]),
        "no call": ("Paris is sunny today.", "Paris is sunny today.", []),
        "other json": ('Send {"city": "Paris", "name": "x"} to it.', 'Send {"city": "Paris", "name": "x"} to it.', []),
        "malformed": ('{"name": "get_weather"}', '{"name": "get_weather"}', []),
        "built-in tool": ('<|python_tag|>brave_search.call(query="Paris weather")',
                          '<|python_tag|>brave_search.call(query="Paris weather")', []),
    },
    "mistral": {
        "v3 single": ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]', "",
                      [("get_weather", PARIS)]),
        "v3 parallel": ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "a1B2c3D4e"}, '
                        '{"name": "get_time", "arguments": {"zone": "CET"}}]', "",
                        [("get_weather", PARIS), ("get_time", {"zone": "CET"})]),
        "v11 single": ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', "", [("get_weather", PARIS)]),
        "v11 parallel": ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{"zone": "CET"}',
                         "", [("get_weather", PARIS), ("get_time", {"zone": "CET"})]),
        "v11 call id": ('[TOOL_CALLS]get_weather[CALL_ID]a1B2c3D4e[ARGS]{"city": "Paris"}', "",
                        [("get_weather", PARIS)]),
        "args token dropped": ('[TOOL_CALLS]get_weather{"city": "Paris"}', "", [("get_weather", PARIS)]),
        "text before": ('Let me check.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', "Let me check.",
                        [("get_weather", PARIS)]),
        "no call": ("Paris is sunny today.", "Paris is sunny today.", []),
        "malformed": ("[TOOL_CALLS] I can't call tools.", "[TOOL_CALLS] I can't call tools.", []),
        "v3 without arguments": ('[TOOL_CALLS] [{"name": "get_weather"}]', '[TOOL_CALLS] [{"name": "get_weather"}]',
                                 []),
    },
    "qwen3_coder": {
        "single": ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n"
                   "</tool_call>", "", [("get_weather", PARIS)]),
        "parallel": ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                     "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n"
                     "<tool_call>\n<function=get_time>\n</function>\n</tool_call>", "",
                     [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {})]),
        "text before": ("I'll check.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                        "</function>\n</tool_call>", "I'll check.", [("get_weather", PARIS)]),
        "typed values": ("<tool_call>\n<function=get_weather>\n<parameter=city>\n1984\n</parameter>\n"
                         "<parameter=metric>\nTrue\n</parameter>\n<parameter=hours>\n[9, 12]\n</parameter>\n"
                         '<parameter=where>\n{"lat": 48.9}\n</parameter>\n<parameter=scale>\nnull\n</parameter>\n'
                         "<parameter=note>\n7\n</parameter>\n<parameter=extra>\n1\n</parameter>\n</function>\n"
                         "</tool_call>", "",
                         [("get_weather", {"city": "1984", "metric": True, "hours": [9, 12], "where": {"lat": 48.9},
                                           "scale": None, "note": 7, "extra": "1"})]),
        "multi-line string": ("<tool_call>\n<function=get_weather>\n<parameter=city>\nLine 1\n\n  <b>Line 3</b>\n"
                              "</parameter>\n</function>\n</tool_call>", "",
                              [("get_weather", {"city": "Line 1\n\n  <b>Line 3</b>"})]),
        "no closing parameter tags": ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
                                      "<parameter=days>\n2\n</function>\n</tool_call>", "",
                                      [("get_weather", {"city": "Paris", "days": 2})]),
        "no tool_call tags": ("<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>", "",
                              [("get_weather", PARIS)]),
        "no call": ("Paris is sunny today.", "Paris is sunny today.", []),
        "malformed": ('<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>',
                      '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>', []),
        "non-JSON value": ("<tool_call>\n<function=get_weather>\n<parameter=days>\nthree\n</parameter>\n</function>\n"
                           "</tool_call>", "", [("get_weather", {"days": "three"})]),
    },
    "pythonic": {
        "single": ('[get_weather(city="Paris")]', "", [("get_weather", PARIS)]),
        "parallel": ("[get_weather(city='Paris'), get_time(zone=\"CET\")]", "",
                     [("get_weather", PARIS), ("get_time", {"zone": "CET"})]),
        "literals": ('[get_weather(days=-3, scale=2.5, metric=True, where=None, hours=[9, (12, 13)], '
                     "note={'a': 'b)]'}, city='''Par\"is''')]", "",
                     [("get_weather", {"days": -3, "scale": 2.5, "metric": True, "where": None, "hours": [9, [12, 13]],
                                       "note": {"a": "b)]"}, "city": 'Par"is'})]),
        "no arguments": ("[get_time()]", "", [("get_time", {})]),
        "text before": ('Sure! [get_weather(city="Paris")]', "Sure!", [("get_weather", PARIS)]),
        "no call": ("See [1] and [the docs](https://example.com).", "See [1] and [the docs](https://example.com).", []),
        "malformed": ('[get_weather("Paris")]', '[get_weather("Paris")]', []),
        "non-literal": ("[get_weather(city=Paris)]", "[get_weather(city=Paris)]", []),
    },
}
CASES = [(family, name) for family, examples in EXAMPLES.items() for name in examples]
# Arguments that begin as JSON and go wrong: read whole they are text, but a stream that got
# as far as their start has announced the call and cannot take it back.
NOT_JSON = {
    "hermes": ('<tool_call>\n{"name": "get_weather", "arguments": {city: Paris}}\n</tool_call>', "get_weather"),
    "llama3_json": ('{"name": "get_weather", "parameters": {"city": Paris}}', "get_weather"),
    "mistral": ('[TOOL_CALLS]get_weather[ARGS]{"city": Paris}', "get_weather"),
    "qwen3_coder": ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\nsunny", "get_weather"),
}


@pytest.mark.parametrize("family,case", CASES)
def test_real_examples_whole(family, case):
    text, content, calls = EXAMPLES[family][case]
    got_content, got_calls = whole(family, text)
    assert got_content == content
    assert [(name, json.loads(args)) for name, args in got_calls] == calls


# Token-like pieces: a marker (a special token) whole, a word, a run of spaces, a character.
TOKEN = re.compile(r"<\|python_tag\|>|\[TOOL_CALLS\]|\[ARGS\]|\[CALL_ID\]|</?tool_call>|\w+|\s+|.", re.S)


@pytest.mark.parametrize("family,case", CASES)
def test_real_examples_split_everywhere(family, case):
    """In two pieces wherever the cut falls (inside a marker, a name, a string), one character
    at a time, and token by token: the same content and calls as read whole."""
    text = EXAMPLES[family][case][0]
    want = whole(family, text)
    for cut in range(len(text) + 1):
        assert collect(streamed(family, text, [cut])) == want, cut
    assert collect(streamed(family, text, range(len(text)))) == want
    token_ends = list(itertools.accumulate(len(t) for t in TOKEN.findall(text)))
    assert collect(streamed(family, text, token_ends)) == want


@pytest.mark.parametrize("family,case", CASES)
@given(data=st.data())
@settings(max_examples=25)
def test_real_examples_random_chunks(family, case, data):
    text = EXAMPLES[family][case][0]
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=12))
    assert collect(streamed(family, text, cuts)) == whole(family, text)


@pytest.mark.parametrize("family", NOT_JSON)
def test_arguments_that_are_no_json(family):
    """Read whole: text, never an error. Streamed: the same, or (cut after the arguments began)
    the announced call, kept, with the rest as text."""
    text, name = NOT_JSON[family]
    assert whole(family, text) == (text, [])
    for cut in range(len(text) + 1):
        content, calls = collect(streamed(family, text, [cut]))
        assert (content, calls) == (text, []) or [n for n, _ in calls] == [name], cut


DEEP = "[" * 5000 + "]" * 5000


@pytest.mark.parametrize("family,text", [
    ("hermes", f'<tool_call>{{"name": "get_time", "x": {DEEP}, "arguments": {{"zone": {DEEP}}}}}</tool_call>'),
    ("llama3_json", f'{{"name": "get_time", "parameters": {{"zone": {DEEP}}}}}'),
    ("qwen3_coder", f"<function=get_weather>\n<parameter=hours>\n{DEEP}\n</parameter>\n</function>"),
    ("pythonic", f"[get_time(zone={DEEP})]"),
])
def test_deep_nesting_is_no_error(family, text):
    """Values nested deeper than Python's recursion limit: read without an error, and no call
    (json.loads could not read its arguments back), but Qwen3-Coder's, whose value stays text."""
    content, calls = whole(family, text)
    if family == "qwen3_coder":
        [[name, text_arguments]] = calls
        assert json.loads(text_arguments) == {"hours": DEEP}
    else:
        assert calls == [] and content == text


def _nested(depth: int) -> str:
    """Arguments `depth` levels deep, the object itself the first."""
    return '{"a": ' + "[" * (depth - 1) + "]" * (depth - 1) + "}"


@pytest.mark.parametrize("family,call", [
    ("hermes", '<tool_call>{{"name": "get_time", "arguments": {}}}</tool_call>'),
    ("llama3_json", '{{"name": "get_time", "parameters": {}}}'),
    ("mistral", "[TOOL_CALLS]get_time[ARGS]{}"),
])
def test_arguments_nest_at_most_max_depth(family, call):
    """A call's arguments may nest arguments.MAX_DEPTH levels, on the way out as on the way in
    (a client's deeper ones are a 400); one level more and the text is no call. Anthropic's
    answer reads them back (sample_output.anthropic_blocks): within the limit, whatever the
    stack."""
    deepest = call.format(_nested(MAX_DEPTH))
    assert [n for n, _ in whole(family, deepest)[1]] == ["get_time"]
    assert whole(family, call.format(_nested(MAX_DEPTH + 1))) == (call.format(_nested(MAX_DEPTH + 1)), [])
    [block] = anthropic_blocks(parse_sample(deepest, tools=family))
    assert block["type"] == "tool_use" and block["input"] == json.loads(_nested(MAX_DEPTH))


def test_a_clients_arguments_nest_at_most_max_depth():
    """arguments.check, for an earlier call a client sends back: JSON text or an object, as deep
    as MAX_DEPTH; deeper (json.loads' RecursionError too) is a 400 naming the field; text that
    json.loads can't read otherwise passes (it is written into the prompt as given)."""
    check = call_arguments.check
    for given in (_nested(MAX_DEPTH), json.loads(_nested(MAX_DEPTH)), "{not json", '{"a": ' + "1" * 5000 + "}"):
        check(given, "f")
    for given in (_nested(MAX_DEPTH + 1), json.loads(_nested(MAX_DEPTH + 1)), "[" * 100_000):
        with pytest.raises(InvalidRequest, match=rf"^input\[1\]\.arguments: nested deeper than {MAX_DEPTH} levels"):
            check(given, "input[1].arguments")


@pytest.mark.parametrize("arguments", ['{"a": ' + "[" * 2000 + "]" * 2000 + "}",
                                       '{"a": ' + "1" * 5000 + "}"])
def test_arguments_json_loads_cannot_read_are_text(arguments):
    """Past Python's recursion limit, or a number longer than int() reads: an answer (Anthropic's
    is the one that reads the arguments) with the call as text, not an error."""
    text = f'<tool_call>{{"name": "get_time", "arguments": {arguments}}}</tool_call>'
    assert anthropic_blocks(parse_sample(text, tools="hermes")) == [{"type": "text", "text": text}]


def test_stream_keeps_an_announced_call():
    """Qwen3-Coder's arguments go out a parameter at a time: a call cut short still ends as a
    whole JSON object."""
    parser = parsers.make_parser("qwen3_coder", TOOLS)
    events = parser.feed("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n")
    content, calls = collect(events + parser.feed("<parameter=days>\n2") + parser.finish())
    assert content == "" and calls == [["get_weather", '{"city": "Paris"}']]


# -- generated mixes of text and calls, per family ---------------------------------------------

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8)
    | st.floats(allow_nan=False, allow_infinity=False, allow_subnormal=False),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8)
TEXT = st.text(alphabet="abc XYZ.,!?'\n", max_size=12)  # no character that may begin a block
NAMES = st.from_regex(r"[a-z_][a-z0-9_]{0,7}", fullmatch=True).filter(lambda n: not keyword.iskeyword(n))
JSON_CALL = st.tuples(NAMES, st.dictionaries(st.text(max_size=6), JSON_VALUES, max_size=3))
PY_CALL = st.tuples(NAMES, st.dictionaries(NAMES, JSON_VALUES, max_size=3))
# Qwen3-Coder: values of get_weather's typed parameters, written as the template writes them.
QWEN_VALUE = {"city": st.text(alphabet="ab <>/=\n\"{}1", max_size=10).filter(
                  lambda s: not any(end in s for end in ("</parameter>", "<parameter=", "</function>"))),
              "days": st.integers(), "metric": st.booleans(), "hours": st.lists(JSON_VALUES, max_size=3),
              "where": st.dictionaries(st.text(max_size=4), JSON_VALUES, max_size=2)}
QWEN_CALL = st.tuples(st.just("get_weather"), st.fixed_dictionaries({}, optional=QWEN_VALUE))


def _json_call(call, key="arguments") -> str:
    return json.dumps({"name": call[0], key: call[1]})


def _qwen_value(value) -> str:
    return value if isinstance(value, str) else str(value) if isinstance(value, bool) else json.dumps(value)


RENDER = {  # a block of one or more calls, as each family writes it
    "hermes": lambda calls: "\n".join(f"<tool_call>\n{_json_call(c)}\n</tool_call>" for c in calls),
    "llama3_json": lambda calls: "<|python_tag|>" + "; ".join(_json_call(c, "parameters") for c in calls),
    "mistral": lambda calls: "[TOOL_CALLS][" + ", ".join(_json_call(c) for c in calls) + "]" if len(calls) == 2
    else "".join(f"[TOOL_CALLS]{n}[ARGS]{json.dumps(a)}" for n, a in calls),  # v3 for two calls, else v11
    "qwen3_coder": lambda calls: "".join(
        f"<tool_call>\n<function={n}>\n"
        + "".join(f"<parameter={k}>\n{_qwen_value(v)}\n</parameter>\n" for k, v in a.items())
        + "</function>\n</tool_call>" for n, a in calls),
    "pythonic": lambda calls: "[" + ", ".join(f"{n}({', '.join(f'{k}={v!r}' for k, v in a.items())})"
                                              for n, a in calls) + "]",
}
GENERATED_CALL = {"hermes": JSON_CALL, "llama3_json": JSON_CALL, "mistral": JSON_CALL, "qwen3_coder": QWEN_CALL,
                  "pythonic": PY_CALL}


@pytest.mark.parametrize("family", RENDER)
@given(data=st.data())
@settings(max_examples=60)
def test_generated_mixes_streamed_anyhow(family, data):
    """Text and blocks of calls in any order, any chunking: the calls come out with their
    arguments, the content is the text outside them (bar the whitespace that joins blocks to
    the text), and a stream reads what a whole parse reads."""
    pieces = data.draw(st.lists(TEXT | st.lists(GENERATED_CALL[family], min_size=1, max_size=3), max_size=4))
    text = "".join(p if isinstance(p, str) else RENDER[family](p) for p in pieces)
    want_calls = [c for p in pieces if not isinstance(p, str) for c in p]
    content, calls = whole(family, text)
    assert [(n, json.loads(a)) for n, a in calls] == [(n, _as_json(a)) for n, a in want_calls]
    assert "".join(content.split()) == "".join(p for p in pieces if isinstance(p, str)).replace(" ", "").replace(
        "\n", "")
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=10))
    assert collect(streamed(family, text, cuts)) == (content, calls)


def _as_json(value):
    """What JSON makes of a value (tuples are lists)."""
    return json.loads(json.dumps(value))


GARBAGE = {
    "hermes": ["<tool_call>", "</tool_call>", '{"name": "f"', '"arguments"', "{", "}"],
    "llama3_json": ["<|python_tag|>", '{"name": "f"', '"parameters"', "{", "}", ";"],
    "mistral": ["[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "f", "[", "]", "{", "}", '{"name": "f"', '"arguments"'],
    "qwen3_coder": ["<tool_call>", "</tool_call>", "<function=f>", "<function=", "</function>", "<parameter=days>",
                    "<parameter=", "</parameter>", ">"],
    "pythonic": ["[", "]", "f(", "a=", "1", "'", '"', "(", ")", "{", "}", "#"],
}


@pytest.mark.parametrize("family", GARBAGE)
@given(data=st.data())
@settings(max_examples=100)
def test_garbage_never_crashes(family, data):
    """Any jumble of a format's pieces: no exception, and every call read whole has JSON
    object arguments (what Anthropic's tool_use input needs)."""
    pieces = st.sampled_from(GARBAGE[family] + [" ", "\n", "x", ",", ":", '"', "1"])
    text = "".join(data.draw(st.lists(pieces, max_size=30)))
    collect(streamed(family, text, data.draw(st.lists(st.integers(0, len(text)), max_size=6))))
    _, calls = whole(family, text)
    assert all(isinstance(json.loads(args), dict) for _, args in calls)


# -- choosing the family, and the rest of the registry -----------------------------------------

TEMPLATES = {  # pieces of each family's real chat template
    "qwen3_coder": '{{- "\\n\\nIf you choose to call a function ONLY reply in the following format with NO suffix:'
                   '\\n\\n<tool_call>\\n<function=example_function_name>\\n<parameter=example_parameter_1>\\nvalue_1'
                   '\\n</parameter>\\n</function>\\n</tool_call>" }}',
    "mistral": '{%- if message.tool_calls is defined %}{{- "[TOOL_CALLS] [" }}{%- for tool_call in tool_calls %}',
    "mistral v11": '{{- "[TOOL_CALLS]" + tool.function.name + "[ARGS]" + tool.function.arguments|tojson }}',
    "pythonic": '{{- "You have access to the following functions. To call functions, please respond with a python '
                'list of the calls. " }}{{- \'Respond in the format [func_name1(params_name1=params_value1, '
                'params_name2=params_value2...), func_name2(params)] \' }}',
    "llama3_json": '{{- \'Respond in the format {"name": function name, "parameters": dictionary of argument name '
                   'and its value}.\' }}{{- "Do not use variables.\\n\\n" }}',
    "llama3_json python tag": '{%- if builtin_tools is defined and tool_call.name in builtin_tools %}'
                              '{{- "<|python_tag|>" + tool_call.name + ".call(" }}',
    "hermes": '{{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments '
              'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, '
              '\\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}',
    "none": "{% for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
            "{% endfor %}",
}


@pytest.mark.parametrize("which", TEMPLATES)
def test_choose_from_the_chat_template(which):
    want = "hermes" if which == "none" else which.split()[0]
    assert parsers.choose(TEMPLATES[which]) == want
    assert parsers.choose(None) == "hermes"


def test_the_request_tools_reach_the_parser():
    """qwen3_coder types its values from the request's tools, streamed and whole."""
    text = "<tool_call>\n<function=get_weather>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
    assert collect(parse_sample(text, None, "qwen3_coder", TOOLS)) == ("", [["get_weather", '{"days": 3}']])
    assert collect(parse_sample(text, None, "qwen3_coder")) == ("", [["get_weather", '{"days": "3"}']])
    parser = SampleParser(None, "qwen3_coder", TOOLS)
    assert collect(parser.feed(text) + parser.feed("", final=True)) == ("", [["get_weather", '{"days": 3}']])
    assert parser.num_calls == 1


def test_markers_as_special_tokens_are_noticed():
    """Mistral's [TOOL_CALLS] is a special token: output parsed for calls must keep it."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import models
    backend = RustTokenizer(models.WordLevel({"a": 0}, unk_token="a"))
    assert not parsers.markers_are_special(SimpleNamespace(backend=backend))
    backend.add_special_tokens(["[TOOL_CALLS]"])
    assert parsers.markers_are_special(SimpleNamespace(backend=backend))


def test_every_family_is_named():
    assert set(parsers.NAMES) == {"hermes", "llama3_json", "mistral", "qwen3_coder", "pythonic"}
    assert parsers.FORCED in parsers.NAMES
