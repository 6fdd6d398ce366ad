"""gRPC end to end: cancellation, deadlines and Abort free the request's KV blocks; a reused
request id gets no stale tokens."""

from __future__ import annotations

import time

import grpc
import pytest

from grpc_client import FR, LONG, STORY, Background, cancel, collect, generate, greedy, request
from common.v1 import generation_pb2 as gen


# -- cancellation and deadlines -----------------------------------------------------------

def test_cancel_frees_blocks(frontend):
    call = frontend.generation.Generate(request(text=STORY, sampling=gen.SamplingParams(**LONG)), timeout=120)
    first, second = next(call), next(call)
    assert first.HasField("started") and second.HasField("chunk")
    next(call)
    running = frontend.server_info()
    assert running.num_running == 1 and running.kv_blocks_free < running.kv_blocks_total, running
    cancel(call)
    frontend.wait_kv_free(timeout_s=5)


def test_deadline_exceeded_frees_blocks(frontend):
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as info:
        list(frontend.generation.Generate(request(text=STORY, sampling=gen.SamplingParams(**LONG)), timeout=0.5))
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - started < 5
    frontend.wait_kv_free(timeout_s=5)


# -- Abort --------------------------------------------------------------------------------

def test_abort_rpc(frontend, limited_frontend):
    rid = "abort-me"
    stream = Background(frontend, request(rid, text=STORY, sampling=gen.SamplingParams(**LONG)), timeout=120)
    stream.wait_first_chunk()
    # ids are per frontend: another frontend does not know this one
    other = limited_frontend.generation.Abort(gen.AbortRequest(request_ids=[rid]), timeout=10)
    assert other.results[0].status == gen.AbortResult.STATUS_NOT_FOUND
    reply = frontend.generation.Abort(gen.AbortRequest(request_ids=[rid, "unknown-id"]), timeout=10)
    assert [(r.request_id, r.status) for r in reply.results] == [
        (rid, gen.AbortResult.STATUS_ABORTED), ("unknown-id", gen.AbortResult.STATUS_NOT_FOUND)]
    stream.join()
    assert stream.error is None, stream.error
    r = collect(stream.messages)
    assert r.started.request_id == rid
    assert r.finished[0].reason == FR.FINISH_REASON_ABORTED
    assert 0 < len(r.tokens[0]) < 400
    again = frontend.generation.Abort(gen.AbortRequest(request_ids=[rid]), timeout=10)
    assert [(r.request_id, r.status) for r in again.results] == [(rid, gen.AbortResult.STATUS_NOT_FOUND)]
    frontend.wait_kv_free(timeout_s=5)


def test_abort_all_samples_of_n(frontend):
    rid = "abort-n"
    sampling = gen.SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=400, ignore_eos=True)
    stream = Background(frontend, request(rid, text=STORY, sampling=sampling), timeout=120)
    stream.wait_first_chunk()
    reply = frontend.generation.Abort(gen.AbortRequest(request_ids=[rid]), timeout=10)
    assert reply.results[0].status == gen.AbortResult.STATUS_ABORTED
    stream.join()
    assert stream.error is None, stream.error
    r = collect(stream.messages)
    assert sorted(r.finished) == [0, 1]
    assert all(f.reason == FR.FINISH_REASON_ABORTED for f in r.finished.values())
    frontend.wait_kv_free(timeout_s=5)


def test_reused_request_id_gets_no_stale_tokens(frontend):
    reference = generate(frontend, text="The quick brown fox", sampling=greedy(8)).tokens[0]
    for trial in range(5):
        rid = f"reused-{trial}"
        call = frontend.generation.Generate(request(rid, text=STORY, sampling=gen.SamplingParams(**LONG)),
                                            timeout=120)
        next(call), next(call)
        frontend.generation.Abort(gen.AbortRequest(request_ids=[rid]), timeout=10)
        rest = list(call)
        assert rest[-1].finished.reason == FR.FINISH_REASON_ABORTED
        # the old stream is over (its id is free on the frontend); reuse the id right away
        r = generate(frontend, request_id=rid, text="The quick brown fox", sampling=greedy(8))
        frontend.wait_kv_free(timeout_s=5)
        assert r.tokens[0] == reference, f"trial {trial}: {r.tokens[0]} vs {reference}"
        assert r.finished[0].usage.completion_tokens == 8
