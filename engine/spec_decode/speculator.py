"""Which requests get drafts after each step, from which proposer, and when to stop trying.

After a step's update, every request that was scheduled, still runs and is decoding (all its
tokens computed but the one just sampled) may get up to k drafts for its next step:

    k_eff = min(num_speculative_tokens, max_tokens left - 1, max_model_len left - 1)

(the verification step emits up to k_eff + 1 tokens, which must fit both limits).

Back-off: drafts that are mostly rejected make a step slower than a plain decode (a k+1-token
verification costs more than one token, and a draft model costs its forwards too). Each
request keeps a moving average of its acceptance rate; when it falls below
MIN_ACCEPTANCE_RATE the request stops proposing for a pause, then tries once again. A failed
try doubles the pause (up to MAX_PAUSE_STEPS); a good one halves it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from engine.outputs import SchedulerOutput
from engine.request import Request, RequestStatus

# Break-even on this CPU: a 5-token verification of SmolLM2-135M costs about 1.3 decode steps
# (docs/engine.md), which 4 drafts accepted at ~0.3 each already pay for.
MIN_ACCEPTANCE_RATE = 0.3
SMOOTHING = 0.5  # weight of the latest step in the moving average
FIRST_PAUSE_STEPS = 4
MAX_PAUSE_STEPS = 64


class Proposer(Protocol):
    def propose(self, requests: list[Request], max_drafts: list[int], block_tables: list[list[int]],
                blocks_to_copy: Sequence[tuple[int, int]]) -> list[list[int]]:
        """Up to max_drafts[i] draft tokens after each request's last token ([] for none).
        `block_tables` and `blocks_to_copy` (this step's copy-on-write copies) are for a
        proposer with its own KV cache."""
        ...

    def release(self, request_ids: set[str]) -> None:
        """Forget state kept for requests that are gone."""
        ...


@dataclass(slots=True)
class _Backoff:
    acceptance: float = 1.0  # moving average of accepted / drafted; optimistic at first
    pause: int = 0  # length of the next pause, in steps
    skip: int = 0  # steps left without proposing


class Speculator:
    def __init__(self, proposer: Proposer, num_speculative_tokens: int, max_model_len: int,
                 vocab_limit: int) -> None:
        """`vocab_limit`: drafts at or past it (LM-head padding rows) are never proposed."""
        self.proposer = proposer
        self.k = num_speculative_tokens
        self.max_model_len = max_model_len
        self.vocab_limit = vocab_limit
        self._backoff: dict[str, _Backoff] = {}

    def after_step(self, sched: SchedulerOutput, requests: dict[str, Request]) -> None:
        """Learn from this step's verifications, then set each eligible request's drafts."""
        self._forget(requests)
        candidates, limits, tables = [], [], []
        for s in sched.scheduled:
            r = s.request
            state = self._backoff.setdefault(r.request_id, _Backoff())
            if s.spec_token_ids:
                self._observe(state, len(s.spec_token_ids), s.num_accepted_tokens)
            limit = self._limit(r)
            if limit <= 0:
                continue
            if state.skip > 0:
                state.skip -= 1
                continue
            candidates.append(r)
            limits.append(limit)
            tables.append(s.block_ids)
        if not candidates:
            return
        drafts = self.proposer.propose(candidates, limits, tables, sched.blocks_to_copy)
        for request, tokens in zip(candidates, drafts):
            request.spec_token_ids = self._in_vocab(tokens)

    def _limit(self, r: Request) -> int:
        """Most drafts this request may take in its next step; 0 when it should take none."""
        if (r.status != RequestStatus.RUNNING or r.sampling_params.disable_speculation or r.needs_fork
                or r.num_computed_tokens != r.num_tokens - 1):
            return 0
        limit = min(self.k, self.max_model_len - r.num_tokens - 1)
        if r.sampling_params.max_tokens is not None:
            limit = min(limit, r.sampling_params.max_tokens - r.num_output_tokens - 1)
        return limit

    def _in_vocab(self, tokens: list[int]) -> list[int]:
        for i, t in enumerate(tokens):
            if t >= self.vocab_limit:
                return tokens[:i]
        return tokens

    @staticmethod
    def _observe(state: _Backoff, num_drafts: int, num_accepted: int) -> None:
        state.acceptance = (1 - SMOOTHING) * state.acceptance + SMOOTHING * num_accepted / num_drafts
        if state.acceptance < MIN_ACCEPTANCE_RATE:
            state.pause = min(max(2 * state.pause, FIRST_PAUSE_STEPS), MAX_PAUSE_STEPS)
            state.skip = state.pause
            state.acceptance = MIN_ACCEPTANCE_RATE  # one good try is enough to carry on
        else:
            state.pause //= 2

    def _forget(self, requests: dict[str, Request]) -> None:
        gone = {rid for rid in self._backoff if rid not in requests}
        if gone:
            for rid in gone:
                del self._backoff[rid]
            self.proposer.release(gone)
