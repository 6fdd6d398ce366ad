"""Incremental detokenization and stop-string matching, for the output processor (which
serves gRPC, HTTP and the offline `LLM`).

Decoding token by token breaks multi-byte characters and merges (a space may belong to the
next token), so the new text is always decoded after a little context, the last tokens
whose text was released (at first the prompt's last characters), and only certain text is
emitted: never a trailing U+FFFD while more tokens may come. Fast tokenizers do this in Rust
with `tokenizers`' DecodeStream, one call per step; slow ones (and the clean-up of spaces some
WordPiece tokenizers apply to the whole text) decode the context with and without the
held-back tokens and take the difference, twice per step.
A prompt may end inside a character (a token-id prompt cut there, for the model to finish):
that character is the output's, as in vLLM. Its first tokens wait with the output's, so the
output's first text is the whole character, never a U+FFFD; whole characters merged into
those tokens (the space of byte-level BPE's "ĠðŁ", a space and an emoji's first 2 bytes)
stay the prompt's. If the output leaves it unfinished, its U+FFFD stays the prompt's too:
the deltas add up to the text of prompt and output minus the prompt's.
Stop strings are matched on the text; anything that could still be the start of a stop
string is held back until it is known not to be one.
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

from frontend.tokenizer import cleans_up_spaces

# Prompt tokens decoded before the first output token, so that its space and merges decode right.
_CONTEXT_TOKENS = 6
# UTF-8's longest character: a prompt that ends inside one ends with at most 3 of its bytes
# (so tokens), and a window that begins inside one begins with at most 3.
_MAX_CHAR_BYTES = 4
# Where a decode that is the backend's decode (and the clean-up) is defined: ours, transformers'.
_PLAIN_DECODE = ("frontend.tokenizer", "transformers.tokenization_utils_base",
                 "transformers.tokenization_utils_tokenizers")


class IncrementalDetokenizer:
    """Token ids in, certain text out: `add` returns the text the new tokens complete, `flush`
    at the end whatever is still held back. Both ways of decoding share one state, so a
    stream can fall back to the window mid-way (see `flush`)."""

    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._backend = _stream_backend(tokenizer)
        # context: decoded before `pending` and not released again; the prompt's last tokens
        # that end a character, then the last tokens released. pending: tokens whose text is
        # held back; at first those of a character the prompt ends inside.
        self.context, self.pending, context_text = self._split_prompt(prompt_token_ids)
        # The prompt's share of the pending tokens' text (" \ufffd"), dropped from the first text.
        self._prompt_text = ""
        if self.pending:
            self._prompt_text = self._decode(self.context + self.pending)[len(context_text):]
        self._stream: DecodeStream | None = None
        # Stray bytes that end no character (a run of more than _MAX_CHAR_BYTES): then the
        # context's text ends in a U+FFFD that is no prefix of the text to come, which
        # DecodeStream does not allow for; the window copes.
        if self._backend is not None and not context_text.endswith("\ufffd"):
            self._stream = DecodeStream(self.context, skip_special_tokens=skip_special_tokens)
            if self.pending:  # returns None: the text ends inside the character
                self._stream.step(self._backend, self.pending)

    def add(self, token_ids: list[int]) -> str:
        """Append tokens and return the newly certain text (maybe empty)."""
        self.pending += token_ids
        if self._stream is None:
            return self._release(self._diff(final=False))
        # One id, not a list of one: half the cost in the binding.
        ids = token_ids[0] if len(token_ids) == 1 else token_ids
        try:
            return self._release(self._stream.step(self._backend, ids))
        except Exception as e:  # tokenizers raises no narrower type
            if "Invalid prefix" not in str(e):
                raise
        # The text decoded so far changed (stray byte tokens): DecodeStream gives up there,
        # the window does not.
        self._stream = None
        return self._release(self._diff(final=False))

    def flush(self) -> str:
        """At the end of generation: whatever is left, even an incomplete character."""
        self._stream = None  # it still holds `pending`: any later tokens go through the window
        return self._release(self._diff(final=True))

    def _release(self, text: str | None) -> str:
        if not text:
            return ""
        # All of the released tokens, as DecodeStream keeps them: the last few alone may begin
        # inside a run of byte tokens, which byte fallback would then decode as U+FFFDs.
        self.context, self.pending = self.pending, []
        if self._prompt_text:
            text, self._prompt_text = _output_share(text, self._prompt_text), ""
        return text

    def _split_prompt(self, prompt: list[int]) -> tuple[list[int], list[int], str]:
        """(context, tail, the context's text): the prompt's last whole characters' tokens, and
        after them the tokens that begin a character the prompt ends inside (none if none)."""
        # Up to 4 tokens: one more than a character's start, for a stray byte before it.
        for num_tail in range(min(len(prompt), _MAX_CHAR_BYTES) + 1):
            end = len(prompt) - num_tail
            context, text = self._window(prompt, end)
            if not text.endswith("\ufffd"):
                return context, list(prompt[end:]), text
        context, text = self._window(prompt, len(prompt))
        return context, [], text

    def _window(self, token_ids: list[int], end: int) -> tuple[list[int], str]:
        """The _CONTEXT_TOKENS tokens before `end`, or a few more so as to begin with a whole
        character (decoded alone, one begun inside a run of byte tokens is all U+FFFDs with
        byte fallback, which would hide whether the window ends inside a character); and
        their text."""
        start = max(0, end - _CONTEXT_TOKENS)
        text = self._decode(token_ids[start:end])
        for _ in range(_MAX_CHAR_BYTES - 1):
            if start == 0 or not text.startswith("\ufffd"):
                break
            start -= 1
            text = self._decode(token_ids[start:end])
        return list(token_ids[start:end]), text

    def _diff(self, final: bool) -> str | None:
        """The window's way: the pending tokens' text after the context's, if certain."""
        prefix = self._decode(self.context)
        text = self._decode(self.context + self.pending)
        if len(text) <= len(prefix) or (text.endswith("\ufffd") and not final):
            return None  # nothing new, or an incomplete character waiting for its next byte
        return text[len(prefix):]

    def _decode(self, token_ids: list[int]) -> str:
        if self._backend is not None:
            return self._backend.decode(token_ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)


def _output_share(text: str, prompt_text: str) -> str:
    """The output's part of the first text released after a prompt that ends inside a
    character: the prompt's whole characters are not, and the character is if the output
    finished it; else its U+FFFDs are still the prompt's."""
    if text.startswith(prompt_text):
        return text[len(prompt_text):]
    return text[len(prompt_text.rstrip("\ufffd")):]


def _stream_backend(tokenizer):
    """The Rust tokenizer whose decode is all of `tokenizer.decode`, or None: slow tokenizers
    have none, a few (Whisper's, CodeGen's) decode their own way, and the clean-up of spaces
    works on the whole text, not on a stream."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    own_decode = any(getattr(getattr(type(tokenizer), name, None), "__module__", None) not in _PLAIN_DECODE
                     for name in ("decode", "_decode") if hasattr(type(tokenizer), name))
    if backend is None or own_decode or cleans_up_spaces(
            backend, getattr(tokenizer, "clean_up_tokenization_spaces", False)):
        return None
    return backend


class StopStringMatcher:
    """Finds the earliest stop string in streamed text, holding back possible starts of one."""

    def __init__(self, stops: list[str], include_stop_str_in_output: bool = False) -> None:
        self.stops = stops
        self.include = include_stop_str_in_output
        self.pending = ""  # text received but not yet released

    def add(self, delta: str) -> tuple[str, str | None]:
        """Returns (text safe to release, the stop string matched or None)."""
        if not self.stops:  # most requests: nothing is ever held back
            return delta, None
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
