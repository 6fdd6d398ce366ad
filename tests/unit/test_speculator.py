"""Speculator: which requests get drafts, how many, and the back-off when drafts keep missing."""

from __future__ import annotations

from engine.outputs import ScheduledRequest, SchedulerOutput
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.spec_decode.speculator import FIRST_PAUSE_STEPS, Speculator


class Recorder:
    """Proposes 9s (or `drafts`) up to each limit, and remembers the limits it was given."""

    def __init__(self, drafts: list[int] | None = None) -> None:
        self.drafts, self.limits, self.released = drafts, [], set()

    def propose(self, requests, max_drafts, block_tables, blocks_to_copy):
        self.limits.append(dict(zip((r.request_id for r in requests), max_drafts)))
        return [(self.drafts or [9] * k)[:k] for k in max_drafts]

    def release(self, request_ids):
        self.released |= request_ids


def decoding(rid: str, num_outputs: int = 1, prompt_len: int = 10, **params) -> Request:
    r = Request(rid, list(range(3, 3 + prompt_len)), SamplingParams(**params), (2,),
                status=RequestStatus.RUNNING)
    for t in range(num_outputs):
        r.append_output(100 + t, None)
    r.num_computed_tokens = r.num_tokens - 1
    return r


def step(spec: Speculator, *requests: Request, accepted: dict[str, int] | None = None) -> None:
    scheduled = []
    for r in requests:
        s = ScheduledRequest(r, 1 + len(r.spec_token_ids), [0], 1, list(r.spec_token_ids))
        s.num_accepted_tokens = (accepted or {}).get(r.request_id, 0)
        scheduled.append(s)
        r.spec_token_ids = []  # verified: as the scheduler's update leaves them
    spec.after_step(SchedulerOutput(scheduled=scheduled), {r.request_id: r for r in requests})


def test_limits_by_max_tokens_max_model_len_and_eligibility():
    proposer = Recorder()
    spec = Speculator(proposer, num_speculative_tokens=4, max_model_len=20, vocab_limit=1000)
    free = decoding("free", max_tokens=None)
    near_max_tokens = decoding("tokens", num_outputs=5, max_tokens=8)  # 3 left: 2 drafts + 1
    near_max_len = decoding("len", num_outputs=1, prompt_len=16, max_tokens=None)  # 17 of 20: 2 drafts
    opted_out = decoding("out", disable_speculation=True)
    prefilling = decoding("prefill")
    prefilling.num_computed_tokens -= 3
    last_token = decoding("last", num_outputs=4, max_tokens=5)
    step(spec, free, near_max_tokens, near_max_len, opted_out, prefilling, last_token)
    assert proposer.limits == [{"free": 4, "tokens": 2, "len": 2}]
    assert free.spec_token_ids == [9] * 4 and opted_out.spec_token_ids == [] == prefilling.spec_token_ids


def test_drafts_past_the_vocabulary_are_cut():
    spec = Speculator(Recorder([5, 6, 1000, 7]), num_speculative_tokens=4, max_model_len=100, vocab_limit=1000)
    r = decoding("a")
    step(spec, r)
    assert r.spec_token_ids == [5, 6]


def test_back_off_pauses_grow_while_drafts_miss_and_shrink_when_they_hit():
    proposer = Recorder()
    spec = Speculator(proposer, num_speculative_tokens=4, max_model_len=1000, vocab_limit=1000)
    r = decoding("a", max_tokens=None)
    for _ in range(60):  # every draft rejected
        step(spec, r)
        r.append_output(7, None)
        r.num_computed_tokens = r.num_tokens - 1
    calls = len(proposer.limits)
    # Pauses of 4, 8, 16, 32 steps after each miss: 5 tries in 60 steps.
    assert calls == 5, calls
    assert spec._backoff["a"].pause == 8 * FIRST_PAUSE_STEPS
    # Hits halve the pause again: a try, then two verifications that accept everything.
    state = spec._backoff["a"]
    state.skip = 0
    for _ in range(3):
        step(spec, r, accepted={"a": len(r.spec_token_ids)})
    assert state.pause == 2 * FIRST_PAUSE_STEPS


def test_finished_requests_are_forgotten():
    proposer = Recorder()
    spec = Speculator(proposer, num_speculative_tokens=2, max_model_len=100, vocab_limit=1000)
    a, b = decoding("a"), decoding("b")
    step(spec, a, b)
    step(spec, a)
    assert proposer.released == {"b"} and set(spec._backoff) == {"a"}
