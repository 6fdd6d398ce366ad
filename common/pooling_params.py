"""What a pooling request (embed, score) tells the engine beyond its tokens."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PoolingParams:
    """A request that pools its prompt into one vector instead of generating (task embed or
    score): it runs its whole prompt in one step and ends there, its KV blocks freed."""

    # A text pair for a cross-encoder: its second text starts at this token (BERT's token type
    # 1 from here on). 0: one text, every token of type 0.
    token_type_start: int = 0
