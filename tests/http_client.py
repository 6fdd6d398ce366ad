"""HTTP client helpers shared by the end-to-end tests of the OpenAI/Anthropic-compatible API:
the official SDKs pointed at a real frontend, raw httpx calls, error-body and SSE checks."""

from __future__ import annotations

import contextlib
import json
import time

import anthropic
import httpx
import openai
import pytest

API_KEY = "test-key"  # any string: the test frontends run without --api-key unless a test says so
TIMEOUT_S = 120
ERROR_KEYS = {"message", "type", "param", "code"}


def openai_client(fe, api_key: str = API_KEY, **kwargs) -> openai.OpenAI:
    """max_retries=0: a 429 or 503 must reach the test, not be retried away by the SDK."""
    return openai.OpenAI(base_url=f"{fe.http_url}/v1", api_key=api_key, max_retries=0, timeout=TIMEOUT_S, **kwargs)


def async_openai_client(fe, **kwargs) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{fe.http_url}/v1", api_key=API_KEY, max_retries=0, timeout=TIMEOUT_S,
                              **kwargs)


def anthropic_client(fe, api_key: str = API_KEY) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=fe.http_url, api_key=api_key, max_retries=0, timeout=TIMEOUT_S)


def model_name(fe) -> str:
    [model] = httpx.get(f"{fe.http_url}/v1/models", timeout=10).json()["data"]
    return model["id"]


def post(fe, path: str, body, timeout: float = TIMEOUT_S, **kwargs) -> httpx.Response:
    """POST a JSON body (or raw bytes/str as `content=`) with no client-side checks."""
    if isinstance(body, (bytes, str)):
        return httpx.post(f"{fe.http_url}{path}", content=body, timeout=timeout,
                          headers={"content-type": "application/json", **kwargs.pop("headers", {})}, **kwargs)
    return httpx.post(f"{fe.http_url}{path}", json=body, timeout=timeout, **kwargs)


def tokenize(fe, **body) -> list[int]:
    r = post(fe, "/tokenize", body, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def assert_error_body(body: dict, type_: str | None = None, *words: str, anthropic_shape: bool = False) -> dict:
    """OpenAI's {"error": {message, type, param, code}} (Anthropic's routes wrap it in
    {"type": "error", ...}); the message names every one of `words`. Returns the error object."""
    if anthropic_shape:
        assert body.get("type") == "error", body
    assert set(body) == ({"type", "error"} if anthropic_shape else {"error"}), body
    error = body["error"]
    assert set(error) == ERROR_KEYS, error
    assert isinstance(error["message"], str) and error["message"], error
    if type_ is not None:
        assert error["type"] == type_, error
    for word in words:
        assert word in error["message"], (word, error)
    return error


def assert_error(response: httpx.Response, status: int, type_: str | None = None, *words: str,
                 anthropic_shape: bool = False) -> dict:
    assert response.status_code == status, (response.status_code, response.text)
    assert response.headers["content-type"].startswith("application/json"), response.headers
    return assert_error_body(response.json(), type_, *words, anthropic_shape=anthropic_shape)


def sse_data(lines) -> list:
    """The `data:` payloads of an SSE stream, parsed (the final "[DONE]" stays a string)."""
    events = []
    for line in lines:
        if line.startswith("data: "):
            payload = line[len("data: "):]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def wait_metric(fe, name: str, want: float, timeout_s: float = 10) -> float:
    """Poll the HTTP /metrics until the sample `name` (with its labels) reads `want`."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = metric(fe, name)
        if value == want or time.monotonic() > deadline:
            return value
        time.sleep(0.1)


def metric(fe, name: str) -> float | None:
    """One sample of the HTTP /metrics, by its exact name and labels (`name{label="x"}`)."""
    text = httpx.get(f"{fe.http_url}/metrics", timeout=10).text
    for line in text.splitlines():
        sample, _, value = line.rpartition(" ")
        if sample == name:
            return float(value)
    return None


def server_errors(fe) -> list[str]:
    """Lines of the frontend's log that report a crash or a 500 (each carries its timestamp)."""
    markers = ("Exception in ASGI application", "internal error", "status=500")
    return [line for line in list(fe.proc.log) if any(m in line for m in markers)]


@contextlib.contextmanager
def no_new_server_errors(fe):
    """The block must log no crash and no 500 (ones from before it are not its fault)."""
    seen = set(server_errors(fe))
    yield
    new = [line for line in server_errors(fe) if line not in seen]
    assert not new, "".join(new)


def stop_inside(text: str, start: int = 3, length: int = 3) -> tuple[str, int]:
    """A `length`-character piece of `text` at a position >= start whose first occurrence is
    there and that is not all whitespace: a stop string that must cut the text at that point."""
    for i in range(start, len(text) - length):
        piece = text[i:i + length]
        if piece.strip() and text.find(piece) == i:
            return piece, i
    raise AssertionError(f"no piece of {text!r} to use as a stop string")


# Fixtures every HTTP test module uses; a module takes them by importing their names.
@pytest.fixture(scope="module")
def model(frontend):
    return model_name(frontend)


@pytest.fixture(autouse=True)
def kv_free_after(frontend):
    """After each test: no 500 or crash was logged, and every KV block is free."""
    with no_new_server_errors(frontend):
        yield
    frontend.wait_kv_free()
