"""Scheduler.schedule_ahead (async scheduling): when a step may be scheduled while the one
before is still running, and what it does at a block boundary. The engine-level equality with
the synchronous engine is in tests/engine/test_async_scheduling.py."""

from __future__ import annotations

from test_scheduler import BS, FakeRunner, make, make_request  # noqa: F401  (make: a fixture)

from engine.outputs import ModelRunnerOutput


def _decoding(make, num: int, prompt_len: int = 2, **kwargs):
    sched, runner = make(**kwargs)
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


def test_no_step_ahead_for_a_request_that_is_not_a_steady_decode(make):
    sched, runner = make()
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
