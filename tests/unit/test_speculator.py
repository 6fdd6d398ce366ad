"""Speculator: which requests get drafts, how many, and the back-off when drafts keep missing."""

from __future__ import annotations

from common.sampling_params import SamplingParams
from engine.outputs import ScheduledRequest, SchedulerOutput
from engine.request import Request, RequestStatus
from engine.spec_decode.speculator import FIRST_PAUSE_STEPS, Speculator, _Backoff


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


def step(spec: Speculator, *requests: Request, accepted: dict[str, int] | None = None,
         finished: set[str] = frozenset()) -> None:
    scheduled = []
    for r in requests:
        s = ScheduledRequest(r, 1 + len(r.spec_token_ids), [0], 1, list(r.spec_token_ids))
        s.num_accepted_tokens = (accepted or {}).get(r.request_id, 0)
        scheduled.append(s)
        r.spec_token_ids = []  # verified: as the scheduler's update leaves them
    spec.after_step(SchedulerOutput(scheduled=scheduled, finished_request_ids=set(finished)))


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
    # Trusted for two tries (the prior is one success); then pauses of 4, 8, 16, 32 steps,
    # each ended by a one-draft try.
    assert [limits["a"] for limits in proposer.limits] == [4, 4, 1, 1, 1]
    state = spec._backoff["a"]
    assert state.pause == 8 * FIRST_PAUSE_STEPS and state.chance(0) < 0.25
    # A try that is accepted halves the pause.
    state.skip, state.probing = 0, True
    step(spec, r)
    assert proposer.limits[-1] == {"a": 1}
    step(spec, r, accepted={"a": 1})
    assert state.pause == 4 * FIRST_PAUSE_STEPS


def test_drafts_go_where_they_pay_once_the_step_cost_is_known():
    proposer = Recorder()
    spec = Speculator(proposer, num_speculative_tokens=4, max_model_len=1000, vocab_limit=1000)
    for tokens in (1, 5, 1, 5, 2, 3):  # a = 6 ms, b = 3 ms: a draft costs half a plain step
        spec.cost.observe(tokens, 0.006 + 0.003 * tokens)
    a, b = spec.cost.fit()
    assert abs(a - 0.006) < 1e-9 and abs(b - 0.003) < 1e-9
    sure, likely, doubtful = decoding("sure"), decoding("likely"), decoding("doubtful")
    for r, chances in ((sure, (1, 1, 1, 1)), (likely, (0.8, 0.8, 0.8, 0.8)), (doubtful, (0.25, 0.5, 1, 1))):
        state = spec._backoff.setdefault(r.request_id, _Backoff.fresh(4))
        state.reached = [99.0] * 4
        state.kept = [c * 100 - 1 for c in chances]  # chance(j) = (kept + 1) / (reached + 1)
    step(spec, sure, likely, doubtful)
    # All 4 sure ones; 0.8^j beats b*T/time while the rate holds up; 0.25 for the first: none.
    limits = proposer.limits[-1]
    assert limits["sure"] == 4 and 1 <= limits["likely"] < 4 and "doubtful" not in limits
    assert spec._backoff["doubtful"].skip == FIRST_PAUSE_STEPS


def test_finished_requests_are_forgotten():
    proposer = Recorder()
    spec = Speculator(proposer, num_speculative_tokens=2, max_model_len=100, vocab_limit=1000)
    a, b = decoding("a"), decoding("b")
    step(spec, a, b)
    step(spec, a, finished={"b"})
    assert proposer.released == {"b"} and set(spec._backoff) == {"a"}


def test_a_proposer_that_keeps_missing_backs_off_even_when_drafts_look_free():
    proposer = Recorder()
    spec = Speculator(proposer, num_speculative_tokens=4, max_model_len=1000, vocab_limit=1000)
    for tokens in (1, 5, 1, 5):
        spec.cost.observe(tokens, 0.010)  # a flat line: b = 0
    r = decoding("a", max_tokens=None)
    for _ in range(40):
        step(spec, r)
        r.append_output(7, None)
        r.num_computed_tokens = r.num_tokens - 1
    assert len(proposer.limits) <= 10
    assert spec._backoff["a"].pause >= 4 * FIRST_PAUSE_STEPS
