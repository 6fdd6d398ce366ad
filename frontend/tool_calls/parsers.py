"""The tool-call parsers, one per model family's output format, by name (`--tool-call-parser`):

    hermes       <tool_call>{"name": ..., "arguments": {...}}</tool_call>       Hermes 2 Pro, Qwen2.5/3, ...
    llama3_json  {"name": ..., "parameters": {...}}, maybe after <|python_tag|>  Llama 3.1/3.2/3.3
    mistral      [TOOL_CALLS][{...}] (v3) or [TOOL_CALLS]name[ARGS]{...} (v11+)  Mistral, Magistral, Devstral
    qwen3_coder  <tool_call><function=NAME><parameter=KEY>VALUE</parameter>...    Qwen3-Coder
    pythonic     [get_weather(city="Paris"), get_time()]                         Llama 3.2/4 pythonic, ToolACE

Each parser takes one sample's text piece by piece (`feed`), then `finish()`, and returns
frontend.output_events; `num_calls` counts the calls announced so far. `parse(name, text)`
reads a whole text, where a malformed or cut-off call is always plain content. `tools` are the
request's (frontend.tool_calls.tools.Tool): qwen3_coder reads its parameters' types from them.
"""

from __future__ import annotations

from typing import Protocol

from frontend.output_events import Event
from frontend.tool_calls import hermes, llama3_json, mistral, pythonic, qwen3_coder

# The format our grammar writes when it forces calls (tool_choice required or named).
FORCED = "hermes"


class ToolParser(Protocol):
    num_calls: int

    def feed(self, text: str) -> list[Event]: ...

    def finish(self) -> list[Event]: ...


_PARSERS = {
    "hermes": hermes.HermesParser,
    "llama3_json": llama3_json.Llama3JsonParser,
    "mistral": mistral.MistralParser,
    "qwen3_coder": qwen3_coder.Qwen3CoderParser,
    "pythonic": pythonic.PythonicParser,
}
NAMES = tuple(_PARSERS)

# What each family's chat template says, most specific first (Qwen3-Coder's template also
# shows <tool_call>; Llama's pythonic templates are Llama templates too).
_TEMPLATE_SIGNS = (
    ("qwen3_coder", ("<function=", "<parameter=")),
    ("mistral", ("[TOOL_CALLS]",)),
    ("pythonic", ("[func_name1(",)),  # 'Respond in the format [func_name1(params_name1=params_value1, ...'
    ("llama3_json", ("<|python_tag|>",)),
    ("llama3_json", ('"parameters": dictionary of argument name',)),  # 'Respond in the format {"name": ...'
)

# The special tokens a family's parser must see in the output (a decode that skips special
# tokens would drop them).
MARKERS = (hermes.OPEN, hermes.CLOSE, mistral.TOOL_CALLS, mistral.ARGS, mistral.CALL_ID)


def make_parser(name: str, tools: tuple = ()) -> ToolParser:
    return _PARSERS[name](tools)


def parse(name: str, text: str, tools: tuple = ()) -> list[Event]:
    return _PARSERS[name].parse(text, tools)


def choose(chat_template: str | None) -> str:
    """The parser for a model whose chat template is this: the format its template teaches
    (the signs above); Hermes when none shows."""
    for name, signs in _TEMPLATE_SIGNS:
        if chat_template and all(sign in chat_template for sign in signs):
            return name
    return "hermes"


def markers_are_special(tokenizer) -> bool:
    """Does the tokenizer hold a parser's marker as a special token (Hermes 2 Pro's
    <tool_call>, Mistral's [TOOL_CALLS])? Then requests whose output is parsed for calls must
    keep special tokens."""
    return hermes.tags_are_special(tokenizer, MARKERS)
