"""The grammar library behind structured output, as a small interface.

    backend.validate(params)         no tokenizer: is the schema/regex/grammar usable? (frontend)
    backend.compile(params)   ──►  CompiledGrammar   (engine, in a worker thread; cached)
    compiled.matcher()        ──►  GrammarMatcher    (one per sample, all sharing the compile)
    matcher.fill_bitmask / accept / rollback / is_terminated   (engine, every step)
    matcher.dead_end()               can the vocabulary write on from here? (checks, never per step)

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

    @abstractmethod
    def allowed_tokens(self) -> list[int]:
        """The tokens the mask allows next, ascending. Slow (a whole mask): for checks, not for
        every step. A matcher whose grammar finds no token to go on with enters its error state."""

    @abstractmethod
    def accepts(self, token_id: int) -> bool:
        """Whether `accept(token_id)` would succeed; the matcher stays where it is."""

    def dead_end(self) -> bool:
        """Whether no token can take the grammar on from here: its mask allows none, or only
        tokens it refuses. That is a grammar needing bytes no token of the vocabulary holds
        (llguidance masks such forced bytes by the nearest tokens it has, then refuses them)."""
        allowed = self.allowed_tokens()  # first: finding no way on sets the error
        return bool(self.error()) or not any(map(self.accepts, allowed))


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
