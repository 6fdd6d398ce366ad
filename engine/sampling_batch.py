"""A step's rows to sample, as columns: the sampler's input.

Each request's sampling settings become one row of numbers once, when it first samples
(`SamplingParams.columns`); a step's batch is then one array conversion of those rows plus
references to the requests' own token lists, with no object built per row. The sampler reads
whole columns (`greedy`, `top_p`, ...) and picks the rows each stage needs with array masks.

A row is a logits row to sample from. Most requests have one; a forking prompt has n (one
per sample, the same logits), and a request verifying k drafts has k + 1 consecutive rows
(row j scores the position after drafts[:j], its output tokens include them).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import numpy as np

from common.sampling_params import SamplingParams
from engine.keyed_random import mix_array

# SamplingParams.columns, in this order.
(TEMPERATURE, TOP_K, TOP_P, MIN_P, REPETITION, FREQUENCY, PRESENCE, LOGPROBS, MIN_TOKENS, GREEDY, PENALTIES,
 PLAIN_GREEDY, LOGIT_RULES) = range(13)
NUM_COLUMNS = 13
UNSEEDED = -1  # an rng key: the row draws from the global RNG

_columns = operator.attrgetter("columns")
_sampling_params = operator.attrgetter("sampling_params")
_prompt_token_ids = operator.attrgetter("prompt_token_ids")
_output_token_ids = operator.attrgetter("output_token_ids")
_seed = operator.attrgetter("seed")
_structured = operator.attrgetter("structured")


@dataclass(slots=True)
class SamplingBatch:
    params: list[SamplingParams]  # each row's request's (shared, not copied)
    prompt_token_ids: list[list[int]]
    output_token_ids: list[list[int]]  # generated before this row's token (the request's own list)
    # A seeded row's randomness: a key of (seed, output position), engine/keyed_random.py;
    # UNSEEDED: the global RNG. int64 [R].
    rng_keys: np.ndarray
    matchers: list | None = None  # structured output: each row's GrammarMatcher or None; None: no row has one
    draft_token_ids: list[int | None] | None = None  # the draft each row verifies; None: no row verifies
    columns: np.ndarray = field(default=None)  # [R, NUM_COLUMNS] float64, from params

    def __post_init__(self) -> None:
        if self.columns is None:
            self.columns = np.array(list(map(_columns, self.params)), np.float64).reshape(-1, NUM_COLUMNS)

    @classmethod
    def of_requests(cls, requests: list, position_offset: int = 0) -> SamplingBatch:
        """One row per request, at its next output position (+ `position_offset`: a step
        launched after one still in flight samples one position further)."""
        outputs = list(map(_output_token_ids, requests))
        positions = np.fromiter(map(len, outputs), np.int64, len(outputs)) + position_offset
        structured = list(map(_structured, requests))
        matchers = None
        if any(structured):
            matchers = [None if s is None else s.matcher for s in structured]
        return cls(list(map(_sampling_params, requests)), list(map(_prompt_token_ids, requests)), outputs,
                   rng_keys(list(map(_seed, requests)), positions), matchers)

    def __len__(self) -> int:
        return len(self.params)

    def take(self, rows: np.ndarray | list[int]) -> SamplingBatch:
        """The batch of these rows, in this order."""
        rows = np.asarray(rows, dtype=np.int64)
        picked = rows.tolist()
        return SamplingBatch([self.params[i] for i in picked], [self.prompt_token_ids[i] for i in picked],
                             [self.output_token_ids[i] for i in picked], self.rng_keys[rows],
                             None if self.matchers is None else [self.matchers[i] for i in picked],
                             None if self.draft_token_ids is None else [self.draft_token_ids[i] for i in picked],
                             self.columns[rows])

    def flag(self, column: int) -> np.ndarray:
        """A 0/1 column as booleans."""
        return self.columns[:, column] != 0.0

    def num_outputs(self) -> np.ndarray:
        return np.fromiter(map(len, self.output_token_ids), np.int64, len(self))

    def constrained(self) -> list[int]:
        """The rows a grammar constrains."""
        if self.matchers is None:
            return []
        return [i for i, m in enumerate(self.matchers) if m is not None]

    def min_tokens_pending(self) -> np.ndarray:
        """Rows that may not stop yet (fewer outputs than min_tokens; a grammar decides a
        constrained row's end instead), as a boolean mask."""
        pending = self.num_outputs() < self.columns[:, MIN_TOKENS]
        if self.matchers is not None and pending.any():
            pending &= np.fromiter((m is None for m in self.matchers), bool, len(self))
        return pending

    def plain_greedy(self) -> bool:
        """Every row is its logits' argmax and nothing more (SamplingParams.plain_greedy, with
        min_tokens reached or a grammar in charge of the end)."""
        return bool(self.flag(PLAIN_GREEDY).all()) and not self.min_tokens_pending().any()


def rng_keys(seeds: list[int | None], positions: np.ndarray) -> np.ndarray:
    """Each row's key of (seed, output position), or UNSEEDED where its seed is None."""
    n = len(seeds)
    if seeds.count(None) == n:
        return np.full(n, UNSEEDED, np.int64)
    keys = mix_array(np.array([0 if s is None else s for s in seeds], np.uint64), positions)
    if None in seeds:
        keys[np.array([s is None for s in seeds])] = UNSEEDED
    return keys
