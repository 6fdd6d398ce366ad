"""One sample's text as events (frontend.output_events), streamed or whole: the reasoning
parser first (thinking comes before the answer), then the tool-call parser over the answer.
Harmony (gpt-oss) is one parser of both, over the sample's tokens (frontend/harmony/parser.py).
Chat completions, Anthropic messages and Responses all read a sample through this."""

from __future__ import annotations

from frontend.harmony import parser as harmony_parser
from frontend.output_events import Content, Event
from frontend.reasoning import parsers as reasoning_parsers
from frontend.tool_calls import parsers as tool_parsers


class SampleParser:
    """`reasoning` and `tools` name the parsers; None: that part is not looked for. `functions`
    are the request's tools (frontend.tool_calls.tools.Tool), which some tool parsers read.
    `harmony`: the model's harmony encoding where it speaks harmony: then harmony reads the
    output, and the names only say whether reasoning and calls are split out."""

    def __init__(self, reasoning: str | None = None, tools: str | None = None, functions: tuple = (),
                 harmony=None) -> None:
        self.harmony = None
        if harmony is not None:
            self.harmony = harmony_parser.HarmonyParser(harmony, reasoning is not None, tools is not None)
            reasoning = tools = None
        self.reasoning = None if reasoning is None else reasoning_parsers.make_parser(reasoning)
        self.tools = None if tools is None else tool_parsers.make_parser(tools, functions)

    @property
    def num_calls(self) -> int:
        if self.harmony is not None:
            return self.harmony.num_calls
        return 0 if self.tools is None else self.tools.num_calls

    def feed(self, text: str, final: bool = False, token_ids=()) -> list[Event]:
        """The events the next piece of text (and its tokens: harmony reads those) makes
        certain; `final`: the text has ended."""
        if self.harmony is not None:
            return self.harmony.feed(token_ids) + (self.harmony.finish() if final else [])
        if self.reasoning is None:
            events: list[Event] = [Content(text)] if text else []
        else:
            events = (self.reasoning.feed(text) if text else []) + (self.reasoning.finish() if final else [])
        if self.tools is None:
            return events
        out: list[Event] = []
        for e in events:
            out += self.tools.feed(e.text) if isinstance(e, Content) else [e]
        return out + (self.tools.finish() if final else [])


def parse_sample(text: str, reasoning: str | None = None, tools: str | None = None,
                 functions: tuple = (), harmony=None, token_ids=()) -> list[Event]:
    """A whole sample's events; a tool call cut off or malformed anywhere is Content (a whole
    answer has nothing sent already that it could not take back, unlike a stream)."""
    if harmony is not None:
        return harmony_parser.parse(harmony, token_ids, reasoning is not None, tools is not None)
    events = SampleParser(reasoning).feed(text, final=True)
    if tools is None:
        return events
    answer = "".join(e.text for e in events if isinstance(e, Content))
    return [e for e in events if not isinstance(e, Content)] + tool_parsers.parse(tools, answer, functions)
