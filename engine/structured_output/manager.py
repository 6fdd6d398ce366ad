"""The engine's side of structured output: compiles grammars off the step loop, caches them,
and keeps each constrained sample's matcher.

    add_request ──► submit(params) ──► Future[CompiledGrammar]   (worker thread, cached by key)
                       request waits in WAITING_FOR_GRAMMAR until the future is done
    schedule    ──► ready / failed ──► StructuredRequest.matcher  (one per sample)
    sample      ──► matcher.fill_bitmask (sampler)    update ──► matcher.accept

A constraint with starts_after (the end of the model's reasoning: `</think>`) gets its matcher
only after those tokens, or their text in other tokens (marker.py); until then its sample runs
free (StructuredRequest).

A grammar the vocabulary cannot write (it needs a character whose bytes no token holds) is the
caller's to fix, as one that does not compile: refused when it compiles if its start is a dead
end, else its request ends "invalid" where the matcher finds out (`StructuredRequest.failure`).

The grammar library's tokenizer is built from the tokenizer.json in one call that holds the
GIL throughout: 1.7 s for gpt-oss's 201k vocabulary, 0.4 s for 49k. Offline it is built on the
first constrained request, in the worker, so a run that never constrains never pays for it. A
served engine builds it at start (`prepare`), before its sockets: built later, that stretch
kept its I/O thread from answering heartbeats, and a frontend under load dropped the engine
(stop 56's open bug). It hands over the tokenizer.json it already wrote for its frontends
(`tokenizer_json`), which spares serializing the tokenizer again (another second of GIL).
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
from engine.structured_output.marker import Marker

log = logging.getLogger("pagedserve.engine")
CACHE_SIZE = 512  # compiled grammars kept; a matcher is copied from one per sample
MARKER_CACHE_SIZE = 16  # markers kept (one per reasoning parser's tag, in practice)


@dataclass(eq=False)
class StructuredRequest:
    """One sample's constraint: the shared compile, then its own matcher once that is ready and
    the grammar has begun.

    With params.starts_after (the end of the model's reasoning) the grammar begins after those
    tokens: until the prompt and output so far end with them, or with their text in other
    tokens, the sample is `waiting`, with no matcher, so the sampler leaves its rows free
    (engine/sampler.py masks only rows with one). The scheduler `watch`es each token it appends
    while waiting; the matcher starts after the token that completes the marker, which it never
    sees. A preempted request keeps this state, as it keeps its outputs."""

    params: StructuredOutputsParams
    grammar: Future
    marker: Marker | None = None  # params.starts_after's; None: it is empty
    matcher: GrammarMatcher | None = None
    waiting: bool = False
    begins_at: int = 0  # tokens (prompt and output) before the grammar's first

    def start(self, prompt: list[int]) -> None:
        """Raises what the compile raised. The grammar begins at the first output token unless
        it waits for starts_after, which the prompt may already end with (a template that
        closed the reasoning itself)."""
        compiled = self.grammar.result()
        self.waiting = self.marker is not None and not self.marker.ends(prompt)
        if not self.waiting:
            self.matcher = compiled.matcher()
            self.begins_at = len(prompt)

    def watch(self, token_ids: list[int]) -> None:
        """While waiting, after each token: the grammar begins if the tokens so far end with
        starts_after, or with its text."""
        if self.marker.ends(token_ids):
            self.waiting = False
            self.matcher = self.grammar.result().matcher()
            self.begins_at = len(token_ids)

    def failure(self, token_ids: list[int]) -> str | None:
        """After the matcher refused the last of `token_ids` or ended in its error state: the
        InvalidRequest message if the grammar is at fault, the vocabulary unable to write it
        there (its mask allowed that token or no way on: see GrammarMatcher.dead_end); None if
        the engine is (it sampled a token the mask forbade). Replays a fresh matcher to where
        that token was sampled: slow, once for a request that ends."""
        matcher = self.grammar.result().matcher()
        if not all(map(matcher.accept, token_ids[self.begins_at:-1])):
            return None
        at_fault = token_ids[-1] in matcher.allowed_tokens() or matcher.dead_end()
        return unwritable(self.params, len(token_ids) - 1 - self.begins_at) if at_fault else None

    def drafts_before_start(self, token_ids: list[int], drafts: list[int]) -> list[int]:
        """While waiting: the speculative drafts before one that would end starts_after. A
        verification step samples all its rows before the scheduler sees any token, so rows
        after that draft would go free where the grammar should already hold."""
        tail = list(token_ids[-self.marker.num_window:])
        for j in range(len(drafts)):
            if self.marker.ends(tail + drafts[:j + 1]):
                return drafts[:j]
        return drafts

    def fork(self) -> StructuredRequest:
        """A sibling sample's constraint: the same grammar, a fresh matcher or none yet, as
        this one's (siblings fork before any of them has a token)."""
        sibling = StructuredRequest(self.params, self.grammar, self.marker, waiting=self.waiting,
                                    begins_at=self.begins_at)
        if not self.waiting:
            sibling.matcher = self.grammar.result().matcher()
        return sibling


def unwritable(params: StructuredOutputsParams, num_tokens: int) -> str:
    """Why a grammar the vocabulary cannot write on from its `num_tokens`th token is refused."""
    where = "at its start" if not num_tokens else f"{num_tokens} token{'s' * (num_tokens > 1)} into it"
    return (f"structured_outputs.{params.kind}: this model's vocabulary cannot write what the constraint "
            f"requires {where} (a character whose bytes no token holds); change or remove that part")


class StructuredOutputManager:
    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...],
                 backend: str = "llguidance") -> None:
        self.backend_class = get_backend_class(backend)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        self._backend: Future | None = None
        # The served engine's tokenizer.json (engine/main.py sets it): see LLGuidanceBackend.
        self.tokenizer_json: str | None = None
        self._make_backend = lambda: self.backend_class(tokenizer, vocab_size, eos_token_ids, self.tokenizer_json)
        self._cache: OrderedDict[str, Future] = OrderedDict()
        self._tokenizer = tokenizer
        self._markers: dict[tuple[int, ...], Marker] = {}

    def prepare(self) -> None:
        """Build the grammar library's tokenizer now, in this thread (see the top). A failure
        is kept for the constrained requests to report, as when it is built on demand."""
        if self._backend is not None:
            return
        self._backend = Future()
        try:
            self._backend.set_result(self._make_backend())
        except Exception as e:  # noqa: BLE001 - the library could not read this tokenizer
            log.warning("structured output: the grammar library cannot use this tokenizer: %s", e)
            self._backend.set_exception(e)

    def request(self, params: StructuredOutputsParams) -> StructuredRequest:
        return StructuredRequest(params, self._compiled(params), self._marker(params.starts_after))

    def _marker(self, token_ids: tuple[int, ...]) -> Marker | None:
        if not token_ids:
            return None
        marker = self._markers.get(token_ids)
        if marker is None:
            marker = self._markers[token_ids] = Marker(self._tokenizer, token_ids)
            if len(self._markers) > MARKER_CACHE_SIZE:
                del self._markers[next(iter(self._markers))]  # the oldest
        return marker

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
            compiled = backend.compile(params)
        except InvalidRequest:
            raise
        except Exception as e:  # noqa: BLE001 - the library failed on this grammar: the caller's to fix
            log.warning("grammar compile failed (%s): %s", params.kind, e)
            raise InvalidRequest(f"structured_outputs.{params.kind}: could not compile: {e}") from None
        if compiled.matcher().dead_end():  # one that dies later ends its request (failure)
            raise InvalidRequest(unwritable(params, 0))
        return compiled

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
