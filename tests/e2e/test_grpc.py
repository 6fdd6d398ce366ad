"""End to end over gRPC: real engine and frontend processes on loopback, driven through the
generated stubs. Most tests share one engine and one frontend (module fixtures); every test
that generates ends by checking over GetServerInfo that every KV block is free again and
nothing runs. Tests that kill or stop processes start their own."""

from __future__ import annotations

import json
import math
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import jsonschema
import psutil
import pytest
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from grpc_client import (FR, GENERATION, LONG, MAX_MODEL_LEN, NOT_SERVING, SERVING, STORY, VOCAB_SIZE,
                         Background, cancel, collect, detokenize, generate, generate_error, greedy, names_field,
                         port_is_free, request, stop_across, user, wait_info)
from common.v1 import generation_pb2 as gen, info_pb2, tokenization_pb2 as tok


# -- fixtures --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def limited_frontend(engine_address, procs):
    """A second frontend on the shared engine that admits one stream at a time."""
    fe = procs.start_frontend(engine_address, "--max-concurrent-streams", "1")
    fe.wait_serving()
    yield fe
    fe.close()


# -- 1. streaming ----------------------------------------------------------------------------

def test_stream_started_chunks_finished_and_text_deltas(frontend):
    prompt = "def fibonacci(n):"
    r = generate(frontend, text=prompt, sampling=greedy(32, ignore_eos=True, logprobs=2))
    assert re.fullmatch(r"[A-Za-z0-9._:@=+-]{1,128}", r.started.request_id), r.started
    prompt_ids = frontend.tokenization.Tokenize(tok.TokenizeRequest(text=prompt), timeout=10).token_ids
    assert r.started.prompt_tokens == len(prompt_ids) > 0
    assert list(r.finished) == [0]
    f = r.finished[0]
    assert f.reason == FR.FINISH_REASON_LENGTH
    assert f.usage.completion_tokens == len(r.tokens[0]) == 32
    assert f.usage.prompt_tokens == len(prompt_ids)
    # the deltas concatenate exactly to the detokenized output, and it streamed in pieces
    assert r.texts[0] == detokenize(frontend, r.tokens[0])
    assert "\n" in r.texts[0]
    assert len(r.chunks[0]) >= 4, [c.token_ids for c in r.chunks[0]]
    # logprobs: one per token, the sampled (greedy) token is the most likely one
    for chunk in r.chunks[0]:
        assert len(chunk.logprobs) == len(chunk.token_ids)
        for token_id, lp in zip(chunk.token_ids, chunk.logprobs):
            assert lp.sampled.token_id == token_id and lp.sampled.logprob <= 0
            assert len(lp.top) == 2 and lp.top[0].token_id == token_id
            assert lp.top[0].logprob >= lp.top[1].logprob
    frontend.wait_kv_free()

    # a given request id is echoed; the greedy output does not change
    again = generate(frontend, request_id="my-req.1:x@y=z+w", text=prompt, sampling=greedy(32, ignore_eos=True))
    assert again.started.request_id == "my-req.1:x@y=z+w"
    assert again.tokens[0] == r.tokens[0]
    frontend.wait_kv_free()


def test_assigned_request_ids_are_unique(frontend):
    ids = {generate(frontend, text="Hi", sampling=greedy(1)).started.request_id for _ in range(3)}
    assert len(ids) == 3 and all(ids)
    frontend.wait_kv_free()


# -- 2. n > 1 --------------------------------------------------------------------------------

def test_n_samples_tagged_by_index_and_seeded(frontend):
    sampling = gen.SamplingParams(n=3, temperature=1.0, seed=1234, max_tokens=12, ignore_eos=True)
    first = generate(frontend, text="My favourite animal is", sampling=sampling)
    assert sorted(first.finished) == [0, 1, 2]
    assert sorted(first.chunks) == [0, 1, 2]
    for i in range(3):
        assert first.finished[i].reason == FR.FINISH_REASON_LENGTH
        assert len(first.tokens[i]) == 12
        assert first.texts[i] == detokenize(frontend, first.tokens[i])
    assert len({tuple(first.tokens[i]) for i in range(3)}) > 1, "the 3 samples are all the same"
    frontend.wait_kv_free()

    second = generate(frontend, text="My favourite animal is", sampling=sampling)
    assert second.tokens == first.tokens
    frontend.wait_kv_free()


# -- 3. chat ---------------------------------------------------------------------------------

def test_chat_answers(frontend):
    chat = user("What is the capital of France?")
    r = generate(frontend, chat=chat, sampling=greedy(32))
    assert "Paris" in r.texts[0], r.texts[0]
    assert r.finished[0].reason in (FR.FINISH_REASON_EOS, FR.FINISH_REASON_LENGTH)
    rendered = frontend.tokenization.Tokenize(tok.TokenizeRequest(chat=chat), timeout=10).token_ids
    assert r.started.prompt_tokens == len(rendered) > 16
    frontend.wait_kv_free()
    # the same prompt again: its full KV blocks come from the prefix cache
    again = generate(frontend, chat=chat, sampling=greedy(2))
    cached = again.started.cached_tokens
    assert 16 <= cached < len(rendered) and cached % 16 == 0, again.started
    assert again.finished[0].usage.cached_tokens == cached
    assert again.tokens[0] == r.tokens[0][:2]
    frontend.wait_kv_free()


# -- 4. stop strings -------------------------------------------------------------------------

@pytest.mark.parametrize("include", [False, True], ids=["excluded", "included"])
def test_stop_string_across_tokens(frontend, include):
    free = generate(frontend, text=STORY, sampling=greedy(24))
    ids, text = free.tokens[0], free.texts[0]
    assert len(ids) == 24 and text == detokenize(frontend, ids)
    stop, pos = stop_across(frontend, ids, first_boundary=6)

    r = generate(frontend, text=STORY, include_stop_str_in_output=include,
                 sampling=greedy(24, stop=["zzzz-never", stop]))
    f = r.finished[0]
    assert f.reason == FR.FINISH_REASON_STOP_STRING, f
    assert f.WhichOneof("matched_stop") == "stop_string" and f.stop_string == stop
    expected = text[:pos + len(stop)] if include else text[:pos]
    assert r.texts[0] == expected, (r.texts[0], stop)
    if not include:
        assert all(stop not in c.text for c in r.chunks.get(0, []))
        assert stop not in r.texts[0]
    assert r.tokens[0] == ids[:len(r.tokens[0])]
    assert len(r.tokens[0]) < 24
    frontend.wait_kv_free()


def test_stop_token_id(frontend):
    free = generate(frontend, text=STORY, sampling=greedy(24)).tokens[0]
    k = next(i for i in range(3, len(free)) if free[i] not in free[:i])  # first occurrence
    r = generate(frontend, text=STORY, sampling=greedy(24, stop_token_ids=[VOCAB_SIZE - 1, free[k]]))
    f = r.finished[0]
    assert f.reason == FR.FINISH_REASON_STOP_TOKEN and f.WhichOneof("matched_stop") == "stop_token_id"
    assert f.stop_token_id == free[k]
    assert r.tokens[0] == free[:k + 1]
    assert r.texts[0] == detokenize(frontend, r.tokens[0])
    frontend.wait_kv_free()


def test_multibyte_characters_are_never_split(frontend):
    """An emoji spans several byte-level tokens: no delta may carry half of it."""
    r = generate(frontend, chat=user("Write three emoji that describe happiness."), sampling=greedy(24))
    text = r.texts[0]
    assert text == detokenize(frontend, r.tokens[0])
    assert any(ord(ch) > 0xFFFF for ch in text), text  # the test means something only with one
    assert "\ufffd" not in text
    assert all("\ufffd" not in c.text for c in r.chunks[0]), [c.text for c in r.chunks[0]]
    assert any(c.token_ids and not c.text for c in r.chunks[0]), "nothing was held back"
    frontend.wait_kv_free()


# -- 5. the same tokens as the offline API ---------------------------------------------------

def test_greedy_matches_offline_llm(frontend):
    prompts = ["The capital of France is", "def fibonacci(n):", STORY]
    ours = [generate(frontend, text=p, sampling=greedy(24)) for p in prompts]
    frontend.wait_kv_free()

    from pagedserve import LLM, SamplingParams
    llm = LLM(model=None, dtype="float32", num_kv_blocks=64, max_model_len=MAX_MODEL_LEN, num_threads=1)
    params = SamplingParams(temperature=0, max_tokens=24)
    for prompt, r in zip(prompts, ours):
        offline = llm.generate(prompt, params)[0]
        assert r.started.prompt_tokens == len(offline.prompt_token_ids)
        assert r.tokens[0] == offline.outputs[0].token_ids, prompt
        assert r.texts[0] == offline.outputs[0].text


# -- 6. concurrent streams -------------------------------------------------------------------

def test_concurrent_streams_match_sequential(frontend):
    prompts = [f"Fact number {i}: the number {i * 7} is" for i in range(16)]
    sequential = [generate(frontend, text=p, sampling=greedy(8)).tokens[0] for p in prompts]
    frontend.wait_kv_free()
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda p: generate(frontend, text=p, sampling=greedy(8)), prompts))
    assert all(r.finished[0].reason in (FR.FINISH_REASON_LENGTH, FR.FINISH_REASON_EOS) for r in results)
    mismatched = [i for i, (r, want) in enumerate(zip(results, sequential)) if r.tokens[0] != want]
    assert not mismatched, [(prompts[i], results[i].tokens[0], sequential[i]) for i in mismatched]
    frontend.wait_kv_free()


# -- 7. cancellation and deadlines -----------------------------------------------------------

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


# -- 8. Abort --------------------------------------------------------------------------------

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


# -- 8b. structured output ---------------------------------------------------------------------

ITEM = {"type": "object", "additionalProperties": False, "required": ["sku", "qty", "colour"],
        "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
                       "qty": {"type": "integer", "minimum": 1, "maximum": 99},
                       "colour": {"enum": ["red", "green", "blue"]},
                       "notes": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 2}}}


def test_constraints_hold_for_every_sample(frontend):
    r = generate(frontend, text="An order line as JSON:", json_schema=json.dumps(ITEM),
                 sampling=gen.SamplingParams(n=4, temperature=1.0, seed=5, max_tokens=120))
    for i in range(4):
        jsonschema.validate(json.loads(r.texts[i]), ITEM)
        assert r.finished[i].reason == FR.FINISH_REASON_EOS  # the grammar's end, as eos would be
    r = generate(frontend, text="Sentiment of 'meh':", choice=gen.Choices(choices=["good", "bad", "meh"]),
                 sampling=gen.SamplingParams(n=3, temperature=1.5, seed=1, max_tokens=8))
    assert all(r.texts[i] in ("good", "bad", "meh") for i in range(3))
    r = generate(frontend, text="A date:", regex=r"20[0-9]{2}-[01][0-9]-[0-3][0-9]", sampling=greedy(16))
    assert re.fullmatch(r"20[0-9]{2}-[01][0-9]-[0-3][0-9]", r.texts[0])
    info = frontend.wait_kv_free()
    assert info.num_running == 0 and info.num_waiting == 0


# -- 9. validation and status codes ----------------------------------------------------------

def _sampling(**kwargs) -> dict:
    return dict(text="Hello", sampling=gen.SamplingParams(**kwargs))


BAD_REQUESTS = {
    "temperature-negative": ("temperature", _sampling(temperature=-1)),
    "temperature-nan": ("temperature", _sampling(temperature=math.nan)),
    "temperature-huge": ("temperature", _sampling(temperature=1e9)),
    "top_p-zero": ("top_p", _sampling(top_p=0)),
    "top_k-negative": ("top_k", _sampling(top_k=-5)),
    "min_p-above-1": ("min_p", _sampling(min_p=1.5)),
    "n-zero": ("n", _sampling(n=0)),
    "n-1000": ("n", _sampling(n=1000)),
    "max_tokens-zero": ("max_tokens", _sampling(max_tokens=0)),
    "logprobs-50": ("logprobs", _sampling(logprobs=50)),
    "min_tokens-over-max": ("min_tokens", _sampling(max_tokens=5, min_tokens=10)),
    "repetition_penalty-zero": ("repetition_penalty", _sampling(repetition_penalty=0)),
    "presence_penalty-5": ("presence_penalty", _sampling(presence_penalty=5)),
    "frequency_penalty--3": ("frequency_penalty", _sampling(frequency_penalty=-3)),
    "seed-negative": ("seed", _sampling(seed=-1)),
    "too-many-stop-strings": ("stop", _sampling(stop=[f"s{i}" for i in range(17)])),
    "empty-stop-string": ("stop", _sampling(stop=[""])),
    "stop_token_ids-negative": ("stop_token_ids", _sampling(stop_token_ids=[-1])),
    "stop_token_ids-vocab": ("stop_token_ids", _sampling(stop_token_ids=[VOCAB_SIZE])),
    "empty-text": ("text", dict(text="")),
    "no-input": ("input", dict()),
    "token_ids-negative": ("token_ids", dict(token_ids=gen.TokenIds(ids=[1, -1]))),
    "token_ids-vocab": ("token_ids", dict(token_ids=gen.TokenIds(ids=[1, VOCAB_SIZE]))),
    "token_ids-empty": ("token_ids|prompt", dict(token_ids=gen.TokenIds())),
    "over-max_model_len": ("max_tokens", dict(token_ids=gen.TokenIds(ids=[1] * 2000),
                                              sampling=gen.SamplingParams(max_tokens=100))),
    "chat-unknown-role": ("role", dict(chat=gen.Chat(messages=[gen.ChatMessage(role="wizard", content="hi")]))),
    "chat-no-messages": ("chat", dict(chat=gen.Chat())),
    "request_id-slash": ("request_id", dict(request_id="a/b", text="Hello")),
    "request_id-300": ("request_id", dict(request_id="x" * 300, text="Hello")),
    "request_id-space": ("request_id", dict(request_id="a b", text="Hello")),
    "regex-invalid": ("regex", dict(text="Hi", regex="a(b")),
    "json_schema-not-json": ("json", dict(text="Hi", json_schema="{nope")),
    "json_schema-unsupported-keyword": ("dependentSchemas", dict(text="Hi", json_schema='{"dependentSchemas": {}}')),
    "grammar-invalid": ("grammar", dict(text="Hi", grammar="start: undefined_rule")),
    "choice-empty": ("choice", dict(text="Hi", choice=gen.Choices())),
    "json_object-false": ("json_object", dict(text="Hi", json_object=False)),
}


@pytest.mark.parametrize("field,kwargs", list(BAD_REQUESTS.values()), ids=list(BAD_REQUESTS))
def test_invalid_generate_requests(frontend, field, kwargs):
    error = generate_error(frontend, gen.GenerateRequest(**kwargs))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (error.code(), error.details())
    assert any(names_field(error.details(), f) for f in field.split("|")), error.details()


def test_invalid_requests_leave_nothing_behind(frontend):
    info = frontend.wait_kv_free()
    assert info.num_running == 0 and info.num_waiting == 0


def test_duplicate_running_request_id(frontend):
    rid = "dup-id"
    stream = Background(frontend, request(rid, text=STORY, sampling=gen.SamplingParams(**LONG)), timeout=120)
    stream.wait_first_chunk()
    error = generate_error(frontend, request(rid, text="Hello", sampling=greedy(4)))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and names_field(error.details(), "request_id")
    # the original stream is untouched and keeps going
    seen = len(stream.messages)
    deadline = time.monotonic() + 10
    while len(stream.messages) <= seen + 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert stream.thread.is_alive() and len(stream.messages) > seen + 2
    stream.call.cancel()
    stream.join()
    assert stream.error is not None and stream.error.code() == grpc.StatusCode.CANCELLED
    assert all(m.WhichOneof("kind") != "finished" for m in stream.messages)
    frontend.wait_kv_free(timeout_s=5)


def test_tokenize_and_detokenize(frontend):
    text = "Hello world, déjà vu!"
    reply = frontend.tokenization.Tokenize(tok.TokenizeRequest(text=text), timeout=10)
    assert len(reply.token_ids) == len(reply.tokens) > 2
    assert all(0 <= t < VOCAB_SIZE for t in reply.token_ids)
    assert detokenize(frontend, reply.token_ids) == text
    # special tokens: kept or skipped on request
    with_eos = list(reply.token_ids) + [2]
    assert detokenize(frontend, with_eos) == text
    assert detokenize(frontend, with_eos, skip_special_tokens=False) == text + "<|im_end|>"
    chat = frontend.tokenization.Tokenize(tok.TokenizeRequest(chat=user("Hi")), timeout=10)
    assert "user" in detokenize(frontend, chat.token_ids, skip_special_tokens=False)


@pytest.mark.parametrize("call,field", [
    (lambda fe: fe.tokenization.Tokenize(tok.TokenizeRequest(text=""), timeout=10), "text"),
    (lambda fe: fe.tokenization.Tokenize(tok.TokenizeRequest(), timeout=10), "input"),
    (lambda fe: fe.tokenization.Tokenize(tok.TokenizeRequest(chat=gen.Chat(messages=[
        gen.ChatMessage(role="robot", content="x")])), timeout=10), "role"),
    (lambda fe: fe.tokenization.Detokenize(tok.DetokenizeRequest(token_ids=[5, -1]), timeout=10), "token_ids"),
    (lambda fe: fe.tokenization.Detokenize(tok.DetokenizeRequest(token_ids=[VOCAB_SIZE]), timeout=10),
     "token_ids"),
], ids=["tokenize-empty-text", "tokenize-no-input", "tokenize-bad-role", "detokenize-negative",
        "detokenize-vocab"])
def test_tokenization_errors(frontend, call, field):
    with pytest.raises(grpc.RpcError) as info:
        call(frontend)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert names_field(info.value.details(), field), info.value.details()


def test_resource_exhausted_when_streams_are_full(frontend, limited_frontend):
    stream = Background(limited_frontend, request(text=STORY, sampling=gen.SamplingParams(**LONG)), timeout=120)
    stream.wait_first_chunk()
    error = generate_error(limited_frontend, request(text="Hello", sampling=greedy(2)))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error
    # the limit is per frontend: the other one still serves
    assert generate(frontend, text="Hello", sampling=greedy(2)).finished[0].usage.completion_tokens == 2
    stream.call.cancel()
    stream.join()
    # the slot frees once the stream is gone
    deadline = time.monotonic() + 5
    while True:
        try:
            r = generate(limited_frontend, text="Hello", sampling=greedy(2))
            break
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and time.monotonic() < deadline, e
            time.sleep(0.1)
    assert r.finished[0].usage.completion_tokens == 2
    limited_frontend.wait_kv_free(timeout_s=5)


def test_unavailable_without_engine(procs):
    fe = procs.start_frontend(f"tcp://127.0.0.1:{procs.free_port()}")
    try:
        assert fe.health_status("") == SERVING
        assert fe.health_status(GENERATION) == NOT_SERVING
        error = generate_error(fe, request(text="Hello", sampling=greedy(2)))
        assert error.code() == grpc.StatusCode.UNAVAILABLE
        for rpc in (lambda: fe.tokenization.Tokenize(tok.TokenizeRequest(text="Hi"), timeout=5),
                    lambda: fe.info.GetModelInfo(info_pb2.GetModelInfoRequest(), timeout=5),
                    lambda: fe.server_info()):
            with pytest.raises(grpc.RpcError) as info:
                rpc()
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert fe.health_status(GENERATION) == NOT_SERVING
    finally:
        fe.close()


# -- 10. engine killed and restarted ---------------------------------------------------------

def test_engine_kill_and_restart(procs):
    address = f"tcp://127.0.0.1:{procs.free_port()}"
    engine = procs.start_engine(address)
    fe = procs.start_frontend(address)
    new_engine = None
    try:
        fe.wait_serving()
        old_engine_id = fe.server_info().engines[0].id
        stream = Background(fe, request(text=STORY, sampling=gen.SamplingParams(**LONG)), timeout=120)
        stream.wait_first_chunk()
        killed_at = time.monotonic()
        engine.send_signal(signal.SIGKILL)
        engine.wait(10)
        stream.join(timeout_s=15)
        assert stream.error is not None and stream.error.code() == grpc.StatusCode.UNAVAILABLE, stream.error
        assert stream.ended_at - killed_at < 8, stream.ended_at - killed_at
        assert all(m.WhichOneof("kind") != "finished" for m in stream.messages)
        fe.wait_serving(False, timeout_s=5)
        assert fe.health_status("") == SERVING
        error = generate_error(fe, request(text="Hello", sampling=greedy(2)))
        assert error.code() == grpc.StatusCode.UNAVAILABLE

        new_engine = procs.start_engine(address)
        fe.wait_serving(timeout_s=120)
        r = generate(fe, text="The capital of France is", sampling=greedy(4))
        assert r.finished[0].usage.completion_tokens == 4 and "Paris" in r.texts[0]
        info = fe.wait_kv_free()
        assert info.engines[0].id != old_engine_id
    finally:
        fe.close()
        procs.stop(engine)
        if new_engine is not None:
            procs.stop(new_engine)


# -- a frontend going away ------------------------------------------------------------------

@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_frontend_gone_frees_its_requests(frontend, procs, engine_address, sig):
    """A stopped frontend (no drain time) says Bye on the way out and the engine aborts its
    requests; a killed one is forgotten by the engine after 10 s of silence (engine/proc.py
    FRONTEND_TIMEOUT_S). Either way the blocks come back, seen from another frontend."""
    doomed = procs.start_frontend(engine_address, "--drain-timeout-s", "0")
    try:
        doomed.wait_serving()
        stream = Background(doomed, request(text=STORY, sampling=gen.SamplingParams(**LONG)), timeout=120)
        stream.wait_first_chunk()
        busy = wait_info(frontend, lambda i: i.num_running == 1 and i.kv_blocks_free < i.kv_blocks_total)
        assert busy.num_running == 1, busy
        gone_at = time.monotonic()
        doomed.proc.send_signal(sig)
        doomed.proc.wait(20)
        stream.join()
        assert stream.error is not None
        # SIGTERM: well before the engine's 10 s silence timeout, so the frontend said so
        frontend.wait_kv_free(timeout_s=7 if sig == signal.SIGTERM else 16)
        assert time.monotonic() - gone_at < (8 if sig == signal.SIGTERM else 16)
    finally:
        doomed.close()
    # the engine forgot the gone frontend when it aborted its requests
    deadline = time.monotonic() + 5
    while doomed.address in {p.address for p in frontend.server_info().frontends}:
        assert time.monotonic() < deadline, "the engine still lists the gone frontend"
        time.sleep(0.5)


# -- 11. two frontends on one engine ---------------------------------------------------------

def test_two_frontends_share_one_engine(frontend, limited_frontend, engine_address):
    jobs = [(frontend, "The capital of France is"), (limited_frontend, "def fibonacci(n):")]
    sequential = [generate(fe, text=p, sampling=greedy(12)).tokens[0] for fe, p in jobs]
    # at the same time, and with the same request id: ids are namespaced per frontend
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(generate, fe, request_id="same-id", text=p, sampling=greedy(12)) for fe, p in jobs]
        results = [f.result() for f in futures]
    for r, want in zip(results, sequential):
        assert r.started.request_id == "same-id"
        assert r.tokens[0] == want
    assert results[0].tokens[0] != results[1].tokens[0]
    addresses = {frontend.address, limited_frontend.address}
    for fe, _ in jobs:
        info = fe.wait_kv_free()
        assert addresses <= {p.address for p in info.frontends}, info
        assert len({p.id for p in info.frontends if p.address in addresses}) == 2
        assert [e.address for e in info.engines] == [engine_address]
    assert frontend.server_info().engines[0].id == limited_frontend.server_info().engines[0].id != ""


# -- 12. model info and reflection -----------------------------------------------------------

def test_model_info_and_reflection(frontend):
    info = frontend.info.GetModelInfo(info_pb2.GetModelInfoRequest(), timeout=10)
    assert "SmolLM2-135M-Instruct" in info.model_name
    assert info.architecture == "llama"
    assert info.max_model_len == MAX_MODEL_LEN
    assert info.vocab_size == VOCAB_SIZE
    assert list(info.eos_token_ids) == [2]
    assert info.dtype == "float32"
    server = frontend.server_info()
    assert server.block_size == 16 and server.kv_blocks_total == 512 and server.version

    db = ProtoReflectionDescriptorDatabase(frontend.channel)
    services = set(db.get_services())
    assert {"pagedserve.v1.Generation", "pagedserve.v1.Tokenization", "pagedserve.v1.Info",
            "grpc.health.v1.Health"} <= services, services
    service = DescriptorPool(db).FindServiceByName("pagedserve.v1.Generation")
    assert {m.name for m in service.methods} == {"Generate", "Abort"}
    assert service.methods_by_name["Generate"].output_type.full_name == "pagedserve.v1.GenerateResponse"


# -- max_tokens left unset -------------------------------------------------------------------

def test_unset_max_tokens_is_not_16(frontend):
    learned = generate(frontend, text=STORY, sampling=greedy(30))
    assert learned.finished[0].reason == FR.FINISH_REASON_LENGTH  # no eos in the first 30 tokens
    stop, pos = stop_across(frontend, learned.tokens[0], first_boundary=20)
    r = generate(frontend, text=STORY, sampling=gen.SamplingParams(temperature=0, stop=[stop]))
    frontend.wait_kv_free()
    assert r.finished[0].reason == FR.FINISH_REASON_STOP_STRING, r.finished[0]
    assert r.texts[0] == learned.texts[0][:pos]


# -- 13. `pagedserve serve` ------------------------------------------------------------------

def test_serve_runs_both_and_stops_both_on_sigterm(procs):
    engine_port = procs.free_port()
    proc = procs.pagedserve("serve", "--grpc-port", "0", "--http-port", "0", "--engine-address", f"tcp://127.0.0.1:{engine_port}",
                            "--dtype", "float32", "--num-kv-blocks", "64", "--max-model-len", "1024",
                            "--num-threads", "1")
    children: list[psutil.Process] = []
    try:
        fe = procs.Frontend(proc, procs.read_grpc_address(proc))
        children = psutil.Process(proc.pid).children(recursive=True)
        assert children, "serve started no engine process"
        fe.wait_serving(timeout_s=120)
        assert not port_is_free(engine_port)
        r = generate(fe, text="The capital of France is", sampling=greedy(4))
        assert "Paris" in r.texts[0]
        info = fe.wait_kv_free()
        assert info.kv_blocks_total == 64
        assert fe.info.GetModelInfo(info_pb2.GetModelInfoRequest(), timeout=10).max_model_len == 1024
        fe.channel.close()

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, procs.log_tail(proc)
        gone, alive = psutil.wait_procs(children, timeout=20)
        assert not alive, f"left running: {alive}"
        deadline = time.monotonic() + 10
        while not port_is_free(engine_port):
            assert time.monotonic() < deadline, "the engine port is still bound"
            time.sleep(0.2)
    finally:
        if proc.poll() is None:  # failed half way: take its engine down with it
            children += psutil.Process(proc.pid).children(recursive=True)
        procs.stop(proc)
        for child in children:
            if child.is_running():
                child.kill()
