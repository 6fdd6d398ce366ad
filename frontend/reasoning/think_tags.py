"""`<think>reasoning</think>answer`, streamed: the tag pair Qwen3 and DeepSeek-R1 write.

    qwen3        the reasoning is what an opening `<think>` starts (leading whitespace
                 allowed); an answer that does not open with it is all content (enable_thinking
                 false, or a model that did not think)
    deepseek_r1  the prompt opened `<think>`: the text is reasoning from its first character
                 (a `<think>` the model writes anyway is dropped) until `</think>`

Either way the reasoning ends at the first `</think>`; one never closed (a reply cut off by
max_tokens) is all reasoning, with no content. Both rules are decided by a prefix of the text,
so a stream and a whole text split the same.

Newlines right around the tags are dropped: those after `<think>` and before `</think>` (the
reasoning's own ends) and those after `</think>` (the answer's start). vLLM keeps them; Qwen3's
template strips the same ones when it writes a reasoning_content back into a prompt. Only a
possible partial `</think>` and the newlines before it are held back while streaming (and, at
the start, whitespace and a possible partial `<think>`).
"""

from __future__ import annotations

from frontend.output_events import Content, Reasoning

OPEN, CLOSE = "<think>", "</think>"
_START, _REASONING, _CONTENT = range(3)


class ThinkTags:
    """One sample's text -> Reasoning and Content events. `opened`: the prompt opened `<think>`."""

    opened = False
    end = CLOSE  # what ends the reasoning (a structured output's grammar starts after it)

    def __init__(self) -> None:
        self.state = _START
        self.held = ""  # text not yet sent: it may still turn out to be (part of) a tag
        self.fresh = True  # at the start of the reasoning or content: its leading newlines go

    def feed(self, text: str) -> list[Reasoning | Content]:
        self.held += text
        return self._drain(final=False)

    def finish(self) -> list[Reasoning | Content]:
        return self._drain(final=True)

    def _drain(self, final: bool) -> list[Reasoning | Content]:
        out: list[Reasoning | Content] = []
        while True:
            if self.state == _START:
                head = self.held.lstrip()
                if head.startswith(OPEN):
                    self.held, self.state = head[len(OPEN):], _REASONING
                    continue
                if OPEN.startswith(head) and not final:
                    return out  # whitespace, or a `<think>` still coming
                # No `<think>`: no tag was dropped, so the text stays as written (fresh: False).
                self.state, self.fresh = (_REASONING, True) if self.opened else (_CONTENT, False)
            if self.fresh:
                self.held = self.held.lstrip("\n")
                if not self.held:
                    return out
                self.fresh = False
            if self.state == _CONTENT:
                if self.held:
                    out.append(Content(self.held))
                self.held = ""
                return out
            end = self.held.find(CLOSE)
            if end >= 0:
                _add_reasoning(out, self.held[:end].rstrip("\n"))
                self.held, self.state, self.fresh = self.held[end + len(CLOSE):], _CONTENT, True
                continue
            keep = 0 if final else _partial_close(self.held)
            _add_reasoning(out, self.held[:len(self.held) - keep])
            self.held = self.held[len(self.held) - keep:]
            return out


class Qwen3(ThinkTags):
    """Thinking only where the answer opens with `<think>`."""


class DeepSeekR1(ThinkTags):
    """The prompt opened `<think>`: thinking from the first character."""

    opened = True


def _add_reasoning(out: list[Reasoning | Content], text: str) -> None:
    if text:
        out.append(Reasoning(text))


def _partial_close(text: str) -> int:
    """How many trailing characters could still become `</think>`: a proper prefix of it at
    the end, and the newlines before that (dropped if the tag does come)."""
    k = next(k for k in range(min(len(CLOSE) - 1, len(text)), -1, -1) if text.endswith(CLOSE[:k]))
    rest = text[:len(text) - k]
    return k + len(rest) - len(rest.rstrip("\n"))
