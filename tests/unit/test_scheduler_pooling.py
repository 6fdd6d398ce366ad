"""The scheduler with pooling requests (embed, score): each runs its whole prompt in one step,
never chunked, several share a step up to the token budget, and each ends in its step with its
vector and its blocks freed. Real scheduler and block manager; the runner's vectors are made up."""

from __future__ import annotations

from common.pooling_params import PoolingParams
from engine.outputs import ModelRunnerOutput
from engine.request import Request, RequestStatus
from unit.test_scheduler import build, make_request


def pooling_request(rid: str, prompt_len: int) -> Request:
    request = make_request(rid, prompt_len, max_tokens=1)
    request.pooling = PoolingParams()
    return request


def run_step(sched):
    """One step: the vector of each pooling request whose prompt ran is [its prompt length];
    a generation samples token 7."""
    out = sched.schedule()
    result = ModelRunnerOutput()
    for s in out.scheduled:
        if s.request.pooling is not None:
            result.pooled[s.request.request_id] = [float(s.num_new_tokens)]
        elif s.num_samples:
            result.request_ids.append(s.request.request_id)
            result.token_ids.append([7])
            result.logprobs.append([None])
    return out, sched.update_from_output(out, result)


def test_pooling_requests_share_a_step_up_to_the_budget_and_end_there():
    sched = build(num_blocks=64, budget=20)
    for rid, n in (("a", 8), ("b", 8), ("c", 8), ("d", 3)):
        sched.add_request(pooling_request(rid, n))
    out, outputs = run_step(sched)
    # a and b fit (16 tokens); c would be chunked: it waits, and d waits behind it (FCFS).
    assert [(s.request.request_id, s.num_new_tokens, s.num_samples) for s in out.scheduled] == [
        ("a", 8, 0), ("b", 8, 0)]
    assert [(o.request_id, o.finish_reason, o.pooled, o.new_token_ids) for o in outputs] == [
        ("a", "stop", [8.0], []), ("b", "stop", [8.0], [])]
    assert not sched.running and sched.block_manager.num_free_blocks == 64
    out, outputs = run_step(sched)
    assert [s.request.request_id for s in out.scheduled] == ["c", "d"]
    assert [o.pooled for o in outputs] == [[8.0], [3.0]]
    assert not sched.requests and not sched.running
    assert sched.block_manager.num_free_blocks == 64


def test_a_pooling_request_is_never_chunked():
    sched = build(num_blocks=64, budget=16)
    sched.add_request(make_request("gen", 10, max_tokens=4))  # a generation takes 10 of the 16
    sched.add_request(pooling_request("p", 12))
    out, _ = run_step(sched)
    assert [s.request.request_id for s in out.scheduled] == ["gen"]
    out, outputs = run_step(sched)  # the decode takes 1: the whole prompt fits now
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("gen", 1), ("p", 12)]
    assert [o.pooled for o in outputs if o.request_id == "p"] == [[12.0]]
    assert [r.request_id for r in sched.running] == ["gen"]  # the pooling request left with its step
    sched.remove_requests(["gen"], RequestStatus.FINISHED_ABORTED)
    assert sched.block_manager.num_free_blocks == 64
