"""Hypothesis against the public gRPC API of a real frontend and engine: every field of every
request, in and out of range. Each example must get INVALID_ARGUMENT or a well-formed answer;
afterwards the service still answers a normal request and every KV block is free again.

`pytest --long` runs many more examples (a release check)."""

from __future__ import annotations

import json
import math
import time

import grpc
import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings, strategies as st

from grpc_client import VOCAB_SIZE, collect, generate, greedy
from helpers import LONG
from http_client import assert_error_body, model_name, no_new_server_errors, sse_data
from common.v1 import generation_pb2 as gen, tokenization_pb2 as tok

pytestmark = pytest.mark.heavy(160)  # seconds on the 2-core CI machine: scheduled first

MAX_MODEL_LEN = 256  # small, so that any valid request ends quickly
INT32 = st.integers(-2**31, 2**31 - 1)
INT64 = st.integers(-2**63, 2**63 - 1)
# No subnormals: tests/conftest.py flushes them to zero for torch's speed on CPU.
FLOAT32 = st.floats(width=32, allow_nan=True, allow_infinity=True, allow_subnormal=False)
TEXT = st.text(max_size=60) | st.text(alphabet=st.characters(codec="utf-8"), max_size=400)
TOKEN_IDS = st.lists(st.integers(-5, VOCAB_SIZE + 5) | st.integers(0, 2**32 - 1) | INT64, max_size=40)
ROLES = st.sampled_from(["system", "user", "assistant"]) | st.text(max_size=12)


def sampling(wild: bool):
    """Every SamplingParams field, each unset or in range; with `wild`, also anywhere its wire
    type allows."""
    def field(small, any_value):
        return st.none() | small | any_value if wild else st.none() | small

    floats = lambda lo, hi: st.floats(lo, hi, allow_subnormal=False)  # noqa: E731
    return st.fixed_dictionaries({}, optional={
        "n": field(st.integers(1, 3), INT32),
        "temperature": field(floats(0, 2), FLOAT32),
        "top_p": field(floats(0.01, 1), FLOAT32),
        "top_k": field(st.integers(-1, 50), INT32),
        "min_p": field(floats(0, 1), FLOAT32),
        "seed": field(st.integers(0, 1000), INT64),
        "max_tokens": field(st.integers(1, 8), INT32),
        "min_tokens": field(st.integers(0, 1), INT32),
        "stop": st.lists(TEXT if wild else st.text(min_size=1, max_size=4), max_size=20 if wild else 3),
        "stop_token_ids": st.lists(st.integers(0, VOCAB_SIZE - 1) | (INT64 if wild else st.nothing()), max_size=5),
        "ignore_eos": st.booleans(),
        "logprobs": field(st.integers(0, 5), INT32),
        "presence_penalty": field(floats(-2, 2), FLOAT32),
        "frequency_penalty": field(floats(-2, 2), FLOAT32),
        "repetition_penalty": field(floats(0.5, 2), FLOAT32),
        # Only the wild examples draw these, so that the mostly valid ones stay those drawn before.
        **({"logit_bias": st.dictionaries(st.integers(0, VOCAB_SIZE - 1) | INT32, floats(-100, 100) | FLOAT32,
                                          max_size=4),
            "allowed_token_ids": st.lists(st.integers(0, VOCAB_SIZE - 1) | INT64, max_size=5),
            "bad_words": st.lists(st.text(alphabet="abc ", min_size=1, max_size=6) | TEXT, max_size=3)}
           if wild else {}),
    })


def inputs(wild: bool):
    text = TEXT if wild else st.text(min_size=1, max_size=100)
    ids = TOKEN_IDS if wild else st.lists(st.integers(0, VOCAB_SIZE - 1), min_size=1, max_size=40)
    roles = ROLES if wild else st.sampled_from(["system", "user", "assistant"])
    chats = st.lists(st.tuples(roles, text), min_size=0 if wild else 1, max_size=4)
    return st.one_of(
        st.builds(lambda t: {"text": t}, text),
        st.builds(lambda i: {"token_ids": gen.TokenIds(ids=i)}, ids),
        st.builds(lambda ms: {"chat": gen.Chat(messages=[gen.ChatMessage(role=r, content=c) for r, c in ms])}, chats),
        st.just({}) if wild else st.nothing(),  # no input at all
    )


OPTIONS = st.fixed_dictionaries({}, optional={
    "request_id": st.text(max_size=140) | st.from_regex(r"[a-z0-9]{1,8}", fullmatch=True),
    "skip_special_tokens": st.booleans(),
    "include_stop_str_in_output": st.booleans(),
    "priority": INT32,
    "add_special_tokens": st.booleans(),
    "time_limit_ms": st.integers(0, 2**32 - 1),
    # The constraint oneof: wild text, a few valid constraints, and known-bad ones. Several
    # keys at once: the last set wins, as protobuf's oneof does.
    "json_schema": st.text(max_size=40) | st.sampled_from(
        ['{"type": "object", "properties": {"a": {"enum": [1, 2]}}, "required": ["a"]}',
         '{"type": "bogus"}', '{"dependentSchemas": {}}', "[]", "true"]),
    "regex": st.text(max_size=20) | st.sampled_from(["[ab]{1,4}", "a(b", r"\\d{2}", "a{99999}{99999}"]),
    "choice": st.builds(lambda c: gen.Choices(choices=c), st.lists(st.text(max_size=8), max_size=4)),
    "grammar": st.text(max_size=30) | st.sampled_from(['start: "x" | "y"', "start: foo", "start: /[0-9]+/"]),
    "json_object": st.booleans(),
})


def examples(normal: int):
    """`normal` examples, 20 times as many with --long; derandomized in CI, so a run is
    repeatable, and random in the long mode, so release checks explore new ground."""
    return settings(max_examples=normal * (20 if LONG else 1), deadline=None, derandomize=not LONG,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@pytest.fixture(scope="module")
def fe(procs, tmp_path_factory):
    address = f"tcp://127.0.0.1:{procs.free_port()}"
    engine = procs.pagedserve("engine", "--address", address, "--dtype", "float32", "--num-kv-blocks", "256",
                              "--max-model-len", str(MAX_MODEL_LEN), "--num-threads", "1")
    procs.drain(engine)
    frontend = procs.start_frontend(address, "--data-dir", str(tmp_path_factory.mktemp("data")))
    frontend.wait_serving()
    yield frontend
    frontend.close()
    procs.stop(engine)


def still_healthy(fe) -> None:
    assert generate(fe, text="Hi", sampling=greedy(1)).finished[0].usage.completion_tokens == 1
    fe.wait_kv_free(timeout_s=10)


def build_request(sampling: dict, inputs: dict, options: dict) -> gen.GenerateRequest:
    options = dict(options)
    # A valid request without max_tokens still ends soon: a few steps are enough to check it.
    options.setdefault("time_limit_ms", 250)
    return gen.GenerateRequest(sampling=gen.SamplingParams(**{k: v for k, v in sampling.items() if v is not None}),
                               **inputs, **options)


def check_answer(messages: list[gen.GenerateResponse], req: gen.GenerateRequest) -> None:
    """A stream that was accepted: one Started, Chunks, a Finished per sample, usage in line."""
    r = collect(messages)
    n = req.sampling.n if req.sampling.HasField("n") else 1
    assert sorted(r.finished) == list(range(n))
    for i, f in r.finished.items():
        assert f.reason != gen.FINISH_REASON_UNSPECIFIED
        if req.sampling.HasField("max_tokens"):
            assert f.usage.completion_tokens <= req.sampling.max_tokens
        if req.sampling.HasField("logprobs"):
            assert sum(len(c.logprobs) for c in r.chunks.get(i, [])) == f.usage.completion_tokens
    if req.request_id:
        assert r.started.request_id == req.request_id


@given(sampling=sampling(wild=True), inputs=inputs(wild=True), options=OPTIONS)
@examples(normal=120)
def test_generate_fuzz(fe, sampling, inputs, options):
    generate_and_check(fe, sampling, inputs, options)


@given(sampling=sampling(wild=False), inputs=inputs(wild=False), options=OPTIONS)
@examples(normal=60)
def test_generate_fuzz_mostly_valid(fe, sampling, inputs, options):
    """In-range values only, so most requests run: their answers are checked in full."""
    generate_and_check(fe, sampling, inputs, options)


def generate_and_check(fe, sampling: dict, inputs: dict, options: dict) -> None:
    try:
        req = build_request(sampling, inputs, options)
    except (ValueError, TypeError):
        return  # the client library refuses it (e.g. a uint32 out of range): never sent
    try:
        check_answer(list(fe.generation.Generate(req, timeout=60)), req)
        event("answered")  # --hypothesis-show-statistics: how many were valid
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (e.code(), e.details(), req)
        assert e.details(), "an error must say what is wrong"
        event("INVALID_ARGUMENT: " + e.details().split(":")[0])
    still_healthy(fe)


@pytest.mark.parametrize("field", ["text", "chat.messages.content", "chat.messages.role", "stop", "request_id"])
def test_invalid_utf8_is_invalid_argument(fe, field):
    """Strings must be UTF-8 on the wire; a client built by hand may send anything."""
    marker = "\u00e9MARK"  # replaced by invalid bytes after serialization
    req = {"text": gen.GenerateRequest(text=marker),
           "chat.messages.content": gen.GenerateRequest(chat=gen.Chat(messages=[gen.ChatMessage(role="user", content=marker)])),
           "chat.messages.role": gen.GenerateRequest(chat=gen.Chat(messages=[gen.ChatMessage(role=marker, content="x")])),
           "stop": gen.GenerateRequest(text="Hi", sampling=gen.SamplingParams(stop=[marker])),
           "request_id": gen.GenerateRequest(request_id=marker, text="Hi")}[field]
    raw = req.SerializeToString().replace(marker.encode(), b"\xff\xfeMARK")
    call = fe.channel.unary_stream("/pagedserve.v1.Generation/Generate",
                                   response_deserializer=gen.GenerateResponse.FromString)
    with pytest.raises(grpc.RpcError) as info:
        list(call(raw, timeout=10))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value
    assert "UTF-8" in info.value.details()
    still_healthy(fe)


@given(text=TEXT, ids=TOKEN_IDS, skip=st.booleans() | st.none(), add_special=st.booleans() | st.none(),
       chat=st.lists(st.tuples(ROLES, TEXT), max_size=3))
@examples(normal=60)
def test_tokenization_fuzz(fe, text, ids, skip, add_special, chat):
    extra = {} if add_special is None else {"add_special_tokens": add_special}
    for req in (tok.TokenizeRequest(text=text, **extra),
                tok.TokenizeRequest(chat=gen.Chat(messages=[gen.ChatMessage(role=r, content=c) for r, c in chat]))):
        try:
            reply = fe.tokenization.Tokenize(req, timeout=30)
            assert len(reply.token_ids) == len(reply.tokens) > 0
            assert all(0 <= t < VOCAB_SIZE for t in reply.token_ids)
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (e.code(), e.details())
    try:
        detok = tok.DetokenizeRequest(token_ids=ids, **({} if skip is None else {"skip_special_tokens": skip}))
    except ValueError:
        return  # out of uint32: the client library refuses it
    try:
        reply = fe.tokenization.Detokenize(detok, timeout=30)
        assert all(0 <= t < VOCAB_SIZE for t in ids) and isinstance(reply.text, str)
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (e.code(), e.details())
        assert any(not 0 <= t < VOCAB_SIZE for t in ids)


@given(ids=st.lists(st.text(max_size=200), max_size=1100))
@examples(normal=40)
def test_abort_fuzz(fe, ids):
    try:
        reply = fe.generation.Abort(gen.AbortRequest(request_ids=ids), timeout=10)
        assert [r.request_id for r in reply.results] == ids
        assert all(r.status == gen.AbortResult.STATUS_NOT_FOUND for r in reply.results)
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and len(ids) > 1024, (e.code(), e.details())


def test_duplicate_and_absurd_values_together(fe):
    """A few hand-picked extremes, each alone: NaN and inf floats, absurd counts, huge prompts."""
    cases = [dict(sampling=gen.SamplingParams(temperature=math.nan)),
             dict(sampling=gen.SamplingParams(top_p=math.inf)),
             dict(sampling=gen.SamplingParams(n=10**9)),
             dict(sampling=gen.SamplingParams(logprobs=10**6)),
             dict(sampling=gen.SamplingParams(stop=["x"] * 1000)),
             dict(sampling=gen.SamplingParams(max_tokens=-1)),
             dict(sampling=gen.SamplingParams(seed=-5))]
    for case in cases:
        with pytest.raises(grpc.RpcError) as info:
            list(fe.generation.Generate(gen.GenerateRequest(text="Hi", **case), timeout=10))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, case
    with pytest.raises(grpc.RpcError) as info:
        list(fe.generation.Generate(gen.GenerateRequest(text="word " * 2000), timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "maximum length" in info.value.details()
    still_healthy(fe)


# -- structured output and tools over HTTP ---------------------------------------------------
# The HTTP fuzzers in test_http_reliability.py send any JSON in any field; these aim at the
# constraint and tool fields with values that are mostly meaningful, so the grammar, prompt
# and parser paths really run: each request gets a 4xx with an error body, or a well-formed
# answer (tool calls with JSON arguments); never a 500, and every KV block is free afterwards.

ANY_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=6),
                        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                                     max_size=3), max_leaves=5)


def mostly(valid):
    """`valid` five times in six, else any JSON: enough requests get through to be answered."""
    return st.integers(0, 5).flatmap(lambda k: ANY_JSON if k == 0 else valid)


SCHEMAS = mostly(st.sampled_from([
    {"type": "object"}, {"type": "object", "properties": {}},
    {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["a"]},
    {"type": "object", "properties": {"s": {"type": "string", "pattern": "^[a-c]{1,3}$"},
                                      "e": {"enum": ["x", "y"]}}, "required": ["s", "e"],
     "additionalProperties": False},
    {"type": "string", "maxLength": 3}, {"type": "objekt"}, {"type": "object", "dependentSchemas": {"a": {}}},
    {"type": "object", "properties": {"r": {"$ref": "#/$defs/R"}}, "$defs": {"R": {"type": "boolean"}}},
]))
NAMES = st.integers(0, 3).flatmap(lambda k: st.sampled_from(["f", "get_x", "g"]) if k else
                                   st.sampled_from(["a b", "", "x" * 65]) | st.text(max_size=5))
OPENAI_TOOLS = st.lists(mostly(st.fixed_dictionaries(
    {"type": mostly(st.just("function")),
     "function": st.fixed_dictionaries({"name": NAMES}, optional={"description": st.text(max_size=10),
                                                                  "parameters": SCHEMAS, "strict": st.booleans()})})),
    max_size=3)
OPENAI_TOOL_CHOICE = mostly(st.sampled_from(["none", "auto", "required"]) | st.builds(
    lambda n: {"type": "function", "function": {"name": n}}, NAMES))
RESPONSE_FORMATS = mostly(st.sampled_from([{"type": "text"}, {"type": "json_object"}]) | st.builds(
    lambda s: {"type": "json_schema", "json_schema": {"name": "x", "schema": s}}, SCHEMAS))
STRUCTURED_KINDS = {
    "json": SCHEMAS, "regex": st.sampled_from(["[a-c]{1,3}", "((", "x*", "<tool_call>"]),
    "choice": st.lists(st.text(max_size=3), max_size=3), "json_object": st.booleans(),
    "grammar": st.sampled_from(['start: "a" | "b"', 'start: %json {"type": "object"}', "start: ???",
                                'start: "<tool_call>\\n" %json {"type": "object", "properties": {"name": '
                                '{"const": "f"}, "arguments": {"type": "object"}}, "required": ["name", '
                                '"arguments"]} "\\n</tool_call>"'])}
STRUCTURED = mostly(st.one_of([st.fixed_dictionaries({kind: value}) for kind, value in STRUCTURED_KINDS.items()])
                    | st.fixed_dictionaries({}, optional=STRUCTURED_KINDS))  # none, or several: a 400
CHAT_FIELDS = {"response_format": RESPONSE_FORMATS, "structured_outputs": STRUCTURED, "tools": OPENAI_TOOLS,
               "tool_choice": OPENAI_TOOL_CHOICE, "parallel_tool_calls": mostly(st.booleans()),
               "stream": st.booleans(), "temperature": st.sampled_from([0, 1.0]),
               "messages": st.just([{"role": "user", "content": "Hi"}]) | st.just([
                   {"role": "user", "content": "Hi"},
                   {"role": "assistant", "content": None, "tool_calls": [
                       {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]},
                   {"role": "tool", "tool_call_id": "c", "content": "2"}])}
ANTHROPIC_TOOLS = st.lists(mostly(st.fixed_dictionaries({"name": NAMES, "input_schema": SCHEMAS},
                                                        optional={"description": st.text(max_size=10)})),
                           max_size=3)
ANTHROPIC_TOOL_CHOICE = mostly(st.fixed_dictionaries(
    {"type": st.sampled_from(["auto", "any", "tool", "none"])},
    optional={"name": NAMES, "disable_parallel_tool_use": st.booleans()}))
MESSAGES_FIELDS = {"tools": ANTHROPIC_TOOLS, "tool_choice": ANTHROPIC_TOOL_CHOICE, "stream": st.booleans(),
                   "temperature": st.sampled_from([0, 1.0]),
                   "messages": st.just([{"role": "user", "content": "Hi"}]) | st.just([
                       {"role": "user", "content": "Hi"},
                       {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]},
                       {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "2"}]}])}
RESPONSES_TOOLS = st.lists(mostly(st.fixed_dictionaries(
    {"type": mostly(st.just("function")), "name": NAMES},
    optional={"description": st.text(max_size=10), "parameters": SCHEMAS, "strict": st.booleans()})), max_size=3)
RESPONSES_TOOL_CHOICE = mostly(st.sampled_from(["none", "auto", "required"]) | st.builds(
    lambda n: {"type": "function", "name": n}, NAMES))
TEXT_FORMATS = mostly(st.sampled_from([{"type": "text"}, {"type": "json_object"}]) | st.builds(
    lambda s: {"type": "json_schema", "name": "x", "schema": s}, SCHEMAS))
CALL = {"type": "function_call", "call_id": "c", "name": "f", "arguments": '{"a": 1}'}
ITEMS = mostly(st.sampled_from([
    "Hi", [{"role": "user", "content": "Hi"}],
    [{"role": "developer", "content": [{"type": "input_text", "text": "Be brief."}]},
     {"role": "user", "content": "Hi"}],
    [{"role": "user", "content": "Hi"}, CALL, {"type": "function_call_output", "call_id": "c", "output": "2"}],
    [{"role": "user", "content": "Hi"}, {"type": "reasoning", "summary": [],
                                         "content": [{"type": "reasoning_text", "text": "Hm."}]}, CALL],
    [{"type": "function_call_output", "call_id": "c", "output": "2"}]]) | st.lists(ANY_JSON, max_size=3))
RESPONSES_FIELDS = {"tools": RESPONSES_TOOLS, "tool_choice": RESPONSES_TOOL_CHOICE, "input": ITEMS,
                    "text": st.builds(lambda f: {"format": f}, TEXT_FORMATS),
                    "parallel_tool_calls": mostly(st.booleans()),
                    "stream": st.booleans(), "temperature": st.sampled_from([0, 1.0]), "store": mostly(st.booleans()),
                    "background": mostly(st.booleans()), "instructions": mostly(st.text(max_size=10)),
                    "include": mostly(st.lists(st.sampled_from(["reasoning.encrypted_content",
                                                                  "message.output_text.logprobs"]), max_size=2))}
# Each route's field for the output's length, and its smallest conversation.
BASICS = {"/v1/chat/completions": ("max_tokens", {"messages": [{"role": "user", "content": "Hi"}]}),
          "/v1/messages": ("max_tokens", {"messages": [{"role": "user", "content": "Hi"}]}),
          "/v1/responses": ("max_output_tokens", {"input": "Hi"})}
ANSWERED: dict[str, int] = {}


@pytest.mark.parametrize("route,fields,normal", [("/v1/chat/completions", CHAT_FIELDS, 60),
                                                 ("/v1/messages", MESSAGES_FIELDS, 40),
                                                 ("/v1/responses", RESPONSES_FIELDS, 40)])
def test_structured_and_tools_fuzz(fe, route, fields, normal):
    model = model_name(fe)
    limit, basics = BASICS[route]

    @given(body=st.fixed_dictionaries({limit: st.integers(1, 12)}, optional=fields))
    @examples(normal)
    def fuzz(body):
        body = {"model": model, **basics, **body}
        with httpx.stream("POST", f"{fe.http_url}{route}", json=body, timeout=60) as r:
            r.read()
        assert r.status_code < 500, (r.status_code, r.text, body)
        event(f"{route} {r.status_code}")
        if r.status_code != 200:
            assert_error_body(r.json(), anthropic_shape=route == "/v1/messages")
        else:
            ANSWERED[route] = ANSWERED.get(route, 0) + 1
            check_http_answer(route, r)
        fe.wait_kv_free(timeout_s=10)
    with no_new_server_errors(fe):
        fuzz()
    assert ANSWERED.get(route, 0) >= normal // 8, f"too few valid requests: {ANSWERED}"
    still_healthy(fe)


def check_http_answer(route: str, r) -> None:
    if route == "/v1/responses":
        check_response(r)
        return
    if r.headers["content-type"].startswith("text/event-stream"):
        if route == "/v1/messages":
            assert "event: error" not in r.text and r.text.rstrip().endswith('"message_stop"}'), r.text[-300:]
        else:
            events = sse_data(r.text.splitlines())
            assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1]), events[-3:]
        return
    answer = r.json()
    if route == "/v1/messages":
        assert answer["content"] and all(b["type"] in ("text", "tool_use") for b in answer["content"])
        assert all(isinstance(b["input"], dict) for b in answer["content"] if b["type"] == "tool_use")
        return
    for choice in answer["choices"]:
        for call in choice["message"].get("tool_calls") or []:
            assert call["id"].startswith("call_") and isinstance(json.loads(call["function"]["arguments"]), dict)
        if choice["finish_reason"] == "tool_calls":
            assert choice["message"]["tool_calls"]


def check_response(r) -> None:
    """A Responses stream: events numbered from 0, ending complete; a whole answer: its items
    well-formed, each call's arguments a JSON object; a background one: queued."""
    if r.headers["content-type"].startswith("text/event-stream"):
        events = sse_data(r.text.splitlines())
        assert [e["sequence_number"] for e in events] == list(range(len(events))), events[-3:]
        assert events[-1]["type"] in ("response.completed", "response.incomplete"), events[-3:]
        answer = events[-1]["response"]
    else:
        answer = r.json()
    if answer["background"]:
        assert answer["status"] == "queued" and answer["output"] == []
        return
    assert answer["status"] in ("completed", "incomplete") and answer["output"]
    for item in answer["output"]:
        assert item["type"] in ("message", "function_call", "reasoning"), item
        if item["type"] == "function_call" and item["status"] == "completed":
            assert item["call_id"].startswith("call_") and isinstance(json.loads(item["arguments"]), dict)


# Batch jobs: an uploaded file of lines (good, malformed, or not JSON at all) and a batch over
# it, each field fuzzed. Every upload and create gets a 4xx with an error body or its object;
# every batch created ends (completed, or failed when its file is no batch), and its result
# files hold one JSON line per input line that was a request, named by its custom_id.
BATCH_URLS = ["/v1/chat/completions", "/v1/completions", "/v1/responses"]
BATCH_BODY = mostly(st.fixed_dictionaries({"max_tokens": st.integers(-1, 3)}, optional={
    "messages": mostly(st.just([{"role": "user", "content": "Hi"}])), "prompt": mostly(st.just("Hi")),
    "input": mostly(st.just("Hi")), "stream": st.booleans()}))
BATCH_LINE = mostly(st.fixed_dictionaries({"custom_id": st.text(max_size=4), "body": BATCH_BODY}, optional={
    "method": mostly(st.just("POST")), "url": mostly(st.sampled_from(BATCH_URLS))}))
BATCH_FILE = (st.lists(BATCH_LINE.map(lambda line: json.dumps(line)), max_size=4).map("\n".join)
              | st.text(max_size=40))
BATCH_FIELDS = {"endpoint": mostly(st.sampled_from(BATCH_URLS)), "completion_window": mostly(st.just("24h")),
                "metadata": mostly(st.dictionaries(st.text(max_size=4), st.text(max_size=4), max_size=2))}


def test_batch_fuzz(fe):
    created: list[str] = []

    @given(content=BATCH_FILE, purpose=mostly(st.just("batch")),
           fields=st.fixed_dictionaries({}, optional=BATCH_FIELDS))
    @examples(25)
    def fuzz(content, purpose, fields):
        files = {"file": ("in.jsonl", content.encode())}
        upload = httpx.post(f"{fe.http_url}/v1/files", data={"purpose": json.dumps(purpose)
                                                             if not isinstance(purpose, str) else purpose},
                            files=files, timeout=30)
        assert upload.status_code < 500, upload.text
        event(f"upload {upload.status_code}")
        if upload.status_code != 200:
            assert_error_body(upload.json())
            return
        body = {"input_file_id": upload.json()["id"], **fields}
        batch = httpx.post(f"{fe.http_url}/v1/batches", json=body, timeout=30)
        assert batch.status_code < 500, (batch.text, body)
        event(f"batch {batch.status_code}")
        if batch.status_code != 200:
            assert_error_body(batch.json())
        else:
            created.append(batch.json()["id"])
    with no_new_server_errors(fe):
        fuzz()
        assert created, "no batch was created"
        for batch_id in created:
            check_batch_ends(fe, batch_id)
    fe.wait_kv_free(timeout_s=10)
    still_healthy(fe)


def check_batch_ends(fe, batch_id: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while (batch := httpx.get(f"{fe.http_url}/v1/batches/{batch_id}").json())["status"] not in (
            "completed", "failed"):
        assert time.monotonic() < deadline, batch
        time.sleep(0.1)
    counts = batch["request_counts"]
    assert counts["completed"] + counts["failed"] == counts["total"], batch
    for key in ("output_file_id", "error_file_id"):
        if batch[key]:
            content = httpx.get(f"{fe.http_url}/v1/files/{batch[key]}/content").text
            for line in content.splitlines():
                result = json.loads(line)
                assert "custom_id" in result and (result["response"] is None) != (result["error"] is None), result
