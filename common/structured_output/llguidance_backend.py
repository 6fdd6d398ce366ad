"""llguidance (github.com/guidance-ai/llguidance) behind the GrammarBackend interface.

Its "compile" is an `LLMatcher` at the grammar's start; each sample gets a `deep_copy`. The
library never raises for grammar errors: a matcher enters an error state instead, which we
turn into InvalidRequest (compile) or a failed request (a rejected token). It compiles a
grammar the vocabulary cannot write (a character whose bytes no token holds) without a word;
the engine finds that out (GrammarMatcher.dead_end).
"""

from __future__ import annotations

import json
import re

import llguidance
import numpy as np

from common.errors import InvalidRequest
from common.structured_output.backend import CompiledGrammar, GrammarBackend, GrammarMatcher
from common.structured_output.params import StructuredOutputsParams

# Compact JSON: no free whitespace between tokens, so a model can't stall a JSON document on
# endless spaces or newlines (vLLM's `disable_any_whitespace`, on by default here).
JSON_OPTIONS = {"whitespace_flexible": False}


def _without_padding(tokenizer_json: str) -> str:
    """tokenizer.json with no padding or truncation, as llguidance.hf.from_tokenizer hands it
    over (save_pretrained writes the tokenizer's own; a generative model's are null)."""
    head = tokenizer_json[:256]
    if re.search(r'"truncation":\s*null', head) and re.search(r'"padding":\s*null', head):
        return tokenizer_json
    data = json.loads(tokenizer_json)
    data["truncation"] = data["padding"] = None
    return json.dumps(data)


def grammar_text(params: StructuredOutputsParams) -> str:
    """The constraint in llguidance's grammar format."""
    kind = params.kind
    if kind == "json":
        return llguidance.LLMatcher.grammar_from_json_schema(params.json, defaults=JSON_OPTIONS)
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(params.regex)
    if kind == "choice":  # Lark string literals take JSON's escapes
        alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in params.choice)
        return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}")
    return llguidance.LLMatcher.grammar_from_lark(params.grammar)


class LLGuidanceMatcher(GrammarMatcher):
    __slots__ = ("matcher",)

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher

    def accept(self, token_id: int) -> bool:
        return self.matcher.consume_token(token_id)

    def fill_bitmask(self, bitmask, row: int) -> None:
        from llguidance.torch import fill_next_token_bitmask  # imports torch: engine side only
        fill_next_token_bitmask(self.matcher, bitmask, row)

    def rollback(self, num_tokens: int) -> None:
        self.matcher.rollback(num_tokens)

    def is_terminated(self) -> bool:
        return self.matcher.is_stopped()

    def error(self) -> str:
        return self.matcher.get_error()

    def allowed_tokens(self) -> list[int]:
        mask = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        return np.flatnonzero(np.unpackbits(mask, bitorder="little")).tolist()

    def accepts(self, token_id: int) -> bool:
        return self.matcher.validate_tokens([token_id]) == 1


class LLGuidanceGrammar(CompiledGrammar):
    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.start = matcher

    def matcher(self) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(self.start.deep_copy())


class LLGuidanceBackend(GrammarBackend):
    name = "llguidance"

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...],
                 tokenizer_json: str | None = None) -> None:
        """`tokenizer`: the model's Hugging Face fast tokenizer; `vocab_size`: the LM head's
        rows. Rows past the tokenizer's own tokens (padding) are never allowed.
        `tokenizer_json`: its tokenizer.json as save_pretrained wrote it, if at hand: the
        library then reads that instead of the tokenizer serializing itself, which holds the
        GIL for about a second on a 200k vocabulary (and starves the engine's I/O thread)."""
        import llguidance.hf
        eos = list(eos_token_ids) or None
        if tokenizer_json is None:
            self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)
        else:
            self.tokenizer = llguidance.LLTokenizer(_without_padding(tokenizer_json), n_vocab=vocab_size,
                                                    eos_token=eos if eos is not None else tokenizer.eos_token_id)

    @staticmethod
    def validate(params: StructuredOutputsParams) -> None:
        error = llguidance.LLMatcher.validate_grammar(_grammar_or_raise(params))
        if error:
            raise InvalidRequest(f"structured_outputs.{params.kind}: {_first_lines(error)}")

    def compile(self, params: StructuredOutputsParams) -> LLGuidanceGrammar:
        matcher = llguidance.LLMatcher(self.tokenizer, _grammar_or_raise(params), log_level=0)
        if matcher.is_error():
            raise InvalidRequest(f"structured_outputs.{params.kind}: {_first_lines(matcher.get_error())}")
        return LLGuidanceGrammar(matcher)


def _grammar_or_raise(params: StructuredOutputsParams) -> str:
    try:
        return grammar_text(params)
    except ValueError as e:
        raise InvalidRequest(f"structured_outputs.{params.kind}: {e}") from None


def _first_lines(message: str, limit: int = 600) -> str:
    """llguidance's messages can quote a whole grammar; a caller needs the start."""
    message = message.strip()
    return message if len(message) <= limit else message[:limit] + " ..."
