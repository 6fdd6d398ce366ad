"""The engine's side of structured output: compiles grammars off the step loop, caches them,
and keeps each constrained sample's matcher.

    add_request ──► submit(params) ──► Future[CompiledGrammar]   (worker thread, cached by key)
                       request waits in WAITING_FOR_GRAMMAR until the future is done
    schedule    ──► ready / failed ──► StructuredRequest.matcher  (one per sample)
    sample      ──► matcher.fill_bitmask (sampler)    update ──► matcher.accept

A constraint with starts_after (the end of the model's reasoning: `</think>`) gets its matcher
only after those tokens; until then its sample runs free (StructuredRequest).

The grammar library and its tokenizer load on the first constrained request (about 0.4 s
for a 49k vocabulary), in the worker, so servers that never constrain never pay for it.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from common.errors import InvalidRequest
from common.structured_output import get_backend_class
from common.structured_output.backend import CompiledGrammar, GrammarBackend, GrammarMatcher
from common.structured_output.params import StructuredOutputsParams

log = logging.getLogger("pagedserve.engine")
CACHE_SIZE = 512  # compiled grammars kept; a matcher is copied from one per sample


@dataclass(eq=False)
class StructuredRequest:
    """One sample's constraint: the shared compile, then its own matcher once that is ready and
    the grammar has begun.

    With params.starts_after (the end of the model's reasoning) the grammar begins after those
    tokens: until the prompt and output so far end with them the sample is `waiting`, with no
    matcher, so the sampler leaves its rows free (engine/sampler.py masks only rows with one).
    The scheduler `watch`es each token it appends while waiting; the matcher starts after the
    last token of starts_after, which it never sees. A preempted request keeps this state, as
    it keeps its outputs."""

    params: StructuredOutputsParams
    grammar: Future
    matcher: GrammarMatcher | None = None
    waiting: bool = False

    def start(self, prompt: list[int]) -> None:
        """Raises what the compile raised. The grammar begins at the first output token unless
        it waits for starts_after, which the prompt may already end with (a template that
        closed the reasoning itself)."""
        compiled = self.grammar.result()
        self.waiting = not _ends_with(prompt, self.params.starts_after)
        if not self.waiting:
            self.matcher = compiled.matcher()

    def watch(self, token_ids: list[int]) -> None:
        """While waiting, after each token: the grammar begins if the tokens so far end with
        starts_after."""
        if _ends_with(token_ids, self.params.starts_after):
            self.waiting = False
            self.matcher = self.grammar.result().matcher()

    def drafts_before_start(self, token_ids: list[int], drafts: list[int]) -> list[int]:
        """While waiting: the speculative drafts before one that would end starts_after. A
        verification step samples all its rows before the scheduler sees any token, so rows
        after that draft would go free where the grammar should already hold."""
        last = self.params.starts_after[-1]
        for j, token in enumerate(drafts):
            if token == last and _ends_with(token_ids + drafts[:j + 1], self.params.starts_after):
                return drafts[:j]
        return drafts

    def fork(self) -> StructuredRequest:
        """A sibling sample's constraint: the same grammar, a fresh matcher or none yet, as
        this one's (siblings fork before any of them has a token)."""
        sibling = StructuredRequest(self.params, self.grammar, waiting=self.waiting)
        if not self.waiting:
            sibling.matcher = self.grammar.result().matcher()
        return sibling


def _ends_with(token_ids: list[int], suffix: tuple[int, ...]) -> bool:
    """Whether `token_ids` ends with `suffix`; any list ends with the empty one."""
    return not suffix or tuple(token_ids[-len(suffix):]) == suffix


class StructuredOutputManager:
    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...],
                 backend: str = "llguidance") -> None:
        self.backend_class = get_backend_class(backend)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        self._backend: Future | None = None
        self._make_backend = lambda: self.backend_class(tokenizer, vocab_size, eos_token_ids)
        self._cache: OrderedDict[str, Future] = OrderedDict()

    def request(self, params: StructuredOutputsParams) -> StructuredRequest:
        return StructuredRequest(params, self._compiled(params))

    def _compiled(self, params: StructuredOutputsParams) -> Future:
        future = self._cache.get(params.key)
        if future is not None:
            self._cache.move_to_end(params.key)
            return future
        if self._backend is None:
            self._backend = self._executor.submit(self._make_backend)
        future = self._executor.submit(self._compile, params)
        self._cache[params.key] = future
        if len(self._cache) > CACHE_SIZE:
            self._cache.popitem(last=False)
        return future

    def _compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        backend: GrammarBackend = self._backend.result()
        try:
            return backend.compile(params)
        except InvalidRequest:
            raise
        except Exception as e:  # noqa: BLE001 - the library failed on this grammar: the caller's to fix
            log.warning("grammar compile failed (%s): %s", params.kind, e)
            raise InvalidRequest(f"structured_outputs.{params.kind}: could not compile: {e}") from None

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
