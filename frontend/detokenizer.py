"""Incremental detokenization and stop-string matching, for the output processor (which
serves gRPC, HTTP and the offline `LLM`).

Decoding token by token breaks multi-byte characters and merges (a space may
belong to the next token), so each step decodes a small window of recent
tokens and emits only the text that is certain: never a trailing U+FFFD.
Stop strings are matched on the text; anything that could still be the start
of a stop string is held back until it is known not to be one.
"""

from __future__ import annotations

# Tokens kept before the read offset so that merges and spaces decode right.
_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)

    def add(self, token_ids: list[int]) -> str:
        """Append tokens and return the newly certain text (maybe empty)."""
        self.token_ids += token_ids
        return self._advance(final=False)

    def flush(self) -> str:
        """At the end of generation: whatever is left, even an incomplete character."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        prefix = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        text = self._decode(self.token_ids[self.prefix_offset:])
        if len(text) <= len(prefix) or (text.endswith("\ufffd") and not final):
            return ""  # nothing new, or an incomplete character waiting for its next byte
        self.prefix_offset = max(self.read_offset, len(self.token_ids) - _CONTEXT_TOKENS)
        self.read_offset = len(self.token_ids)
        return text[len(prefix):]

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)


class StopStringMatcher:
    """Finds the earliest stop string in streamed text, holding back possible starts of one."""

    def __init__(self, stops: list[str], include_stop_str_in_output: bool = False) -> None:
        self.stops = stops
        self.include = include_stop_str_in_output
        self.pending = ""  # text received but not yet released

    def add(self, delta: str) -> tuple[str, str | None]:
        """Returns (text safe to release, the stop string matched or None)."""
        buffer = self.pending + delta
        hits = [(buffer.find(s), s) for s in self.stops]
        hits = [(i, s) for i, s in hits if i >= 0]
        if hits:
            index, stop = min(hits, key=lambda h: (h[0], -len(h[1])))
            self.pending = ""
            return buffer[:index + (len(stop) if self.include else 0)], stop
        keep = self._possible_start(buffer)
        self.pending = buffer[len(buffer) - keep:]
        return buffer[:len(buffer) - keep], None

    def flush(self) -> str:
        text, self.pending = self.pending, ""
        return text

    def _possible_start(self, text: str) -> int:
        """Length of the longest suffix of `text` that begins some stop string."""
        longest = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(text)), longest, -1):
                if stop.startswith(text[-k:]):
                    longest = k
                    break
        return longest
