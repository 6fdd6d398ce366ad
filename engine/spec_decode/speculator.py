"""Which requests get drafts after each step, how many, from which proposer.

After a step's update, every request that was scheduled, still runs and is decoding (all its
tokens computed but the one just sampled) may get drafts for its next step, at most

    limit = min(num_speculative_tokens, max_tokens left - 1, max_model_len left - 1)

(the verification step emits up to limit + 1 tokens, which must fit both limits).

How many, below that: as many as pay for themselves. Each request keeps, per draft slot j,
the chance c_j that its draft there is accepted once the ones before it were (recent
verifications weighing most; optimistic at first), so its j-th draft is kept with probability
P_j = c_1 ... c_j. (Acceptance comes in runs: a reply that copies its prompt keeps nearly
every draft after the first, so one rate for all slots would draft too little.) A draft token
costs `b` seconds of step time and the step emits tokens at rate T / time; a draft is worth
adding while P_j * time > b * T: it must bring more tokens than the same time spent at the
current rate. The drafts are handed out best first across
the batch (`StepCost` fits a and b from recent decode steps, so this holds on a slow CPU,
where a draft costs a third of a step, and on a GPU, where it is nearly free).

Back-off: a request whose drafts do not pay proposes nothing for a pause, then tries again
with one draft; a failed try doubles the pause (up to MAX_PAUSE_STEPS), a good one halves it
and starts the request's estimate afresh.
So a proposer that keeps missing costs a request one short try now and then.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from engine.outputs import SchedulerOutput
from engine.request import Request, RequestStatus
from engine.spec_decode.cost import StepCost

# Until StepCost has seen steps of different sizes: draft while p is at least this.
FALLBACK_MIN_ACCEPTANCE = 0.5
# Whatever the fit says (noise can make drafts look free), a draft costs at least this share
# of a request's step, and a first draft accepted less often than this is never worth it: a
# proposer that keeps missing backs off even where drafts are nearly free.
MIN_DRAFT_COST_SHARE = 0.05
MIN_FIRST_CHANCE = 0.2
HISTORY_DECAY = 0.8  # weight of the past in a request's acceptance estimates, per verification
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
    # Per draft slot, decayed counts: verifications that reached it (every draft before it
    # accepted), and of those, the ones that accepted it.
    reached: list[float]
    kept: list[float]
    pause: int = 0  # length of the next pause, in steps
    skip: int = 0  # steps left without proposing
    probing: bool = False  # the next proposal is a one-draft try after a pause

    @classmethod
    def fresh(cls, k: int) -> _Backoff:
        return cls([0.0] * k, [0.0] * k)

    def chance(self, slot: int) -> float:
        """Of the draft at `slot` being accepted, the ones before it accepted (one imagined
        success as the prior: a new request is trusted until it misses)."""
        return (self.kept[slot] + 1) / (self.reached[slot] + 1)

    def observe(self, num_drafts: int, num_accepted: int) -> None:
        for j in range(len(self.reached)):
            self.reached[j] *= HISTORY_DECAY
            self.kept[j] *= HISTORY_DECAY
        for j in range(min(num_drafts, num_accepted + 1)):
            self.reached[j] += 1
            self.kept[j] += j < num_accepted


class Speculator:
    def __init__(self, proposer: Proposer, num_speculative_tokens: int, max_model_len: int,
                 vocab_limit: int) -> None:
        """`vocab_limit`: drafts at or past it (LM-head padding rows) are never proposed."""
        self.proposer = proposer
        self.k = num_speculative_tokens
        self.max_model_len = max_model_len
        self.vocab_limit = vocab_limit
        self.cost = StepCost()
        self._backoff: dict[str, _Backoff] = {}

    def observe_step(self, sched: SchedulerOutput, seconds: float) -> None:
        """A step's time, schedule to proposals: decode steps feed the cost fit."""
        if all(s.num_new_tokens == 1 + len(s.spec_token_ids) and s.num_samples == 1 for s in sched.scheduled):
            self.cost.observe(sched.num_batched_tokens, seconds)

    def after_step(self, sched: SchedulerOutput) -> None:
        """Learn from this step's verifications, then set each eligible request's drafts."""
        self._forget(sched.finished_request_ids)
        candidates, limits, tables = [], [], []
        for s in sched.scheduled:
            r = s.request
            state = self._backoff.setdefault(r.request_id, _Backoff.fresh(self.k))
            if s.spec_token_ids:
                self._observe(state, len(s.spec_token_ids), s.num_accepted_tokens)
            limit = self._limit(r)
            if limit <= 0:
                continue
            if state.skip > 0:
                state.skip -= 1
                if state.skip == 0:
                    state.probing = True
                continue
            candidates.append(r)
            limits.append(1 if state.probing else limit)
            tables.append(s.block_ids)
        if not candidates:
            return
        probes = [self._backoff[r.request_id].probing for r in candidates]
        worth = self._worth_it(candidates, limits, len(sched.scheduled))
        limits = [1 if probe else k for probe, k in zip(probes, worth)]  # a try goes ahead regardless
        chosen = [i for i, k in enumerate(limits) if k > 0]
        for i, r in enumerate(candidates):
            if limits[i] == 0:
                self._pause(self._backoff[r.request_id])
        if not chosen:
            return
        drafts = self.proposer.propose([candidates[i] for i in chosen], [limits[i] for i in chosen],
                                       [tables[i] for i in chosen], sched.blocks_to_copy)
        for i, tokens in zip(chosen, drafts):
            candidates[i].spec_token_ids = self._in_vocab(tokens)

    def _worth_it(self, requests: list[Request], limits: list[int], batch_size: int) -> list[int]:
        """Drafts per request that pay for themselves (see the module docstring), best first."""
        fit = self.cost.fit()
        states = [self._backoff[r.request_id] for r in requests]
        if fit is None:
            return [k if state.chance(0) >= FALLBACK_MIN_ACCEPTANCE else 0 for k, state in zip(limits, states)]
        a, b = fit
        b = max(b, MIN_DRAFT_COST_SHARE * (a + b * batch_size) / batch_size)
        tokens, time = float(batch_size), a + b * batch_size
        granted = [0] * len(requests)
        best = [(-state.chance(0), i, 1) for i, state in enumerate(states)
                if limits[i] > 0 and state.chance(0) >= MIN_FIRST_CHANCE]
        heapq.heapify(best)
        while best:
            neg_p, i, j = heapq.heappop(best)
            if -neg_p * time <= b * tokens:
                break  # the likeliest draft left does not pay: none after it does
            granted[i] = j
            tokens, time = tokens - neg_p, time + b
            if j < limits[i]:
                heapq.heappush(best, (neg_p * states[i].chance(j), i, j + 1))
        return granted

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

    def _observe(self, state: _Backoff, num_drafts: int, num_accepted: int) -> None:
        state.observe(num_drafts, num_accepted)
        if state.probing:
            state.probing = False
            if num_accepted == num_drafts:  # the try paid: start afresh, with shorter pauses
                state.reached, state.kept = [0.0] * self.k, [0.0] * self.k
                state.pause //= 2

    @staticmethod
    def _pause(state: _Backoff) -> None:
        state.pause = min(max(2 * state.pause, FIRST_PAUSE_STEPS), MAX_PAUSE_STEPS)
        state.skip = state.pause
        state.probing = False

    def _forget(self, request_ids: set[str]) -> None:
        """Drop the state of requests that ended."""
        for rid in request_ids:
            self._backoff.pop(rid, None)
        if request_ids:
            self.proposer.release(request_ids)
