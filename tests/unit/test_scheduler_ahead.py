"""AsyncScheduler.schedule_ahead (async scheduling): when a step may be scheduled while the one
before is still running, and what it does at a block boundary. The engine-level equality with
the synchronous engine is in tests/engine/test_async_scheduling.py."""

from __future__ import annotations

import zlib

from hypothesis import given, settings
from hypothesis import strategies as st
from test_scheduler import BS, EOS, FakeRunner, assert_drained, build, make, make_request  # noqa: F401

from engine.async_scheduler import AsyncScheduler
from engine.outputs import ModelRunnerOutput


def _decoding(make, num: int, prompt_len: int = 2, **kwargs):
    sched, runner = make(scheduler=AsyncScheduler, **kwargs)
    for i in range(num):
        sched.add_request(make_request(f"r{i}", prompt_len, max_tokens=50))
    runner.step()  # prefills: each now has its first token
    runner.step()  # the first decode, through the block manager: each gets a lease
    return sched, runner


def test_steady_decodes_go_ahead_one_position_further(make):
    sched, _ = _decoding(make, 3)
    ahead = sched.schedule_ahead()
    assert ahead is not None and ahead.num_steady == 3 and ahead.num_batched_tokens == 3
    assert [s.request for s in ahead.scheduled] == sched.running
    assert [s is r.decode_entry for s, r in zip(ahead.scheduled, sched.running)] == [True] * 3


def test_a_spent_lease_is_renewed_with_the_known_tokens_hashed(make):
    sched, runner = _decoding(make, 1, prompt_len=2)  # 3 computed, 4 tokens: position 3 ends block 0
    request = sched.running[0]
    assert request.num_computed_tokens == 3 and request.decode_lease_end == BS
    blocks = len(sched.block_manager.live_block_table("r0"))
    # The step in flight computes position 3; the one ahead computes 4, in a new block.
    ahead = sched.schedule_ahead()
    assert ahead is not None
    assert len(ahead.scheduled[0].block_ids) == blocks + 1 and request.decode_lease_end == 2 * BS
    # Block 0 (positions 0-3, all known) is cached now: another prompt with those tokens hits it.
    assert sched.block_manager.get_computed_blocks(request.all_token_ids[:BS] + [7], ())[1] == BS
    # The synchronous path afterwards agrees: the request stays on its renewed lease.
    runner.step()
    assert request.num_computed_tokens == 4 and request.decode_lease_end == 2 * BS


def test_no_step_ahead_while_a_waiting_request_could_be_admitted(make):
    sched, _ = _decoding(make, 2, max_seqs=3)
    sched.add_request(make_request("late", 2))
    assert sched.schedule_ahead() is None  # admission takes blocks: the synchronous path's
    full, _ = _decoding(make, 3, max_seqs=3)
    full.add_request(make_request("waits", 2))
    assert full.schedule_ahead() is not None  # no seat for it anyway


def test_admission_waits_a_bounded_number_of_steps_ahead_under_load(make):
    sched, runner = _decoding(make, 2, max_seqs=3, admission_steps=2)
    sched.add_request(make_request("late", 2))
    # The batch is at least half full: two steps go ahead past the waiting request, not three.
    assert sched.schedule_ahead() is not None and sched.schedule_ahead() is not None
    assert sched.schedule_ahead() is None
    runner.step()  # the synchronous step admits it
    assert "late" in [r.request_id for r in sched.running]
    light, _ = _decoding(make, 1, max_seqs=4, admission_steps=2)
    light.add_request(make_request("next", 2))
    assert light.schedule_ahead() is None  # under half full: admitted at once


def test_no_step_ahead_for_a_request_that_is_not_a_steady_decode(make):
    sched, runner = make(scheduler=AsyncScheduler)
    sched.add_request(make_request("a", 2, max_tokens=20))
    runner.step()
    assert sched.schedule_ahead() is None  # its first decode has no lease yet
    runner.step()
    assert sched.schedule_ahead() is not None
    sched.running[0].spec_token_ids = [5, 6]
    assert sched.schedule_ahead() is None  # drafts to verify
    sched.running[0].spec_token_ids = []


def test_no_step_ahead_when_blocks_run_short(make):
    sched, _ = _decoding(make, 2, prompt_len=2, num_blocks=2)  # one block each, both full after the next
    assert sched.schedule_ahead() is None
    assert sched.block_manager.num_free_blocks == 0


def test_tokens_of_requests_that_ended_meanwhile_are_dropped(make):
    sched, runner = _decoding(make, 3)
    ahead = sched.schedule_ahead()
    ended = sched.running[1]
    runner.step(tokens={ended.request_id: 2})  # the step in flight: r1 samples eos
    assert ended.status.finished
    outputs = sched.update_from_output(ahead, ModelRunnerOutput(steady_token_ids=[11, 12, 13]))
    assert [(o.request_id, o.new_token_ids) for o in outputs] == [("r0", [11]), ("r2", [13])]
    assert ended.output_token_ids[-1] == 2  # nothing after its eos


# -- random workloads: the same tokens as the synchronous loop ---------------------------------

def _token(request_id: str, position: int) -> int:
    """A model whose next token depends only on the sequence: its id and output position (eos,
    2, about one time in 11), so that any two schedules of a workload must give the same text."""
    value = zlib.crc32(f"{request_id}@{position}".encode())
    return EOS if value % 11 == 0 else 100 + value % 50


class Loop:
    """EngineCore.step()'s two ways over a real scheduler: synchronous, or with steps launched
    one ahead (engine/async_step.py), tokens from `_token` instead of a model. Every launched
    row must write its KV into a block its sequence alone holds, inside its table."""

    def __init__(self, sched, ahead: bool) -> None:
        self.sched, self.ahead, self.inflight = sched, ahead, None
        self.num_ahead = 0

    def _launch(self, out, offset: int):
        bm = self.sched.block_manager
        for s in out.scheduled:
            position = s.request.num_computed_tokens + offset
            assert position < len(s.block_ids) * BS, "no slot for the token"
            assert bm._blocks[s.block_ids[position // BS]].ref_count == 1, "a shared block written"
        return out, [_token(s.request.request_id, len(s.request.output_token_ids) + offset) for s in out.scheduled]

    def step(self):
        if self.inflight is None:
            out = self.sched.schedule()
            if out.is_empty:
                return []
            if not (self.ahead and 0 < out.num_steady == len(out.scheduled) and not out.blocks_to_copy):
                return self.sched.update_from_output(out, self._sync_result(out))
            self.inflight = self._launch(out, 0)
        (current, tokens), self.inflight = self.inflight, None
        ahead = self.sched.schedule_ahead()
        if ahead is not None:
            self.inflight = self._launch(ahead, 1)
            self.num_ahead += 1
        outputs = self.sched.update_from_output(current, ModelRunnerOutput(steady_token_ids=tokens))
        if self.inflight is not None and not self.sched.running:
            self.inflight = None
        return outputs

    def _sync_result(self, out) -> ModelRunnerOutput:
        result = ModelRunnerOutput()
        for k, s in enumerate(out.scheduled):
            if not s.num_samples:
                continue
            r = s.request
            tokens = [_token(r.request_id if s.num_samples == 1 else f"{r.request_id}#{j}", len(r.output_token_ids))
                      for j in range(s.num_samples)]
            if k < out.num_steady:
                result.steady_token_ids += tokens
            else:
                result.request_ids.append(r.request_id)
                result.token_ids.append(tokens)
                result.logprobs.append([None] * len(tokens))
        return result


BASE = list(range(5000, 5008))
# Prompts of at most 8 + 8 tokens, outputs of at most 13: a sequence's 28 computed positions fit
# the smallest pool, 7 blocks of 4 (with 14, one sequence alone could never finish).
spec = st.tuples(st.integers(0, 8), st.integers(1, 8), st.integers(1, 13), st.integers(1, 2),
                 st.integers(0, 2), st.integers(0, 8))


def _run(specs, ahead: bool, **config):
    sched = build(scheduler=AsyncScheduler, **config)
    loop = Loop(sched, ahead)
    texts: dict[tuple[str, int], list[int]] = {}
    reasons: dict[tuple[str, int], str] = {}
    last_arrival = max(s[5] for s in specs)
    for step in range(400):
        for k, (shared, tail, max_tokens, n, priority, arrival) in enumerate(specs):
            if arrival == step:
                prompt = BASE[:shared] + [100_000 * (k + 1) + i for i in range(tail)]
                sched.add_request(make_request(f"r{k}", prompt=prompt, n=n, priority=priority,
                                               max_tokens=max_tokens))
        if step > last_arrival and not sched.requests and loop.inflight is None:
            break
        for o in loop.step():
            key = (o.request_id, o.sample_index)
            assert key not in reasons, f"{key}: a token after its end"
            texts.setdefault(key, []).extend(o.new_token_ids)
            if o.finish_reason is not None:
                reasons[key] = o.finish_reason
    else:
        raise AssertionError(f"unfinished: {list(sched.requests)}")
    assert_drained(sched)
    return {key: (texts[key], reasons.get(key)) for key in texts}, loop.num_ahead


@settings(max_examples=120, deadline=None)
@given(num_blocks=st.integers(7, 12), budget=st.integers(4, 24), max_seqs=st.integers(1, 5),
       policy=st.sampled_from(["fcfs", "priority"]), specs=st.lists(spec, min_size=1, max_size=8),
       admission_steps=st.integers(0, 3))
def test_random_workloads_give_the_synchronous_loops_tokens(num_blocks, budget, max_seqs, policy, specs,
                                                           admission_steps):
    config = dict(num_blocks=num_blocks, budget=budget, max_seqs=max_seqs, policy=policy,
                  admission_steps=admission_steps)
    expected, _ = _run(specs, ahead=False, **config)
    got, _ = _run(specs, ahead=True, **config)
    assert got == expected


def test_the_random_workloads_do_go_ahead():
    specs = [(8, 4, 14, 1, 0, 0), (4, 6, 12, 1, 0, 0), (0, 3, 13, 1, 0, 2), (8, 2, 9, 2, 0, 1)]
    expected, _ = _run(specs, ahead=False, num_blocks=20, budget=24, max_seqs=5)
    got, num_ahead = _run(specs, ahead=True, num_blocks=20, budget=24, max_seqs=5)
    assert got == expected and num_ahead > 5
