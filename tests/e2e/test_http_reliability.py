"""The HTTP API under abuse, end to end: hypothesis fuzzing of every route's JSON, clients that
leave (streaming or not), a cancellation storm, and a SIGTERM drain. Throughout: never a 5xx,
every KV block free afterwards, and the server still answers.

`pytest --long` runs many more fuzz examples and a bigger storm (a release check)."""

from __future__ import annotations

import asyncio
import collections
import json
import random
import signal
import socket
import threading
import time
from dataclasses import dataclass

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from grpc_client import VOCAB_SIZE, wait_info
from helpers import LONG
from http_client import (assert_error_body, model_name, no_new_server_errors, post, server_errors, sse_data,
                         wait_metric)

pytestmark = pytest.mark.heavy(72)  # seconds on the 2-core CI machine: scheduled first

ACTIVE = 'pagedserve:active_streams{api="http"}'


@pytest.fixture(scope="module")
def model(frontend):
    return model_name(frontend)


@pytest.fixture(autouse=True)
def healthy_after(frontend, model):
    """After each test: a normal request works, every KV block is free, no stream is counted
    as active, and the log shows no 500 or crash."""
    with no_new_server_errors(frontend):
        yield
        r = post(frontend, "/v1/completions", {"model": model, "prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text
    frontend.wait_kv_free(timeout_s=15)
    assert wait_metric(frontend, ACTIVE, 0.0) == 0.0


# -- (a) fuzzing -----------------------------------------------------------------------------

def examples(normal: int):
    """`normal` examples, 20 times as many with --long; derandomized in CI, so a run is
    repeatable, and random in the long mode, so release checks explore new ground."""
    return settings(max_examples=normal * (20 if LONG else 1), deadline=None, derandomize=not LONG,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def floats(lo: float, hi: float):
    return st.floats(lo, hi, allow_subnormal=False)  # tests/conftest.py flushes subnormals to zero


# Any JSON value: what a broken client may put in any field, lone surrogates included (json.loads
# lets "\ud800" through). No subnormal floats: tests/conftest.py flushes them to zero.
SAFE_TEXT = st.text(max_size=30) | st.text(st.characters(codec="utf-8"), max_size=60)
TEXT = SAFE_TEXT | st.text(st.characters(categories=["Cs"]), min_size=1, max_size=2)


def json_values(text):
    return st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_subnormal=False) | text,
                        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text, inner, max_size=3),
                        max_leaves=6)


JSON = json_values(TEXT)
TAME_JSON = json_values(SAFE_TEXT)  # for unknown fields, which a lone surrogate would make a 400 too
# A wrong max_tokens, but never null nor a large valid number: every valid request ends in a few tokens.
WRONG_MAX_TOKENS = st.integers(max_value=0) | st.integers(min_value=100_000) | \
    JSON.filter(lambda v: v is not None and (isinstance(v, bool) or not isinstance(v, int)))
IDS = st.lists(st.integers(0, VOCAB_SIZE - 1), min_size=1, max_size=30)
PARTS = st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": SAFE_TEXT}), min_size=1, max_size=2)


def messages(roles: list[str]):
    return st.lists(st.fixed_dictionaries({"role": st.sampled_from(roles), "content": SAFE_TEXT | PARTS}),
                    min_size=1, max_size=3)


# Per route: each field's valid values (max_tokens bounded). The wrong ones are any JSON.
SAMPLING = {
    "n": st.integers(1, 3), "temperature": floats(0, 2), "top_p": floats(0.01, 1), "top_k": st.integers(-1, 50),
    "min_p": floats(0, 1), "seed": st.integers(0, 2**63 - 1), "stop": SAFE_TEXT | st.lists(SAFE_TEXT, max_size=3),
    "stop_token_ids": st.lists(st.integers(0, VOCAB_SIZE - 1), max_size=3), "presence_penalty": floats(-2, 2),
    "frequency_penalty": floats(-2, 2), "repetition_penalty": floats(0.5, 2), "min_tokens": st.integers(0, 1),
    "ignore_eos": st.booleans(), "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans(),
                                                          "continuous_usage_stats": st.booleans()}),
    "best_of": st.just(1), "logit_bias": st.just({}), "response_format": st.just({"type": "text"}),
    "user": SAFE_TEXT, "priority": st.integers(-5, 5), "prompt_logprobs": st.integers(0, 3),
    "skip_special_tokens": st.booleans(), "include_stop_str_in_output": st.booleans(), "request_id": SAFE_TEXT,
    "model": st.just("MODEL"),
}
FIELDS = {
    "/v1/completions": ({"prompt": SAFE_TEXT | IDS | st.lists(SAFE_TEXT, min_size=1, max_size=2)
                                   | st.lists(IDS, min_size=1, max_size=2), "max_tokens": st.integers(1, 4)},
                        {**SAMPLING, "echo": st.booleans(), "logprobs": st.integers(0, 5), "suffix": st.just(""),
                         "add_special_tokens": st.booleans()}),
    "/v1/chat/completions": ({"messages": messages(["system", "user", "assistant"]), "max_tokens": st.integers(1, 4)},
                             {**SAMPLING, "max_completion_tokens": st.integers(1, 4), "logprobs": st.booleans(),
                              "top_logprobs": st.integers(0, 5), "tools": st.just([]), "tool_choice": st.just("none"),
                              "add_generation_prompt": st.booleans(), "continue_final_message": st.just(False),
                              "chat_template_kwargs": st.dictionaries(SAFE_TEXT, TAME_JSON, max_size=2),
                              "add_special_tokens": st.booleans()}),
    "/v1/messages": ({"model": st.just("MODEL"), "messages": messages(["user", "assistant"]),
                      "max_tokens": st.integers(1, 4)},
                     {"system": SAFE_TEXT | PARTS, "stop_sequences": st.lists(SAFE_TEXT, max_size=3),
                      "stream": st.booleans(), "temperature": floats(0, 1), "top_p": floats(0.1, 1),
                      "top_k": st.integers(0, 20), "metadata": st.just({}), "tools": st.just([])}),
    "/tokenize": ([{"prompt": SAFE_TEXT}, {"messages": messages(["system", "user", "assistant"])}],  # one of them
                  {"add_special_tokens": st.booleans(), "add_generation_prompt": st.booleans(),
                   "model": st.just("MODEL")}),
    "/detokenize": ({"tokens": st.lists(st.integers(0, VOCAB_SIZE - 1), max_size=30)}, {"model": st.just("MODEL")}),
}


def wrong(name: str):
    return WRONG_MAX_TOKENS if name in ("max_tokens", "max_completion_tokens") else JSON


def bodies(route: str):
    """Out of ten bodies: four with all fields valid, three with one field any JSON, two with
    each field valid or any JSON (each may carry unknown fields), and one not an object."""
    required, optional = FIELDS[route]
    alternatives = required if isinstance(required, list) else [required]
    valid = st.one_of([st.fixed_dictionaries(r, optional=optional) for r in alternatives])
    every = {k: v for r in alternatives for k, v in r.items()} | optional
    names = sorted(every)
    one_wrong = st.builds(lambda d, field: {**d, field[0]: field[1]}, valid,
                          st.sampled_from(names).flatmap(lambda n: st.tuples(st.just(n), wrong(n))))
    any_wrong = st.fixed_dictionaries({k: v | wrong(k) for k, v in alternatives[0].items()},
                                      optional={k: v | wrong(k) for k, v in every.items() if k not in alternatives[0]})
    unknown = st.dictionaries(st.text(max_size=12).filter(lambda k: k not in names), TAME_JSON, max_size=2)
    kinds = [JSON] + [st.builds(lambda d, extra: {**extra, **d}, kind, unknown)
                      for kind in [valid] * 4 + [one_wrong] * 3 + [any_wrong] * 2]
    return st.integers(0, 9).flatmap(lambda k: kinds[k])


STATUSES = collections.defaultdict(collections.Counter)  # by route: how the fuzzed requests were answered
WHY = collections.defaultdict(collections.Counter)  # by route: the field each 4xx named


def send(fe, model: str, route: str, payload) -> None:
    """One fuzzed request: a 200 with a well-formed answer, or a 4xx with an error body."""
    if isinstance(payload, dict) and payload.get("model") == "MODEL":
        payload = {**payload, "model": model}
    raw = json.dumps(payload, allow_nan=True)  # NaN and Infinity too: Python's json reads them
    with httpx.stream("POST", f"{fe.http_url}{route}", content=raw.encode(),
                      headers={"content-type": "application/json"}, timeout=60) as r:
        r.read()
    assert r.status_code < 500, (r.status_code, r.text, raw)
    event(f"{route} {r.status_code}")
    STATUSES[route][r.status_code] += 1
    if r.status_code != 200:
        assert 400 <= r.status_code < 500, (r.status_code, r.text)
        error = assert_error_body(r.json(), anthropic_shape=route == "/v1/messages")
        WHY[route][error["message"].split(":")[0][:40]] += 1
        return
    if r.headers["content-type"].startswith("text/event-stream"):
        check_stream(route, r.text)
    else:
        answer = r.json()
        assert {"/tokenize": "tokens", "/detokenize": "prompt", "/v1/messages": "content"}.get(route, "choices") \
            in answer, answer


def check_stream(route: str, text: str) -> None:
    if route == "/v1/messages":
        kinds = [line[len("event: "):] for line in text.splitlines() if line.startswith("event: ")]
        assert kinds[0] == "message_start" and kinds[-1] == "message_stop", kinds
        return
    events = sse_data(text.splitlines())
    assert events and events[-1] == "[DONE]", events[-3:]
    assert not any(isinstance(e, dict) and "error" in e for e in events), events


@pytest.mark.parametrize("route,normal", [("/v1/completions", 60), ("/v1/chat/completions", 50),
                                          ("/v1/messages", 50), ("/tokenize", 50), ("/detokenize", 30)])
def test_fuzz_route(frontend, model, route, normal):
    @given(payload=bodies(route))
    @examples(normal)
    def fuzz(payload):
        send(frontend, model, route, payload)
    fuzz()
    answered = STATUSES[route][200]
    assert answered >= normal // 8, f"too few valid requests to test the answers: {dict(STATUSES[route])}, " \
                                    f"refused for {WHY[route].most_common(5)}"


# -- (b) clients that leave ------------------------------------------------------------------

LONG_BODIES = {
    "/v1/completions": {"prompt": "Once upon a time", "max_tokens": 400, "temperature": 0, "ignore_eos": True},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": 400,
                             "temperature": 0, "ignore_eos": True},
    # no ignore_eos in Anthropic's API: a count the model keeps going with
    "/v1/messages": {"messages": [{"role": "user", "content": "Count from 1 to 1000, separated by commas."},
                                  {"role": "assistant", "content": "1, 2, 3, 4, 5,"}],
                     "max_tokens": 400, "temperature": 0},
}


@pytest.mark.parametrize("route", LONG_BODIES)
def test_stream_disconnect_frees_kv(frontend, model, route):
    body = {**LONG_BODIES[route], "model": model, "stream": True}
    # a token has come: not the chat's role chunk, nor Anthropic's message_start
    token = {"/v1/completions": '"text"', "/v1/chat/completions": '"content": "',
             "/v1/messages": '"text_delta"'}[route]
    with httpx.stream("POST", f"{frontend.http_url}{route}", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()  # kept: a closed line iterator closes the stream
        next(line for line in lines if line.startswith("data: ") and token in line and '"content": ""' not in line)
        assert wait_info(frontend, lambda i: i.num_running == 1).num_running == 1
    left_at = time.monotonic()  # the connection is closed: the engine must stop at once
    frontend.wait_kv_free(timeout_s=5)
    assert time.monotonic() - left_at < 5
    assert wait_metric(frontend, ACTIVE, 0.0) == 0.0


def test_disconnect_mid_body_is_not_a_server_error(frontend):
    """A client that leaves while sending its body (the storm's cancels do) gets a 499 in the
    log, not a 500: Starlette raises ClientDisconnect from the body read. The autouse fixture
    checks that no 500 or crash was logged."""
    host, port = frontend.http_url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 500\r\n\r\n" + b'{"messages": [{"role": "user"')
        time.sleep(0.3)
    deadline = time.monotonic() + 5
    while not any("path=/v1/chat/completions status=499" in line for line in list(frontend.proc.log)):
        assert time.monotonic() < deadline, "no 499 line for the client that left mid-body"
        time.sleep(0.05)


@pytest.mark.parametrize("route", LONG_BODIES)
def test_non_streaming_disconnect_frees_kv(frontend, model, route):
    """A client that gives up on a non-streaming call (its read timeout) must not leave the
    generation running for nobody: the server watches for the disconnect."""
    outcome = {}

    def call() -> None:
        try:
            httpx.post(f"{frontend.http_url}{route}", json={**LONG_BODIES[route], "model": model},
                       timeout=httpx.Timeout(60, read=3))
            outcome["finished"] = True
        except httpx.ReadTimeout:
            outcome["left_at"] = time.monotonic()
    caller = threading.Thread(target=call)
    caller.start()
    running = wait_info(frontend, lambda i: i.num_running == 1, timeout_s=10)
    assert running.num_running == 1, running
    caller.join(30)
    assert "left_at" in outcome, outcome
    frontend.wait_kv_free(timeout_s=5)
    assert time.monotonic() - outcome["left_at"] < 5
    assert wait_metric(frontend, ACTIVE, 0.0) == 0.0
    deadline = time.monotonic() + 5  # one log line for it, with nginx's "client closed request"
    while not any(f"path={route} status=499" in line for line in list(frontend.proc.log)):
        assert time.monotonic() < deadline, "no status=499 log line"
        time.sleep(0.1)


# -- (c) a cancellation storm ----------------------------------------------------------------

NUM_REQUESTS = 1000 if LONG else 200
IN_FLIGHT = 32
FATES = ["complete"] * 70 + ["cancel_early"] * 10 + ["cancel_mid"] * 10 + ["cancel_waiting"] * 10


@dataclass
class Outcome:
    fate: str
    route: str
    stream: bool
    max_tokens: int
    status: int = 0
    tokens: int = -1  # completion tokens in the answer's usage
    finish_reason: str | None = None
    done: bool = False  # a stream's [DONE] arrived
    cancelled: bool = False


async def storm_request(client: httpx.AsyncClient, model: str, rng: random.Random) -> Outcome:
    fate, route = rng.choice(FATES), rng.choice(["/v1/completions", "/v1/chat/completions"])
    stream = fate == "cancel_mid" or (fate != "cancel_waiting" and rng.random() < 0.6)
    o = Outcome(fate, route, stream, rng.randint(2, 10))
    seeded = rng.random() < 0.5
    body = {"model": model, "max_tokens": o.max_tokens, "ignore_eos": True, "stream": stream,
            "temperature": 0.8 if seeded else 0, **({"seed": rng.randrange(1000)} if seeded else {})}
    if route == "/v1/completions":
        body["prompt"] = [rng.randrange(100, 40000) for _ in range(rng.randint(3, 40))]
    else:
        body["messages"] = [{"role": "user", "content": " ".join(rng.choice(["cat", "sky", "sea", "run", "blue"])
                                                                for _ in range(rng.randint(1, 20)))}]
    if stream:
        body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    task = asyncio.ensure_future(run_one(client, route, body, o, rng.randint(1, o.max_tokens - 1)))
    if fate in ("cancel_early", "cancel_waiting"):
        await asyncio.sleep(rng.uniform(0, 0.05) if fate == "cancel_early" else rng.uniform(0.05, 1.0))
        task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        o.cancelled = True
    return o


async def run_one(client: httpx.AsyncClient, route: str, body: dict, o: Outcome, cut_at: int) -> None:
    if not o.stream:
        r = await client.post(route, json=body)
        o.status = r.status_code
        if r.status_code == 200:
            answer = r.json()
            o.tokens, o.finish_reason = answer["usage"]["completion_tokens"], answer["choices"][0]["finish_reason"]
        return
    async with client.stream("POST", route, json=body) as r:
        o.status = r.status_code
        async for line in r.aiter_lines():
            [data] = sse_data([line]) or [None]
            if data == "[DONE]":
                o.done = True
            elif isinstance(data, dict):
                assert "error" not in data, data
                o.tokens = data["usage"]["completion_tokens"]
                for choice in data["choices"]:
                    o.finish_reason = choice["finish_reason"] or o.finish_reason
                if o.fate == "cancel_mid" and o.tokens >= cut_at:
                    o.cancelled = True
                    return  # leaves the stream half read: the connection closes


async def storm(fe, model: str, seed: int) -> list[Outcome]:
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=2 * IN_FLIGHT, max_keepalive_connections=IN_FLIGHT)
    async with httpx.AsyncClient(base_url=fe.http_url, limits=limits, timeout=120) as client:
        slots = asyncio.Semaphore(IN_FLIGHT)

        async def limited(r: random.Random) -> Outcome:
            async with slots:
                return await storm_request(client, model, r)
        return await asyncio.gather(*(limited(random.Random(rng.random())) for _ in range(NUM_REQUESTS)))


def test_cancellation_storm(frontend, model):
    outcomes = asyncio.run(storm(frontend, model, seed=0))
    fates = collections.Counter(o.fate for o in outcomes)
    assert sum(n for fate, n in fates.items() if fate != "complete") >= 0.25 * NUM_REQUESTS, fates
    for o in outcomes:
        full = o.status == 200 and o.tokens == o.max_tokens and o.finish_reason == "length" and (o.done or not o.stream)
        if o.fate == "complete":
            assert full and not o.cancelled, o
        else:  # cut off, or it had finished before the cut
            assert o.cancelled or full, o
        assert o.status in (0, 200), o  # never a 5xx (nor a 429: in flight stays under the limit)
    cut = [o for o in outcomes if o.fate != "complete" and o.cancelled]
    assert len(cut) >= 0.15 * NUM_REQUESTS, "too few cancels landed to call it a storm"
    info = frontend.wait_kv_free(timeout_s=15)
    assert info.num_running == 0 and info.num_waiting == 0
    assert httpx.get(f"{frontend.http_url}/health", timeout=10).status_code == 200
    assert wait_metric(frontend, f'pagedserve:num_requests_running{{model_name="{model}"}}', 0.0) == 0.0


# -- (d) SIGTERM drains HTTP streams ---------------------------------------------------------

DRAIN_TOKENS = 80  # seconds of decoding: the stream is still running while the drain is checked

def test_sigterm_drains_http(engine_address, procs, frontend, model):
    fe = procs.start_frontend(engine_address, "--drain-timeout-s", "60")
    try:
        fe.wait_serving()
        events, first = [], threading.Event()

        def read() -> None:
            body = {"model": model, "prompt": "Once upon a time", "max_tokens": DRAIN_TOKENS, "temperature": 0,
                    "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
            with httpx.stream("POST", f"{fe.http_url}/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    events.extend(sse_data([line]))
                    if events:
                        first.set()
        reader = threading.Thread(target=read)
        reader.start()
        assert first.wait(60), "no token came"
        fe.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        health = httpx.get(f"{fe.http_url}/health", timeout=10)
        assert_error_body(health.json(), "service_unavailable_error", "draining")
        assert health.status_code == 503
        refused = post(fe, "/v1/completions", {"model": model, "prompt": "Hi", "max_tokens": 2}, timeout=10)
        assert refused.status_code == 503
        assert_error_body(refused.json(), "service_unavailable_error", "shutting down")
        refused = post(fe, "/v1/messages", {"model": model, "max_tokens": 2,
                                            "messages": [{"role": "user", "content": "Hi"}]}, timeout=10)
        assert refused.status_code == 503 and refused.json()["type"] == "error"
        reader.join(60)
        assert not reader.is_alive(), "the stream did not end"
        assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == DRAIN_TOKENS, events[-3:]
        assert [c["finish_reason"] for e in events[:-2] for c in e["choices"]][-1] == "length"
        assert fe.proc.wait(30) == 0, procs.log_tail(fe.proc)
        assert not server_errors(fe), procs.log_tail(fe.proc)
    finally:
        fe.close()
