"""SamplingBatch: a step's sampling rows as columns, built from the requests without an object
per row; and the runner's rows for forking prompts and draft verification."""

from __future__ import annotations

import numpy as np

from common.sampling_params import SamplingParams
from engine.keyed_random import mix
from engine.outputs import ScheduledRequest
from engine.request import Request
from engine.sampled_rows import sampling_rows
from engine.sampling_batch import (GREEDY, LOGPROBS, MIN_TOKENS, NUM_COLUMNS, PENALTIES, TEMPERATURE, TOP_K, TOP_P,
                                   UNSEEDED, SamplingBatch, rng_keys)

SETTINGS = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_k=5, top_p=0.9, seed=3),
            SamplingParams(temperature=1.0, logprobs=2, repetition_penalty=1.2, min_tokens=4),
            SamplingParams(temperature=0.5, seed=2**63 - 1)]


def requests(outputs: list[list[int]] | None = None) -> list[Request]:
    reqs = [Request(f"r{i}", [1, 2, 3 + i], p) for i, p in enumerate(SETTINGS)]
    for r, out in zip(reqs, outputs or [[]] * len(reqs)):
        for token in out:
            r.append_output(token, None)
    return reqs


def test_columns_hold_each_rows_settings():
    batch = SamplingBatch.of_requests(requests())
    assert batch.columns.shape == (4, NUM_COLUMNS)
    for i, p in enumerate(SETTINGS):
        assert batch.columns[i, TEMPERATURE] == p.temperature and batch.columns[i, TOP_K] == p.top_k
        assert batch.columns[i, TOP_P] == p.top_p and batch.columns[i, MIN_TOKENS] == p.min_tokens
        assert batch.columns[i, LOGPROBS] == (-1 if p.logprobs is None else p.logprobs)
        assert batch.flag(GREEDY)[i] == p.greedy and batch.flag(PENALTIES)[i] == p.uses_penalties
    assert batch.min_tokens_pending().tolist() == [False, False, True, False]
    assert not batch.plain_greedy() and batch.take([0]).plain_greedy()


def test_rows_share_the_requests_token_lists():
    reqs = requests([[5], [6, 7], [], [8]])
    batch = SamplingBatch.of_requests(reqs)
    assert all(b is r.output_token_ids for b, r in zip(batch.output_token_ids, reqs))
    assert all(b is r.prompt_token_ids for b, r in zip(batch.prompt_token_ids, reqs))
    assert batch.num_outputs().tolist() == [1, 2, 0, 1]


def test_seeded_rows_are_keyed_by_seed_and_output_position():
    reqs = requests([[5], [6, 7], [], [8]])
    keys = SamplingBatch.of_requests(reqs).rng_keys.tolist()
    assert keys == [UNSEEDED, mix(3, 2), UNSEEDED, mix(2**63 - 1, 1)]
    # A step launched after one in flight samples one position further.
    assert SamplingBatch.of_requests(reqs, 1).rng_keys.tolist() == [UNSEEDED, mix(3, 3), UNSEEDED, mix(2**63 - 1, 2)]
    assert rng_keys([None, None], np.array([0, 1])).tolist() == [UNSEEDED, UNSEEDED]


def test_take_picks_rows_in_order():
    batch = SamplingBatch.of_requests(requests([[5], [6, 7], [], [8]]))
    picked = batch.take([3, 1])
    assert picked.params == [SETTINGS[3], SETTINGS[1]]
    assert picked.rng_keys.tolist() == [batch.rng_keys[3], batch.rng_keys[1]]
    assert np.array_equal(picked.columns, batch.columns[[3, 1]])


def test_forks_and_verifications_get_a_row_each():
    """A forking prompt: n rows on one logits row, sample k seeded seed + k. A verification
    of k drafts: k + 1 rows, row j with drafts[:j] among its outputs and the position after."""
    fork = Request("fork", [1, 2], SamplingParams(n=3, temperature=1.0, seed=10))
    spec = Request("spec", [1, 2], SamplingParams(temperature=1.0, seed=20))
    spec.append_output(9, None)
    plain = Request("plain", [4], SamplingParams(temperature=0.0))
    sampling = [ScheduledRequest(fork, 2, [], 3), ScheduledRequest(spec, 3, [], 1, spec_token_ids=[4, 5]),
                ScheduledRequest(plain, 1, [], 1)]
    batch, owner, logits_index = sampling_rows(sampling)
    assert owner == [0, 0, 0, 1, 1, 1, 2]
    assert logits_index == [0, 0, 0, 1, 2, 3, 4]
    assert batch.rng_keys.tolist() == [mix(10, 0), mix(11, 0), mix(12, 0), mix(20, 1), mix(20, 2), mix(20, 3),
                                       UNSEEDED]
    assert batch.draft_token_ids == [None, None, None, 4, 5, None, None]
    assert batch.output_token_ids[3:6] == [[9], [9, 4], [9, 4, 5]]
    assert spec.output_token_ids == [9]  # the request's own list is untouched
