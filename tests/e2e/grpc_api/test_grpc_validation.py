"""gRPC end to end: every invalid request gets INVALID_ARGUMENT naming its field and leaves
nothing behind; tokenization and its errors; RESOURCE_EXHAUSTED and UNAVAILABLE; model info
and reflection."""

from __future__ import annotations

import math
import time

import grpc
import pytest
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from grpc_client import (GENERATION, LONG, MAX_MODEL_LEN, NOT_SERVING, SERVING, STORY, VOCAB_SIZE, Background,
                         detokenize, generate, generate_error, greedy, names_field, request, user)
from common.v1 import generation_pb2 as gen, info_pb2, tokenization_pb2 as tok


# -- validation and status codes ----------------------------------------------------------

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
    "logit_bias-vocab": ("logit_bias", _sampling(logit_bias={VOCAB_SIZE: 1.0})),
    "logit_bias-negative-id": ("logit_bias", _sampling(logit_bias={-3: 1.0})),
    "logit_bias-150": ("logit_bias", _sampling(logit_bias={5: 150.0})),
    "allowed_token_ids-vocab": ("allowed_token_ids", _sampling(allowed_token_ids=[5, VOCAB_SIZE])),
    "bad_words-blank": ("bad_words", _sampling(bad_words=["  "])),
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


# -- model info and reflection -----------------------------------------------------------

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
