"""A sample's harmony output as events (frontend.output_events), token by token.

openai-harmony's StreamableParser reads the tokens; each message's channel and recipient say
what its text is:

    analysis                         Reasoning (reasoning_content, thinking, reasoning items)
    a recipient (to=functions.NAME)  a tool call: CallStart(NAME) once its header is read, then
                                     its text as CallArguments (the `<|constrain|>json` body)
    final, commentary without one    Content (commentary alone is a preamble the user may see)

The sample ends with `<|return|>` (an answer) or `<|call|>` (calls to make); both are stop
tokens of the model. Output that breaks the format (a random model's, or a cut-off header) is
Content from the message it broke in on, as the model wrote it: nothing is lost, nothing
raises. A request without tools has no calls: a message to a recipient is Content too.
"""

from __future__ import annotations

from openai_harmony import HarmonyEncoding, HarmonyError, Role, StreamableParser, StreamState

from frontend.output_events import CallArguments, CallStart, Content, Event, Reasoning
from frontend.tool_calls import arguments as call_arguments

REASONING_CHANNEL = "analysis"
FUNCTIONS = "functions."  # the namespace of the request's function tools
FINAL_HEADER = "<|channel|>final<|message|>"  # where the answer's text begins


def final_header(encoding: HarmonyEncoding) -> tuple[int, ...]:
    """The tokens after which a structured output's grammar applies: the answer's text."""
    return tuple(encoding.encode(FINAL_HEADER, allowed_special="all"))


class HarmonyParser:
    """One sample's tokens in (`feed`, then `finish`), events out. `reasoning`: analysis is
    Reasoning (else Content: --reasoning-parser none); `calls`: the request has tools."""

    def __init__(self, encoding: HarmonyEncoding, reasoning: bool = True, calls: bool = True) -> None:
        self.encoding = encoding
        self.reasoning = reasoning
        self.calls = calls
        self.parser = StreamableParser(encoding, Role.ASSISTANT, strict=False)
        self.num_calls = 0
        self._call: int | None = None  # the call the current message is, once announced
        self._unsent: list[int] = []  # tokens whose text went nowhere yet: a header being read
        self._broken = False  # the format broke: the rest is Content

    def feed(self, token_ids) -> list[Event]:
        out: list[Event] = []
        for token in token_ids:
            self._unsent.append(token)
            if not self._broken:
                self._step(token, out)
        return out + (self._unsent_as_text() if self._broken else [])

    def finish(self) -> list[Event]:
        """The sample has ended: a header cut off (or never begun) is Content, as written."""
        self._broken = True
        return self._unsent_as_text()

    def _step(self, token: int, out: list[Event]) -> None:
        parser = self.parser
        try:
            parser.process(token)
        except HarmonyError:
            self._broken = True
            return
        if parser.state == StreamState.HEADER:
            return
        self._unsent = []
        if parser.state == StreamState.EXPECT_START:
            self._call = None  # the message ended
            return
        delta = parser.last_content_delta or ""
        recipient = parser.current_recipient
        if recipient and self.calls:
            if self._call is None:
                self._call = self.num_calls
                self.num_calls += 1
                out.append(CallStart(self._call, recipient.removeprefix(FUNCTIONS)))
            if delta:
                out.append(CallArguments(self._call, delta))
        elif delta:
            reasoning = self.reasoning and parser.current_channel == REASONING_CHANNEL and not recipient
            out.append(Reasoning(delta) if reasoning else Content(delta))

    def _unsent_as_text(self) -> list[Event]:
        text, self._unsent = self.encoding.decode(self._unsent) if self._unsent else "", []
        return [Content(text)] if text else []


def parse(encoding: HarmonyEncoding, token_ids, reasoning: bool = True, calls: bool = True) -> list[Event]:
    """A whole sample's events. A call whose arguments are not a JSON object (cut off by
    max_tokens, or malformed) is Content, as written: a whole answer has sent nothing it could
    not take back."""
    parser = HarmonyParser(encoding, reasoning, calls)
    events = parser.feed(token_ids) + parser.finish()
    arguments: dict[int, str] = {}
    for e in events:
        if isinstance(e, CallArguments):
            arguments[e.index] = arguments.get(e.index, "") + e.text
    bad = {i for i in range(parser.num_calls) if not _is_object(arguments.get(i, "{}"))}
    out: list[Event] = []
    for e in events:
        if isinstance(e, CallStart) and e.index in bad:
            out.append(Content(arguments.get(e.index, "")))
        elif not (isinstance(e, CallArguments) and e.index in bad):
            out.append(e)
    return _renumbered(out)


def _is_object(text: str) -> bool:
    try:
        return isinstance(call_arguments.loads(text), dict)
    except ValueError:
        return False


def _renumbered(events: list[Event]) -> list[Event]:
    """Calls numbered 0, 1, ... again after some became Content; an empty call's arguments "{}"."""
    numbers: dict[int, int] = {}
    out: list[Event] = []
    for e in events:
        if isinstance(e, CallStart):
            numbers[e.index] = len(numbers)
            out.append(CallStart(numbers[e.index], e.name))
        elif isinstance(e, CallArguments):
            out.append(CallArguments(numbers[e.index], e.text))
        else:
            out.append(e)
    for new in numbers.values():
        if not any(isinstance(e, CallArguments) and e.index == new for e in out):
            at = next(i for i, e in enumerate(out) if isinstance(e, CallStart) and e.index == new)
            out.insert(at + 1, CallArguments(new, "{}"))
    return out
