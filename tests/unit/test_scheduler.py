"""Scheduler: exact scheduling decisions, block ids, preemption, prefix hits, n>1 forks, stops.

Modelled on vLLM's tests/v1/core/test_scheduler.py. Everything is real except the model runner:
`FakeRunner` samples token 100 * step + j for sample j (override per request with `tokens`).
Every scheduler a test builds is drained at teardown and must give back every block.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings, strategies as st

from common.sampling_params import SamplingParams
from engine.block_manager import BlockManager
from engine.config import SchedulerConfig
from engine.outputs import ModelRunnerOutput, SchedulerOutput
from engine.request import Request, RequestStatus
from engine.scheduler import Scheduler

BS = 4
EOS = 2
_prompt_starts = itertools.count(1000, 1000)


def build(num_blocks=16, block_size=BS, budget=64, max_seqs=16, max_len=256, policy="fcfs",
          caching=True, admission_steps=0, scheduler=Scheduler) -> Scheduler:
    return scheduler(SchedulerConfig(budget, max_seqs, max_len, policy, async_admission_steps=admission_steps),
                     BlockManager(num_blocks, block_size, caching))


def make_request(rid: str, prompt_len: int = 0, *, prompt: list[int] | None = None, n: int = 1,
                 priority: int = 0, **params) -> Request:
    """Distinct prompt tokens per request unless `prompt` is given. n > 1 is keyed as the engine
    does: sample 0 is "rid/0" with parent_id "rid"."""
    if prompt is None:
        start = next(_prompt_starts)
        prompt = list(range(start, start + prompt_len))
    params = SamplingParams(n=n, **params)
    if n > 1:
        return Request(f"{rid}/0", prompt, params, (EOS,), priority, parent_id=rid)
    return Request(rid, prompt, params, (EOS,), priority)


class FakeRunner:
    """Stands in for the model runner: one token per sample for each request reaching its end."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.num_steps = 0

    def step(self, tokens: dict[str, int] | None = None, check=None):
        out = self.sched.schedule()
        self.num_steps += 1
        if check is not None:
            check(out)
        result = ModelRunnerOutput()
        for k, s in enumerate(out.scheduled):
            if s.num_samples:
                rid = s.request.request_id
                sampled = ([tokens[rid]] * s.num_samples if tokens and rid in tokens
                           else [100 * self.num_steps + j for j in range(s.num_samples)])
                if k < out.num_steady:  # as the model runner reports steady decodes
                    result.steady_token_ids += sampled
                    continue
                result.request_ids.append(rid)
                result.token_ids.append(sampled)
                result.logprobs.append([None] * s.num_samples)
        return out, self.sched.update_from_output(out, result)

    def drain(self, max_steps: int = 200) -> None:
        for _ in range(max_steps):
            if not self.sched.requests:
                return
            self.step()
        raise AssertionError(f"still unfinished after {max_steps} steps: {list(self.sched.requests)}")


def rows(out: SchedulerOutput) -> list[tuple[str, int, list[int], int]]:
    return [(s.request.request_id, s.num_new_tokens, s.block_ids, s.num_samples) for s in out.scheduled]


def waiting_ids(sched: Scheduler) -> list[str]:
    return [r.request_id for _, r in sorted(sched.waiting, key=lambda e: e[0])]


def assert_drained(sched: Scheduler) -> None:
    """Abort whatever is left; then every block must be free and the bookkeeping consistent."""
    sched.remove_requests(list(sched.requests), RequestStatus.FINISHED_ABORTED)
    assert not sched.running and not sched.waiting and not sched.requests
    bm = sched.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    bm.check_invariants()


@pytest.fixture
def make():
    made: list[Scheduler] = []

    def factory(**kwargs) -> tuple[Scheduler, FakeRunner]:
        made.append(build(**kwargs))
        return made[-1], FakeRunner(made[-1])

    yield factory
    for sched in made:
        assert_drained(sched)


def test_new_prompts_whole_then_decodes_one_token_each(make):
    sched, runner = make()
    for rid, length in (("A", 5), ("B", 7), ("C", 3)):
        sched.add_request(make_request(rid, length))
    out, outputs = runner.step()
    assert rows(out) == [("A", 5, [0, 1], 1), ("B", 7, [2, 3], 1), ("C", 3, [4], 1)]
    assert out.num_batched_tokens == 15
    assert [(o.request_id, o.new_token_ids, o.finished) for o in outputs] == [
        ("A", [100], False), ("B", [100], False), ("C", [100], False)]
    assert [sched.requests[r].num_computed_tokens for r in "ABC"] == [5, 7, 3]
    sched.add_request(make_request("D", 6))
    out, _ = runner.step()  # running decodes first, then the new prompt
    assert rows(out) == [("A", 1, [0, 1], 1), ("B", 1, [2, 3], 1), ("C", 1, [4], 1), ("D", 6, [5, 6], 1)]
    assert out.num_batched_tokens == 9
    out, _ = runner.step()  # B (9 tokens) and C (5 tokens) cross a block boundary
    assert rows(out) == [("A", 1, [0, 1], 1), ("B", 1, [2, 3, 7], 1), ("C", 1, [4, 8], 1),
                         ("D", 1, [5, 6], 1)]
    assert out.num_batched_tokens == 4
    assert sched.requests["A"].output_token_ids == [100, 200, 300]
    runner.drain()


def test_chunked_prefill_splits_by_budget_and_shares_leftover(make):
    sched, runner = make(budget=8)
    a = make_request("A", 20)
    sched.add_request(a)
    sched.add_request(make_request("B", 3))
    sched.add_request(make_request("C", 5))
    out, outputs = runner.step()
    assert rows(out) == [("A", 8, [0, 1], 0)] and outputs == []
    out, outputs = runner.step()
    assert rows(out) == [("A", 8, [0, 1, 2, 3], 0)] and outputs == []
    assert (a.num_computed_tokens, a.num_output_tokens) == (16, 0)
    out, outputs = runner.step()  # A's last chunk; B whole; C gets the 1 token left
    assert rows(out) == [("A", 4, [0, 1, 2, 3, 4], 1), ("B", 3, [5], 1), ("C", 1, [6], 0)]
    assert out.num_batched_tokens == 8
    assert [o.request_id for o in outputs] == ["A", "B"]
    out, _ = runner.step()
    assert rows(out) == [("A", 1, [0, 1, 2, 3, 4, 7], 1), ("B", 1, [5], 1), ("C", 4, [6, 8], 1)]
    assert out.num_batched_tokens == 6
    assert a.output_token_ids == [300, 400]
    runner.drain()


def test_max_num_seqs_caps_admissions_and_counts_fork_seats(make):
    sched, runner = make(max_seqs=2)
    for rid, max_tokens in (("A", 1), ("B", 3), ("C", 3)):
        sched.add_request(make_request(rid, 3, max_tokens=max_tokens))
    out, outputs = runner.step()
    assert [r[0] for r in rows(out)] == ["A", "B"] and waiting_ids(sched) == ["C"]
    assert outputs[0].finish_reason == "length"  # A frees its seat
    out, _ = runner.step()
    assert rows(out) == [("B", 1, [1], 1), ("C", 3, [2], 1)]  # A's freed block 0 went to the tail
    runner.drain()

    sched, runner = make(max_seqs=3)
    sched.add_request(make_request("X", 3, max_tokens=2))
    sched.add_request(make_request("F", 3, n=3))
    assert [r[0] for r in rows(runner.step()[0])] == ["X"]  # F needs 3 seats, only 2 are left
    assert [r[0] for r in rows(runner.step()[0])] == ["X"]
    assert rows(runner.step()[0]) == [("F/0", 3, [1], 3)]
    assert [r.request_id for r in sched.running] == ["F/0", "F/1", "F/2"]
    runner.drain()


def test_preemption_takes_newest_and_it_resumes_first_with_outputs_kept(make):
    sched, runner = make(num_blocks=4, caching=False)
    sched.add_request(make_request("A", 4, max_tokens=3))
    b, c = make_request("B", 3, max_tokens=4), make_request("C", 3, max_tokens=4)
    sched.add_request(b)
    sched.add_request(c)
    assert rows(runner.step()[0]) == [("A", 4, [0], 1), ("B", 3, [1], 1), ("C", 3, [2], 1)]
    assert rows(runner.step()[0]) == [("A", 1, [0, 3], 1), ("B", 1, [1], 1), ("C", 1, [2], 1)]
    assert sched.block_manager.num_free_blocks == 0
    sched.add_request(make_request("D", 2, max_tokens=2))
    out = sched.schedule()  # B needs a block: C, the newest, is preempted, not B
    assert rows(out) == [("A", 1, [0, 3], 1), ("B", 1, [1, 2], 1)]  # B got C's block 2
    assert out.num_preempted == 1 and sched.num_preemptions == 1 and c.num_preemptions == 1
    assert (c.status, c.num_computed_tokens, c.output_token_ids) == (RequestStatus.PREEMPTED, 0, [100, 200])
    assert not sched.block_manager.has_seq("C")
    assert [r.request_id for r in sched.running] == ["A", "B"]
    assert waiting_ids(sched) == ["C", "D"]  # D fits in no block, and nobody is admitted anyway
    sched.update_from_output(out, ModelRunnerOutput(["A", "B"], [[300], [300]], [[None], [None]]))
    assert sched.block_manager.num_free_blocks == 2  # A finished (length)
    runner.num_steps = 3
    out, _ = runner.step()  # C recomputes prompt + both outputs, ahead of the later D
    assert rows(out) == [("B", 1, [1, 2], 1), ("C", 5, [3, 0], 1)]
    assert c.output_token_ids == [100, 200, 400] and c.num_computed_tokens == 5
    runner.drain()
    assert c.output_token_ids[:3] == [100, 200, 400] and c.num_output_tokens == 4
    assert c.status == RequestStatus.FINISHED_LENGTH


def test_a_steady_decode_goes_through_the_block_manager_about_twice_a_block(make):
    sched, runner = make(num_blocks=16)
    calls = []
    append_slots = sched.block_manager.append_slots
    sched.block_manager.append_slots = lambda *args: calls.append(args[2]) or append_slots(*args)
    sched.add_request(make_request("A", 3, max_tokens=24))
    runner.step()  # the prefill
    steady = 0
    while sched.requests:
        out, _ = runner.step()
        steady += out.num_steady
    # Per block: the call that adds it, then the one that grants the lease for its room.
    assert len(calls) <= 2 * 7 and steady == 23
    assert sched.block_manager.num_free_blocks == 16


def test_priority_policy_admits_lower_value_first_and_preempts_highest_value(make):
    sched, runner = make(num_blocks=2, policy="priority")
    low = make_request("L", 3, priority=5, max_tokens=5)
    sched.add_request(low)  # arrives first
    sched.add_request(make_request("H", 4, priority=0, max_tokens=4))
    assert rows(runner.step()[0]) == [("H", 4, [0], 1), ("L", 3, [1], 1)]
    out, _ = runner.step()  # H needs a block; L is the oldest but the lowest priority
    assert rows(out) == [("H", 1, [0, 1], 1)]
    assert low.status == RequestStatus.PREEMPTED and out.num_preempted == 1
    runner.drain()


def test_preempting_a_victim_already_scheduled_this_step_takes_it_back(make):
    sched, runner = make(num_blocks=2, policy="priority")
    low = make_request("L", 2, priority=1, max_tokens=6)
    sched.add_request(low)
    assert rows(runner.step()[0]) == [("L", 2, [0], 1)]
    sched.add_request(make_request("H", 4, priority=0, max_tokens=4))
    assert rows(runner.step()[0]) == [("L", 1, [0], 1), ("H", 4, [1], 1)]
    out, _ = runner.step()  # L is scheduled first, then H's growth preempts it
    assert rows(out) == [("H", 1, [1, 0], 1)]
    assert out.num_batched_tokens == 1 and out.num_preempted == 1
    assert (low.status, low.num_computed_tokens) == (RequestStatus.PREEMPTED, 0)
    runner.drain()


def test_prefix_cache_hit_on_shared_two_block_prefix(make):
    sched, runner = make(block_size=16)
    a = make_request("A", 40)
    sched.add_request(a)
    assert rows(runner.step()[0]) == [("A", 40, [0, 1, 2], 1)]
    b = make_request("B", prompt=a.prompt_token_ids[:32] + [7, 8, 9, 10, 11])
    c = make_request("C", prompt=a.prompt_token_ids[:32])  # whole prompt cached but the last token
    sched.add_request(b)
    sched.add_request(c)
    out = sched.schedule()
    assert rows(out) == [("A", 1, [0, 1, 2], 1), ("B", 5, [0, 1, 3], 1), ("C", 16, [0, 4], 1)]
    assert (b.num_cached_tokens, b.num_computed_tokens) == (32, 32)
    assert (c.num_cached_tokens, c.num_computed_tokens) == (16, 16)
    assert [sched.block_manager.ref_count(i) for i in range(5)] == [3, 2, 1, 1, 1]
    result = ModelRunnerOutput(["A", "B", "C"], [[5], [5], [5]], [[None]] * 3)
    outputs = sched.update_from_output(out, result)
    assert [o.num_cached_tokens for o in outputs] == [0, 32, 16]
    runner.drain()


@pytest.mark.parametrize("prompt_len, copies, tables", [
    (6, [(1, 2), (1, 3)], [[0, 2], [0, 3], [0, 1]]),  # partial last block: copy-on-write
    (8, [], [[0, 1, 2], [0, 1, 3], [0, 1, 4]]),  # full blocks only: nothing to copy
])
def test_n_samples_fork_after_prefill_and_share_blocks(make, prompt_len, copies, tables):
    sched, runner = make()
    sched.add_request(make_request("p", prompt_len, n=3, max_tokens=3))
    out, outputs = runner.step()
    assert rows(out) == [("p/0", prompt_len, [0, 1], 3)]
    assert [(o.request_id, o.sample_index, o.new_token_ids) for o in outputs] == [
        ("p", 0, [100]), ("p", 1, [101]), ("p", 2, [102])]
    assert [r.request_id for r in sched.running] == ["p/0", "p/1", "p/2"]
    assert [r.num_computed_tokens for r in sched.running] == [prompt_len] * 3
    assert [sched.block_manager.ref_count(b) for b in (0, 1)] == [3, 3]
    out, outputs = runner.step()
    assert out.blocks_to_copy == copies
    assert rows(out) == [(f"p/{i}", 1, tables[i], 1) for i in range(3)]
    assert sched.block_manager.ref_count(0) == 3
    assert [(o.request_id, o.sample_index) for o in outputs] == [("p", 0), ("p", 1), ("p", 2)]
    runner.drain()


@pytest.mark.parametrize("params, tokens, reason, stop_token_id, max_len", [
    ({}, [5, EOS], "stop", EOS, 256),
    ({"ignore_eos": True, "max_tokens": 3}, [EOS, EOS, EOS], "length", None, 256),
    ({"stop_token_ids": [3]}, [5, 3], "stop", 3, 256),
    ({"min_tokens": 2}, [EOS, EOS], "stop", EOS, 256),
    ({"min_tokens": 3, "stop_token_ids": [3]}, [3, 3, 3], "stop", 3, 256),
    ({"max_tokens": 2}, [5, 5], "length", None, 256),
    ({"max_tokens": None}, [5, 5], "length", None, 8),  # prompt 6 + 2 = max_model_len
], ids=["eos", "ignore_eos", "stop_token", "min_tokens_eos", "min_tokens_stop", "max_tokens",
        "max_model_len"])
def test_stop_conditions(make, params, tokens, reason, stop_token_id, max_len):
    sched, runner = make(max_len=max_len)
    request = make_request("A", 6, **params)
    sched.add_request(request)
    outputs = [o for token in tokens for o in runner.step({"A": token})[1]]
    assert [o.new_token_ids[0] for o in outputs] == tokens
    assert [o.finish_reason for o in outputs] == [None] * (len(tokens) - 1) + [reason]
    assert outputs[-1].stop_token_id == stop_token_id
    assert request.status.finish_reason == reason and not sched.requests
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks
    assert sched.schedule().finished_request_ids == {"A"}


def test_abort_from_waiting_and_running_frees_blocks(make):
    sched, runner = make(num_blocks=8, max_seqs=1)
    a, b = make_request("A", 5), make_request("B", 3)
    sched.add_request(a)
    sched.add_request(b)
    runner.step()
    assert [r.request_id for r in sched.running] == ["A"] and waiting_ids(sched) == ["B"]
    assert sched.block_manager.num_free_blocks == 6
    removed = sched.remove_requests(["B", "A", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert removed == [b, a]
    assert a.status.finish_reason == b.status.finish_reason == "abort"
    assert sched.block_manager.num_free_blocks == 8 and not sched.running and not sched.waiting
    assert sched.remove_requests(["A"], RequestStatus.FINISHED_ABORTED) == []
    out = sched.schedule()
    assert out.finished_request_ids == {"A", "B"} and out.is_empty
    assert sched.schedule().finished_request_ids == set()


def _two_preemptions_in_one_step(make):
    """Step 3: M and L decode (L's token fills its block 2), then H's chunk cannot grow: L is
    preempted after being scheduled, then H itself. Only M's share of that step runs."""
    sched, runner = make(num_blocks=5, budget=9, policy="priority")
    low = make_request("L", 2, priority=1, max_tokens=4)
    sched.add_request(make_request("M", 6, max_tokens=3))
    sched.add_request(low)
    assert rows(runner.step()[0]) == [("M", 6, [0, 1], 1), ("L", 2, [2], 1)]
    high = make_request("H", 16, max_tokens=2)
    sched.add_request(high)
    assert rows(runner.step()[0]) == [("M", 1, [0, 1], 1), ("L", 1, [2], 1), ("H", 7, [3, 4], 0)]
    out, _ = runner.step()
    assert rows(out) == [("M", 1, [0, 1], 1)] and out.num_batched_tokens == 1
    assert out.num_preempted == 2 and sched.num_preemptions == 2
    assert [r.request_id for r in sched.running] == [] and waiting_ids(sched) == ["H", "L"]
    assert (low.num_computed_tokens, high.num_computed_tokens) == (0, 0)
    assert sched.block_manager.num_free_blocks == 5  # M finished too
    return sched, runner, low, high


def test_two_preemptions_in_one_step_then_both_complete(make):
    sched, runner, low, high = _two_preemptions_in_one_step(make)
    runner.drain()
    assert (low.num_output_tokens, high.num_output_tokens) == (4, 2)
    assert low.output_token_ids[:2] == [100, 200]


def test_blocks_of_a_discarded_step_are_not_served_from_cache(make):
    sched, runner, low, _ = _two_preemptions_in_one_step(make)
    # L's KV covers 3 tokens; its block 2 (tokens 0..3) was filled only by the discarded step.
    newcomer = make_request("N", prompt=low.all_token_ids + [7], priority=-1, max_tokens=2)
    sched.add_request(newcomer)
    runner.step()
    assert newcomer.num_cached_tokens == 0


def test_fcfs_policy_ignores_priority(make):
    sched, runner = make(max_seqs=1, policy="fcfs")
    sched.add_request(make_request("first", 3, priority=1))
    sched.add_request(make_request("second", 3, priority=0))
    assert [r[0] for r in rows(runner.step()[0])] == ["first"]


def test_forked_samples_respect_max_num_seqs(make):
    sched, runner = make(max_seqs=3)
    sched.add_request(make_request("F", 3, n=3))
    sched.add_request(make_request("X", 3))
    runner.step()
    assert len(sched.running) <= 3


def _check_step(sched: Scheduler, out: SchedulerOutput | None) -> None:
    running = [r.request_id for r in sched.running]
    waiting = [e[1].request_id for e in sched.waiting]
    assert len(set(running)) == len(running) and len(set(waiting)) == len(waiting)
    assert not set(running) & set(waiting)
    assert set(running) | set(waiting) == set(sched.requests)
    bm = sched.block_manager
    assert all(bm.has_seq(r) for r in running) and not any(bm.has_seq(r) for r in waiting)
    assert all(r.num_computed_tokens <= r.num_tokens for r in sched.requests.values())
    if out is not None:
        assert out.num_batched_tokens == sum(s.num_new_tokens for s in out.scheduled)
        assert out.num_batched_tokens <= sched.config.max_num_batched_tokens
        assert len({s.request.request_id for s in out.scheduled}) == len(out.scheduled)
        for s in out.scheduled:
            end = s.request.num_computed_tokens + s.num_new_tokens
            assert s.request.status == RequestStatus.RUNNING and s.num_new_tokens >= 1
            assert end <= s.request.num_tokens and len(s.block_ids) == bm.num_blocks_needed(end)
        live = {b for s in out.scheduled for b in s.block_ids}
        assert all(dst in live for _, dst in out.blocks_to_copy)
    bm.check_invariants()


BASE = list(range(5000, 5008))
# At most 8 + 6 prompt and 6 output tokens: a sequence fits the smallest pool (5 blocks of 4).
spec = st.tuples(st.integers(0, 8), st.integers(1, 6), st.integers(1, 6), st.integers(1, 3),
                 st.integers(0, 2), st.integers(0, 6), st.none() | st.integers(0, 12))


@settings(max_examples=150, deadline=None)
@given(num_blocks=st.integers(5, 7), budget=st.integers(4, 16), max_seqs=st.integers(1, 4),
       policy=st.sampled_from(["fcfs", "priority"]), specs=st.lists(spec, min_size=1, max_size=8))
def test_random_workload_keeps_invariants_and_finishes(num_blocks, budget, max_seqs, policy, specs):
    sched = build(num_blocks=num_blocks, budget=budget, max_seqs=max_seqs, policy=policy)
    runner = FakeRunner(sched)
    counts: dict[tuple[str, int], int] = {}
    aborted: set[str] = set()
    last_event = max(max(s[5], s[6] or 0) for s in specs)
    for step in range(300):
        for k, (shared, tail, max_tokens, n, priority, arrival, abort) in enumerate(specs):
            rid = f"r{k}"
            if arrival == step:  # shared prefixes of BASE exercise prefix caching
                prompt = BASE[:shared] + [100_000 * (k + 1) + i for i in range(tail)]
                sched.add_request(make_request(rid, prompt=prompt, n=n, priority=priority,
                                               max_tokens=max_tokens))
            if abort == step:
                ids = [r.request_id for r in sched.requests.values() if rid in (r.request_id, r.parent_id)]
                if sched.remove_requests(ids, RequestStatus.FINISHED_ABORTED):
                    aborted.add(rid)
                _check_step(sched, None)
        if step > last_event and not sched.requests:
            break
        _, outputs = runner.step(check=lambda out: _check_step(sched, out))
        _check_step(sched, None)
        for o in outputs:
            counts[(o.request_id, o.sample_index)] = counts.get((o.request_id, o.sample_index), 0) + 1
            assert o.finish_reason in (None, "length")
    else:
        raise AssertionError(f"unfinished: {list(sched.requests)}")
    for k, (_, _, max_tokens, n, *_) in enumerate(specs):
        if f"r{k}" not in aborted:
            assert [counts.get((f"r{k}", i)) for i in range(n)] == [max_tokens] * n
    assert_drained(sched)


# -- speculative decoding -------------------------------------------------------------------


def test_drafts_share_the_budget_take_slots_and_roll_back(make):
    sched, runner = make(budget=8)
    a = make_request("A", 5)
    sched.add_request(a)
    runner.step()  # prefill: 5 tokens, then one sampled
    a.spec_token_ids = list(range(500, 509))  # 9 drafts: the budget takes 1 + 7
    sched.add_request(make_request("B", 3))
    out = sched.schedule()
    [s] = out.scheduled  # B waits: the drafts took the budget
    assert s.num_new_tokens == 8 and s.spec_token_ids == list(range(500, 507))
    assert len(s.block_ids) == 4  # slots for positions 0..13 (block size 4)
    # The verification accepts 2 drafts, then the target's own token.
    result = ModelRunnerOutput(request_ids=["A"], token_ids=[[500, 501, 77]], logprobs=[[None] * 3])
    sched.update_from_output(out, result)
    assert a.output_token_ids[-3:] == [500, 501, 77] and a.spec_token_ids == []
    assert a.num_computed_tokens == a.num_tokens - 1 == 8  # the 5 rejected positions rolled back
    assert s.num_accepted_tokens == 2
    assert sched.spec_stats.num_drafts == 1 and sched.spec_stats.num_draft_tokens == 7
    assert sched.spec_stats.accepted_per_position == [1, 1, 0, 0, 0, 0, 0]
    # The next step computes one token again; the table keeps its slots.
    out, _ = runner.step()
    assert [(r.request.request_id, r.num_new_tokens, len(r.block_ids)) for r in out.scheduled][0] == ("A", 1, 4)


def test_an_accepted_run_counts_every_token_and_one_inter_token_latency():
    from engine.stats import IterationStats
    stats = IterationStats()
    sched = Scheduler(SchedulerConfig(64, 16, 256), BlockManager(16, BS), stats)
    a = make_request("A", 4)
    sched.add_request(a)
    sched.update_from_output(sched.schedule(), ModelRunnerOutput(["A"], [[500]], [[None]]))
    a.spec_token_ids = [501, 502]
    out = sched.schedule()
    sched.update_from_output(out, ModelRunnerOutput(["A"], [[501, 502, 503]], [[None] * 3]))
    assert stats.num_generation_tokens == 4 and len(stats.ttfts_s) == 1 and len(stats.itls_s) == 1
    assert_drained(sched)


def test_a_stop_inside_an_accepted_run_drops_the_rest(make):
    sched, runner = make()
    a = make_request("A", 4, max_tokens=4)
    sched.add_request(a)
    runner.step()
    a.spec_token_ids = [600, EOS, 601]
    out = sched.schedule()
    result = ModelRunnerOutput(request_ids=["A"], token_ids=[[600, EOS, 601, 602]], logprobs=[[None] * 4])
    [output] = sched.update_from_output(out, result)
    assert output.new_token_ids == [600, EOS] and output.finish_reason == "stop" and output.stop_token_id == EOS
    assert a.status == RequestStatus.FINISHED_STOPPED and "A" not in sched.requests
