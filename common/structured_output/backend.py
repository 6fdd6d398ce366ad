"""The grammar library behind structured output, as a small interface.

    backend.validate(params)         no tokenizer: is the schema/regex/grammar usable? (frontend)
    backend.compile(params)   ──►  CompiledGrammar   (engine, in a worker thread; cached)
    compiled.matcher()        ──►  GrammarMatcher    (one per sample, all sharing the compile)
    matcher.fill_bitmask / accept / rollback / is_terminated   (engine, every step)

A bitmask is int32 [rows, ceil(vocab / 32)], bit t of a row set when token t is allowed: the
layout llguidance and xgrammar share, so the sampler applies either without knowing which.
Only `llguidance` is implemented (chosen by measurement: docs/api.md); a second library
adds one module with these three classes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from common.structured_output.params import StructuredOutputsParams


class GrammarMatcher(ABC):
    """One sample's position in its grammar."""

    @abstractmethod
    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False if the grammar forbids it (the matcher is then
        unusable and the request must end)."""

    @abstractmethod
    def fill_bitmask(self, bitmask, row: int) -> None:
        """Write the tokens allowed next into row `row` of `bitmask`."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Forget the last `num_tokens` accepted tokens (rejected speculative tokens)."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """The grammar is complete and admits nothing more, not even another token."""

    @abstractmethod
    def error(self) -> str:
        """Why the matcher failed, or ""."""


class CompiledGrammar(ABC):
    @abstractmethod
    def matcher(self) -> GrammarMatcher:
        """A fresh matcher at the grammar's start; cheap, and independent of every other."""


class GrammarBackend(ABC):
    name: str

    @staticmethod
    @abstractmethod
    def validate(params: StructuredOutputsParams) -> None:
        """Raise InvalidRequest naming the problem if the constraint can't be compiled."""

    @abstractmethod
    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """Build the grammar against the model's vocabulary; raises InvalidRequest. Slow
        (milliseconds to seconds): runs in a worker thread."""

    @staticmethod
    def bitmask_width(vocab_size: int) -> int:
        return (vocab_size + 31) // 32
