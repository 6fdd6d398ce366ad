"""Where a gated grammar begins: the end of the model's reasoning (StructuredOutputsParams.
starts_after, the frontend's tokens of `</think>`), found in the text however it is tokenized.

A model may write the tag in other tokens than the frontend's encoding of it: " </think>" is
"Ġ</" "think" ">" in SmolLM2's vocabulary where `</think>` alone is "</" "think" ">", and a
model that copies a prompt writes "<" "/" "think" ">" if the prompt does. The reasoning parser
reads text and ends the reasoning at any of them, so the gate reads text too: the grammar
begins after the token that completes the tag's text (and its answer after the rest of that
token's text, which the parser takes as content).

The check is cheap where it runs, after each token while a sample reasons: a token whose text
holds no character the tag could end with (most tokens) costs a dict lookup; the others decode
the few last tokens the tag can span.
"""

from __future__ import annotations

from collections.abc import Sequence


class Marker:
    """`token_ids` and their text; shared by every request with the same starts_after."""

    def __init__(self, tokenizer, token_ids: tuple[int, ...]) -> None:
        self.token_ids = token_ids
        self._tokenizer = tokenizer
        self.text = self._decode(token_ids)
        # The most tokens the tag can span: each holds a byte of it.
        self.num_window = len(self.text.encode())
        # The tag's last token holds its last character, or, split into byte tokens, the
        # character's last byte (which decodes alone as U+FFFD).
        self._ends = {self.text[-1:]} | ({"\ufffd"} if len(self.text[-1:].encode()) > 1 else set())
        self._may_end: dict[int, bool] = {}  # token -> whether it can be the tag's last

    def ends(self, token_ids: Sequence[int]) -> bool:
        """Whether the last of `token_ids` completes the tag: its own tokens, or its text."""
        if _ends_with(token_ids, self.token_ids):
            return True
        if not self.text or not token_ids or not self._may_be_last(token_ids[-1]):
            return False
        window = list(token_ids[-self.num_window:])
        # Counted, not found: an earlier tag in the window (the prompt's) is in both.
        return self._decode(window).count(self.text) > self._decode(window[:-1]).count(self.text)

    def _may_be_last(self, token_id: int) -> bool:
        may = self._may_end.get(token_id)
        if may is None:  # once per token id: a vocabulary's worth at most
            text = self._decode((token_id,))
            may = self._may_end[token_id] = any(c in text for c in self._ends)
        return may

    def _decode(self, token_ids: Sequence[int]) -> str:
        # Special tokens too: the tag may be one.
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=False)


def _ends_with(token_ids: Sequence[int], suffix: tuple[int, ...]) -> bool:
    """Whether `token_ids` ends with `suffix`; any list ends with the empty one."""
    return not suffix or tuple(token_ids[-len(suffix):]) == suffix
