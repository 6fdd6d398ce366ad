"""The HTTP API's errors, end to end: every bad request gets its status and OpenAI's body
{"error": {"message", "type", "param", "code"}} with a message that names the problem, the
official SDKs raise their typed errors, and nothing is ever a 500. Also --api-key (401), a full
house (429 + Retry-After) and a frontend without an engine (503)."""

from __future__ import annotations

import asyncio
import copy
import time

import anthropic
import httpx
import openai
import pytest

from http_client import kv_free_after, model  # noqa: F401 - shared fixtures
from http_client import (ERROR_KEYS, anthropic_client, assert_error, openai_client,
                         post, server_errors)

BAD = "invalid_request_error"
LONG_STREAM = {"prompt": "Once upon a time", "max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": True}


@pytest.fixture(scope="module")
def keyed(servers):
    """A second frontend on the same engine that wants an API key."""
    return servers.frontend("--api-key", "secret")


@pytest.fixture(scope="module")
def limited(limited_frontend):
    return limited_frontend


@pytest.fixture(scope="module")
def orphan(procs):
    """A frontend whose engine never comes."""
    fe = procs.start_frontend(f"tcp://127.0.0.1:{procs.free_port()}")
    yield fe
    fe.close()


# -- bad bodies, raw -------------------------------------------------------------------------

CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
COMPLETION = {"prompt": "Hi", "max_tokens": 2}
# (route, body, words the message must hold, the param it names)
BAD_BODIES = {
    "malformed JSON": ("/v1/completions", b'{"prompt": "Hi",', ["not valid JSON"], "body"),
    "empty body": ("/v1/chat/completions", b"", ["not valid JSON"], "body"),
    "JSON array": ("/v1/completions", b'[{"prompt": "Hi"}]', ["JSON object"], "body"),
    "JSON string": ("/v1/messages", b'"hello"', ["JSON object"], "body"),
    "nested too deep": ("/v1/completions", b'{"prompt": ' + b"[" * 20000 + b"]" * 20000 + b"}", ["nested"], "body"),
    "temperature type": ("/v1/completions", {**COMPLETION, "temperature": "hot"}, ["temperature"], "temperature"),
    "temperature range": ("/v1/completions", {**COMPLETION, "temperature": -1}, ["temperature", "-1"], "temperature"),
    "n range": ("/v1/completions", {**COMPLETION, "n": 0}, ["n: "], "n"),
    "top_p range": ("/v1/chat/completions", {**CHAT, "top_p": 2}, ["top_p"], "top_p"),
    "max_tokens range": ("/v1/completions", {**COMPLETION, "max_tokens": 0}, ["max_tokens"], "max_tokens"),
    "best_of": ("/v1/completions", {**COMPLETION, "best_of": 2}, ["best_of"], "best_of"),
    "response_format type": ("/v1/completions", {**COMPLETION, "response_format": {"type": "xml"}},
                             ["response_format.type", "xml"], "response_format.type"),
    "json_schema without schema": ("/v1/chat/completions",
                                   {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
                                   ["response_format.json_schema.schema"], "response_format.json_schema.schema"),
    "invalid schema": ("/v1/chat/completions", {**CHAT, "response_format": {
                           "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
                       ["response_format.json_schema.schema", "objekt"], "response_format.json_schema.schema"),
    "unsupported schema keyword": ("/v1/completions", {**COMPLETION, "structured_outputs": {
                                       "json": {"type": "object", "dependentSchemas": {"a": {}}}}},
                                   ["structured_outputs.json", "dependentSchemas"], "structured_outputs.json"),
    "invalid regex": ("/v1/chat/completions", {**CHAT, "structured_outputs": {"regex": "(("}},
                      ["structured_outputs.regex", "unclosed"], "structured_outputs.regex"),
    "two constraint kinds": ("/v1/completions", {**COMPLETION, "structured_outputs": {"regex": "a", "choice": ["a"]}},
                             ["exactly one", "regex, choice"], "structured_outputs"),
    "unknown structured_outputs key": ("/v1/completions", {**COMPLETION, "structured_outputs": {"structural_tag": {}}},
                                       ["structural_tag"], "structured_outputs.structural_tag"),
    "response_format and structured_outputs": (
        "/v1/chat/completions", {**CHAT, "response_format": {"type": "json_object"},
                                 "structured_outputs": {"choice": ["a"]}},
        ["response_format and structured_outputs", "only one"], "response_format"),
    "guided_json": ("/v1/completions", {**COMPLETION, "guided_json": {"type": "object"}},
                    ["guided_json", "structured_outputs"], "guided_json"),
    "tool name": ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {"name": "a b"}}]},
                  ["tools[0].name", "a b"], "tools[0].name"),
    "tool names twice": ("/v1/chat/completions",
                         {**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}] * 2},
                         ["tools[1].name", "twice"], "tools[1].name"),
    "tool type": ("/v1/chat/completions", {**CHAT, "tools": [{"type": "custom", "custom": {"name": "f"}}]},
                  ["tools.0.type", "function"], "tools.0.type"),
    "tool parameters type": ("/v1/chat/completions", {**CHAT, "tools": [
                                 {"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
                             ["tools[0].parameters", "object"], "tools[0].parameters"),
    "unknown named tool": ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}],
                                                    "tool_choice": {"type": "function", "function": {"name": "g"}}},
                           ["tool_choice", "'g'"], "tool_choice"),
    "tool_choice shape": ("/v1/chat/completions", {**CHAT, "tool_choice": "always"}, ["tool_choice", "required"],
                          "tool_choice"),
    "required without tools": ("/v1/chat/completions", {**CHAT, "tool_choice": "required"},
                               ["tool_choice", "no tools were given"], "tool_choice"),
    "forced tool schema": ("/v1/chat/completions", {**CHAT, "tool_choice": "required", "tools": [
                               {"type": "function", "function": {"name": "f", "parameters": {
                                   "type": "object", "dependentSchemas": {"a": {}}}}}]},
                           ["tools[0].function.parameters", "dependentSchemas"], "tools[0].function.parameters"),
    "forced tools and response_format": ("/v1/chat/completions", {
        **CHAT, "tool_choice": "required", "response_format": {"type": "json_object"},
        "tools": [{"type": "function", "function": {"name": "f"}}]}, ["response_format and tool_choice"],
        "response_format"),
    "no prompt": ("/v1/completions", {"max_tokens": 2}, ["prompt", "required"], "prompt"),
    "no messages": ("/v1/chat/completions", {"max_tokens": 2}, ["messages", "required"], "messages"),
    "empty messages": ("/v1/chat/completions", {"messages": [], "max_tokens": 2}, ["messages"], "messages"),
    "token out of vocab": ("/v1/completions", {**COMPLETION, "prompt": [10**9]}, ["vocabulary"], "prompt"),
    "prompt too long": ("/v1/completions", {**COMPLETION, "prompt": "word " * 3000}, ["maximum length"], None),
    "output too long": ("/v1/completions", {**COMPLETION, "max_tokens": 100_000}, ["maximum length"], None),
    "priority range": ("/v1/completions", {**COMPLETION, "priority": 2**40}, ["priority"], "priority"),
    "lone surrogate": ("/v1/completions", b'{"prompt": "a\\ud800b", "max_tokens": 2}', ["surrogate"], "prompt"),
    "anthropic max_tokens": ("/v1/messages", {"model": "m", "messages": CHAT["messages"]}, ["max_tokens"],
                             "max_tokens"),
    "tokenize both": ("/tokenize", {"prompt": "Hi", "messages": CHAT["messages"]}, ["prompt or messages"], "prompt"),
    "detokenize vocab": ("/detokenize", {"tokens": [-1]}, ["vocabulary"], "tokens"),
}


@pytest.mark.parametrize("case", BAD_BODIES)
def test_bad_body_is_400_naming_the_field(frontend, model, case):
    route, body, words, param = BAD_BODIES[case]
    if isinstance(body, dict) and route == "/v1/messages":
        body = {**body, "model": model}
    error = assert_error(post(frontend, route, body), 400, BAD, *words, anthropic_shape=route == "/v1/messages")
    assert error["param"] == param, error


RESPONSE = {"input": "Hi", "max_output_tokens": 2}
MESSAGES = {"messages": CHAT["messages"], "max_tokens": 2}  # + the model
BATCH = {"input_file_id": "file-x", "endpoint": "/v1/chat/completions"}
# Fields OpenAI's and Anthropic's APIs define as enums (the values in the `openai` and
# `anthropic` SDKs' types): a value the API does not define is a 400 naming the field, as there;
# one it defines still passes (used, or ignored as before). (route, body, field, a value of
# the API's (None: that route can't answer 200 here), one outside it, the param named)
ENUMS = {
    "responses include": ("/v1/responses", RESPONSE, "include", ["reasoning.encrypted_content"],
                          ["nonsense.field"], "include.0"),
    "responses service_tier": ("/v1/responses", RESPONSE, "service_tier", "flex", "cheapest", "service_tier"),
    "responses truncation": ("/v1/responses", RESPONSE, "truncation", "disabled", "sometimes", "truncation"),
    "responses prompt_cache_retention": ("/v1/responses", RESPONSE, "prompt_cache_retention", "24h", "forever",
                                         "prompt_cache_retention"),
    "responses reasoning.effort": ("/v1/responses", RESPONSE, "reasoning.effort", "low", "extreme",
                                   "reasoning.effort"),
    "responses reasoning.summary": ("/v1/responses", RESPONSE, "reasoning.summary", "concise", "verbose",
                                    "reasoning.summary"),
    "responses text.verbosity": ("/v1/responses", RESPONSE, "text.verbosity", "low", "loud", "text.verbosity"),
    "chat reasoning_effort": ("/v1/chat/completions", CHAT, "reasoning_effort", "minimal", "extreme",
                              "reasoning_effort"),
    "chat service_tier": ("/v1/chat/completions", CHAT, "service_tier", "priority", "cheapest", "service_tier"),
    "chat modalities": ("/v1/chat/completions", CHAT, "modalities", ["text"], ["smell"], "modalities.0"),
    "chat verbosity": ("/v1/chat/completions", CHAT, "verbosity", "high", "loud", "verbosity"),
    "chat prompt_cache_retention": ("/v1/chat/completions", CHAT, "prompt_cache_retention", "in_memory", "forever",
                                    "prompt_cache_retention"),
    "chat tool_choice": ("/v1/chat/completions", CHAT, "tool_choice", "none", "always", "tool_choice"),
    "embeddings encoding_format": ("/v1/embeddings", {"input": "Hi"}, "encoding_format", None, "int8",
                                   "encoding_format"),
    "batch completion_window": ("/v1/batches", BATCH, "completion_window", None, "48h", "completion_window"),
    "anthropic service_tier": ("/v1/messages", MESSAGES, "service_tier", "standard_only", "premium",
                               "service_tier"),
    "anthropic speed": ("/v1/messages", MESSAGES, "speed", "standard", "warp", "speed"),
    "anthropic output_config.effort": ("/v1/messages", MESSAGES, "output_config.effort", "high", "extreme",
                                       "output_config.effort"),
    "anthropic cache_control.ttl": ("/v1/messages", MESSAGES, "cache_control", {"type": "ephemeral", "ttl": "1h"},
                                    {"type": "ephemeral", "ttl": "1d"}, "cache_control.ttl"),
    "anthropic tool_choice.type": ("/v1/messages", MESSAGES, "tool_choice.type", "auto", "sometimes",
                                   "tool_choice.type"),
    "anthropic thinking.type": ("/v1/messages", MESSAGES, "thinking.type", "disabled", "maybe", "thinking.type"),
}


def with_field(body: dict, path: str, value) -> dict:
    """A copy of `body` with the dotted `path` set to `value`."""
    body = copy.deepcopy(body)
    *parents, last = path.split(".")
    node = body
    for key in parents:
        node = node.setdefault(key, {})
    node[last] = value
    return body


@pytest.mark.parametrize("case", ENUMS)
def test_enum_field_takes_only_the_apis_values(frontend, model, case):
    route, body, field, good, bad, param = ENUMS[case]
    anthropic_shape = route == "/v1/messages"
    body = {**body, "model": model}
    error = assert_error(post(frontend, route, with_field(body, field, bad)), 400, BAD, param,
                         anthropic_shape=anthropic_shape)
    assert error["param"] == param, error
    if good is not None:
        r = post(frontend, route, with_field(body, field, good))
        assert r.status_code == 200, r.text


# Earlier calls' arguments nested past Python's recursion limit, were json.loads to read them:
# (route, body, the param named). Anthropic's input is an object, read with the body; nested
# past the arguments' limit (256 levels) but not the body's.
DEEP = "[" * 100_000
DEEP_OBJECT: dict = {}
for _ in range(300):
    DEEP_OBJECT = {"a": DEEP_OBJECT}
DEEP_ARGUMENTS = {
    "chat": ("/v1/chat/completions", {"max_tokens": 2, "messages": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": DEEP}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"}]}, "messages[1].tool_calls[0].function.arguments"),
    "chat object": ("/v1/chat/completions", {"max_tokens": 2, "messages": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": DEEP_OBJECT}}]}]},
        "messages[1].tool_calls[0].function.arguments"),
    "responses": ("/v1/responses", {"max_output_tokens": 2, "input": [
        {"role": "user", "content": "Hi"},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": DEEP},
        {"type": "function_call_output", "call_id": "c1", "output": "ok"}]}, "input[1].arguments"),
    "anthropic": ("/v1/messages", {"max_tokens": 2, "messages": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": DEEP_OBJECT}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "ok"}]}]},
        "messages[1].content[0].input"),
}


@pytest.mark.parametrize("case", DEEP_ARGUMENTS)
def test_deeply_nested_call_arguments_are_400(frontend, model, case):
    """A 400 naming the field, with or without tools in the request (kv_free_after: no 500 is
    logged), and the server serves on."""
    route, body, param = DEEP_ARGUMENTS[case]
    anthropic_shape = route == "/v1/messages"
    tools = ({"tools": [{"name": "f", "input_schema": {"type": "object"}}]} if anthropic_shape else
             {"tools": [{"type": "function", "name": "f"}]} if route == "/v1/responses" else
             {"tools": [{"type": "function", "function": {"name": "f"}}]})
    for extra in ({}, tools):
        r = post(frontend, route, {**body, "model": model, **extra})
        error = assert_error(r, 400, BAD, param, "nested", anthropic_shape=anthropic_shape)
        assert error["param"] == param, error
    r = post(frontend, "/v1/completions", COMPLETION)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text


def test_number_too_long_to_read_is_400(frontend):
    """Python's int() reads at most 4,300 digits: a longer number in a body is a 400, not a 500."""
    body = b'{"prompt": "Hi", "max_tokens": ' + b"1" * 5000 + b"}"
    assert assert_error(post(frontend, "/v1/completions", body), 400, BAD, "digits")["param"] == "body"


@pytest.mark.parametrize("route,body", [("/v1/completions", {**COMPLETION, "temperature": -1}),
                                        ("/v1/chat/completions", {**CHAT, "n": 0}),
                                        ("/v1/messages", {**CHAT, "model": "", "temperature": -1})])
def test_bad_streaming_request_is_a_real_400(frontend, model, route, body):
    body = {**body, "stream": True, **({"model": model} if route == "/v1/messages" else {})}
    with httpx.stream("POST", f"{frontend.http_url}{route}", json=body, timeout=30) as r:
        r.read()
        assert_error(r, 400, BAD, anthropic_shape=route == "/v1/messages")


def test_sdk_errors_are_typed(frontend, model):
    client = openai_client(frontend)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model, prompt="Hi", max_tokens=2, temperature=-1)
    e = info.value
    assert e.status_code == 400 and e.type == BAD and e.param == "temperature" and "temperature" in e.message
    assert set(e.body) == ERROR_KEYS
    with pytest.raises(openai.BadRequestError) as info:  # the SDK raises before the first chunk
        client.chat.completions.create(model=model, messages=CHAT["messages"], max_tokens=2, top_p=2, stream=True)
    assert info.value.param == "top_p"
    with pytest.raises(openai.BadRequestError) as info:  # a bad schema, before the stream starts
        client.chat.completions.create(model=model, messages=CHAT["messages"], max_tokens=2, stream=True,
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "x", "schema": {"type": "objekt"}}})
    assert info.value.param == "response_format.json_schema.schema" and "objekt" in info.value.message
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model, prompt="Hi", max_tokens=2, extra_body={"best_of": 2})
    assert info.value.param == "best_of"


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions", "/v1/messages", "/tokenize"])
def test_unknown_model_is_404(frontend, route):
    body = {**COMPLETION, **CHAT, "model": "no-such-model"} if route != "/tokenize" else {"prompt": "Hi",
                                                                                          "model": "no-such-model"}
    error = assert_error(post(frontend, route, body), 404, "not_found_error", "no-such-model",
                         anthropic_shape=route == "/v1/messages")
    assert error["param"] == "model" and error["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError) as info:
        openai_client(frontend).completions.create(model="no-such-model", prompt="Hi", max_tokens=2)
    assert info.value.code == "model_not_found"


def test_unknown_route_and_method(frontend):
    assert_error(httpx.get(f"{frontend.http_url}/v1/nothing-here", timeout=10), 404, "not_found_error", "no route")
    r = httpx.get(f"{frontend.http_url}/v1/completions", timeout=10)
    assert r.status_code == 405 and set(r.json()["error"]) == ERROR_KEYS


def test_unknown_fields_are_ignored(frontend, model):
    extra = {"frobnicate": True, "x_custom": {"nested": [1, 2]}, "metadata": {"k": "v"}}
    client = openai_client(frontend)
    r = client.completions.create(model=model, prompt="Hi", max_tokens=2, extra_body=extra)
    assert r.usage.completion_tokens == 2
    r = client.chat.completions.create(model=model, messages=CHAT["messages"], max_tokens=2, extra_body=extra)
    assert r.usage.completion_tokens == 2
    m = anthropic_client(frontend).messages.create(model=model, max_tokens=2, messages=CHAT["messages"],
                                                   extra_body=extra)
    assert m.usage.output_tokens == 2
    r = post(frontend, "/tokenize", {"prompt": "Hi", "frobnicate": 1})
    assert r.status_code == 200


# -- --api-key --------------------------------------------------------------------------------

def test_api_key(keyed, model):
    url = keyed.http_url
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "secret"}, {"x-api-key": "nope"}):
        r = httpx.post(f"{url}/v1/completions", json=COMPLETION, headers=headers, timeout=30)
        error = assert_error(r, 401, "authentication_error", "API key")
        assert error["code"] == "invalid_api_key"
    assert_error(httpx.get(f"{url}/v1/models", timeout=10), 401, "authentication_error")
    assert_error(httpx.post(f"{url}/v1/messages", json={}, timeout=10), 401, "authentication_error",
                 anthropic_shape=True)
    with pytest.raises(openai.AuthenticationError):
        openai_client(keyed, api_key="wrong").completions.create(model=model, prompt="Hi", max_tokens=2)
    with pytest.raises(anthropic.AuthenticationError):
        anthropic_client(keyed, api_key="wrong").messages.create(model=model, max_tokens=2,
                                                                 messages=CHAT["messages"])
    r = openai_client(keyed, api_key="secret").completions.create(model=model, prompt="Hi", max_tokens=2)
    assert r.usage.completion_tokens == 2
    m = anthropic_client(keyed, api_key="secret").messages.create(model=model, max_tokens=2,
                                                                  messages=CHAT["messages"])  # x-api-key
    assert m.usage.output_tokens == 2
    # the routes outside /v1 stay open, as in vLLM: probes and scrapers carry no key
    for path in ("/health", "/version", "/metrics"):
        assert httpx.get(f"{url}{path}", timeout=10).status_code == 200, path
    keyed.wait_kv_free()


# -- a full house: 429 -----------------------------------------------------------------------

def test_full_house_is_429_with_retry_after(limited, model):
    client = httpx.Client(timeout=60)
    with client.stream("POST", f"{limited.http_url}/v1/completions", json=LONG_STREAM) as held:
        assert held.status_code == 200
        lines = held.iter_lines()  # kept: a closed line iterator closes the stream
        next(line for line in lines if line.startswith("data: "))
        with pytest.raises(openai.RateLimitError) as info:
            openai_client(limited).completions.create(model=model, prompt="Hi", max_tokens=2)
        e = info.value
        assert e.status_code == 429 and e.response.headers["retry-after"] == "1"
        assert e.type == "rate_limit_error" and "busy" in e.message
        with httpx.stream("POST", f"{limited.http_url}/v1/chat/completions", json={**CHAT, "stream": True},
                          timeout=30) as r:
            r.read()
            assert_error(r, 429, "rate_limit_error", "max-concurrent-streams")
        with pytest.raises(anthropic.RateLimitError):
            anthropic_client(limited).messages.create(model=model, max_tokens=2, messages=CHAT["messages"])
    client.close()
    deadline = time.monotonic() + 10  # the slot frees once the held stream is gone
    while True:
        try:
            r = openai_client(limited).completions.create(model=model, prompt="Hi", max_tokens=2)
            break
        except openai.RateLimitError:
            assert time.monotonic() < deadline, "the slot never freed"
            time.sleep(0.1)
    assert r.usage.completion_tokens == 2
    limited.wait_kv_free()


def test_limit_holds_under_a_burst(limited, model):
    """A slot is taken at admission, not when the generation starts: a burst of streams, or one
    request with two prompts, cannot slip past --max-concurrent-streams; a refused request
    gives back what it took."""
    async def burst() -> list[int]:
        async with httpx.AsyncClient(base_url=limited.http_url, timeout=60) as c:
            async def one() -> int:
                body = {"model": model, "prompt": "Hi", "max_tokens": 60, "ignore_eos": True, "stream": True}
                return (await c.post("/v1/completions", json=body)).status_code
            return await asyncio.gather(*(one() for _ in range(6)))
    statuses = asyncio.run(burst())
    assert sorted(statuses) == [200] + [429] * 5, statuses
    limited.wait_kv_free()
    assert_error(post(limited, "/v1/completions", {"prompt": ["a", "b"], "max_tokens": 2}), 429, "rate_limit_error",
                 "busy")
    r = post(limited, "/v1/completions", {"prompt": ["a"], "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text
    limited.wait_kv_free()


# -- no engine: 503 ---------------------------------------------------------------------------

def test_no_engine_is_503(orphan):
    url = orphan.http_url
    assert_error(httpx.get(f"{url}/health", timeout=10), 503, "service_unavailable_error", "no engine")
    for route, body in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT),
                        ("/tokenize", {"prompt": "Hi"})):
        assert_error(post(orphan, route, body, timeout=10), 503, "service_unavailable_error", "engine")
    assert_error(httpx.get(f"{url}/v1/models", timeout=10), 503, "service_unavailable_error")
    assert_error(post(orphan, "/v1/messages", {**CHAT, "model": "m"}, timeout=10), 503, "service_unavailable_error",
                 anthropic_shape=True)
    with pytest.raises(openai.APIStatusError) as info:
        openai_client(orphan).completions.create(model="m", prompt="Hi", max_tokens=2, stream=True)
    assert info.value.status_code == 503
    assert httpx.get(f"{url}/version", timeout=10).status_code == 200
    assert not server_errors(orphan)


PIXEL = ("data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAA"
         "AABJRU5ErkJggg==")


def test_images_to_a_text_model_are_400_on_every_api(frontend, model):
    """The bundled model reads text only: an image is refused on every route, naming it."""
    image_part = {"type": "image_url", "image_url": {"url": PIXEL}}
    chat = {"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": [image_part]}]}
    assert_error(post(frontend, "/v1/chat/completions", chat), 400, BAD, "text only")
    source = {"type": "base64", "media_type": "image/png", "data": PIXEL.split(",", 1)[1]}
    message = {"model": model, "max_tokens": 2, "messages": [
        {"role": "user", "content": [{"type": "image", "source": source}]}]}
    assert_error(post(frontend, "/v1/messages", message), 400, None, "text only", anthropic_shape=True)
    response = {"model": model, "input": [{"role": "user", "content": [{"type": "input_image", "image_url": PIXEL}]}]}
    assert_error(post(frontend, "/v1/responses", response), 400, BAD, "text only")
