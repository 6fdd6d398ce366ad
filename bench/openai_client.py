"""`bench serve --backend openai`: any OpenAI-compatible server (pagedserve's HTTP API, vLLM,
llama.cpp's llama-server) driven through streaming `POST {target}/completions`.

Each request asks for exactly its planned output length, as the gRPC backend does:
max_tokens, ignore_eos (an extension vLLM and llama-server share) and temperature 0. The
prompt goes as token ids when the dataset has them (a list of ints is a valid OpenAI prompt)
or as text. The answer is Server-Sent Events, `data: {json}` lines up to `data: [DONE]`,
and turns into the same RequestRecord the gRPC backend fills: one code path for metrics.

Token times: TTFT is the first chunk with text. The API does not say how many tokens a chunk
holds, so the count comes from the final `usage.completion_tokens` and is spread over the
text chunks in order (`spread_token_times`); tokens of one chunk share its arrival time, as
the tokens of one gRPC Chunk do. TPOT depends only on the count; ITL sees gaps of 0 inside
a chunk.

The dataset is drawn from the model's local files (--model or --random-weights, --tokenizer:
the bundled model by default): random prompts from its vocabulary size, as GetModelInfo reports it over gRPC, so
every server of one model gets the same token ids; ShareGPT text counted by its tokenizer.
"""

from __future__ import annotations

import functools
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench.datasets import BenchRequest
from bench.load import RequestRecord

CONNECT_TIMEOUT_S = 30.0
READ_TIMEOUT_S = 600.0  # the longest silence within a stream: queued requests wait for a slot
MODELS_TIMEOUT_S = 30.0


def completion_body(request: BenchRequest, model: str) -> dict:
    """The JSON of one streaming completion that must produce `request.output_len` tokens."""
    return {"model": model, "prompt": request.prompt, "max_tokens": request.output_len, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}


def sse_data(line: str) -> str | None:
    """The payload of an SSE `data:` line; None for the rest (blank separators, `:` comments
    and pings, `event:` and `id:` fields)."""
    if not line.startswith("data:"):
        return None
    data = line[5:]
    return data[1:] if data.startswith(" ") else data


def error_code(status: int | None, error: object) -> tuple[str, str]:
    """(code, message) of a failed request: HTTP_<status> when the server gives a status (in
    the response, or as the `code` of its error event), else the error's `type`."""
    message, kind = str(error), None
    if isinstance(error, dict):
        message, kind = str(error.get("message", error)), error.get("type")
        status = error["code"] if isinstance(error.get("code"), int) else status
    code = f"HTTP_{status}" if status is not None else str(kind or "ERROR")
    return code, message


@dataclass
class CompletionStream:
    """One streamed completion as its lines arrive (times in seconds since the send)."""

    chunk_times_s: list[float] = field(default_factory=list)  # arrivals of the chunks with text
    completion_tokens: int | None = None  # the final usage's; None if the server sent none
    prompt_tokens: int | None = None
    cached_tokens: int = 0
    done: bool = False  # `data: [DONE]` arrived
    error: tuple[str, str] | None = None  # (code, message); the first one wins

    def feed(self, line: str, now_s: float) -> None:
        data = sse_data(line)
        if data is None or self.error:
            return
        if data.strip() == "[DONE]":
            self.done = True
            return
        try:
            event = json.loads(data)
        except json.JSONDecodeError:
            self.error = ("BAD_EVENT", f"not JSON: {data[:200]!r}")
            return
        if isinstance(event, dict):
            self.apply(event, now_s)

    def apply(self, event: dict, now_s: float) -> None:
        if "error" in event:
            self.error = error_code(None, event["error"])
            return
        choices = event.get("choices") or []
        if choices and choices[0].get("text"):
            self.chunk_times_s.append(now_s)
        usage = event.get("usage")
        if usage:  # the last chunk's (include_usage); some servers repeat a running count
            self.completion_tokens = usage.get("completion_tokens", self.completion_tokens)
            self.prompt_tokens = usage.get("prompt_tokens", self.prompt_tokens)
            details = usage.get("prompt_tokens_details") or {}
            self.cached_tokens = details.get("cached_tokens") or 0

    def fill(self, record: RequestRecord, end_s: float) -> RequestRecord:
        """`record` as the metrics take it: ok only after `data: [DONE]` and no error."""
        record.e2e_s = end_s
        if self.error:
            record.code, record.error = self.error
            return record
        if not self.done:
            record.code, record.error = "UNKNOWN", "stream ended without data: [DONE]"
            return record
        record.ok = True
        record.prompt_tokens = self.prompt_tokens or record.prompt_tokens
        record.cached_tokens = self.cached_tokens
        count = len(self.chunk_times_s) if self.completion_tokens is None else self.completion_tokens
        # Tokens whose text was all empty came in no text chunk: they count at the end.
        record.token_times_s = spread_token_times(self.chunk_times_s or [end_s], count)
        if record.token_times_s:
            record.ttft_s = record.token_times_s[0]
        return record


def spread_token_times(chunk_times_s: list[float], num_tokens: int) -> list[float]:
    """One time per token: chunk i of C holds ceil((i+1)N/C) - ceil(iN/C) of the N tokens, so
    every chunk holds about N/C, the first at least one (TTFT stays its arrival), and a
    server that sends more chunks than tokens leaves the extra chunks empty."""
    if num_tokens <= 0 or not chunk_times_s:
        return []
    c = len(chunk_times_s)
    bounds = [math.ceil(i * num_tokens / c) for i in range(c + 1)]
    return [t for i, t in enumerate(chunk_times_s) for _ in range(bounds[i + 1] - bounds[i])]


def open_client(target: str, api_key: str | None, keep_alive: bool = False) -> httpx.AsyncClient:
    """A client for `{target}/...`: no connection cap (the benchmark's --max-concurrency is
    the one that binds), no proxy from the environment (the target is what is measured), and
    unless `keep_alive`, a fresh connection per request: llama-server closes a kept-alive
    connection after a few requests, and a request sent on it just then failed with
    RemoteProtocolError (2 of 16)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.AsyncClient(base_url=target.rstrip("/") + "/", headers=headers, trust_env=False,
                             timeout=httpx.Timeout(READ_TIMEOUT_S, connect=CONNECT_TIMEOUT_S, pool=None),
                             limits=httpx.Limits(max_connections=None,
                                                 max_keepalive_connections=None if keep_alive else 0))


async def generate(client: httpx.AsyncClient, model: str, request: BenchRequest,
                   run_start: float | None = None) -> RequestRecord:
    """One streamed completion of `request`, timed as bench.load.generate times a gRPC one."""
    record = RequestRecord(prompt_tokens=request.prompt_len, expected_output_tokens=request.output_len)
    stream = CompletionStream()
    start = time.perf_counter()
    record.sent_at_s = start - (run_start or start)
    try:
        async with client.stream("POST", "completions", json=completion_body(request, model)) as response:
            if response.status_code != 200:
                stream.error = error_code(response.status_code, error_body(await response.aread()))
            else:
                async for line in response.aiter_lines():
                    stream.feed(line, time.perf_counter() - start)
    except httpx.HTTPError as e:  # refused, reset, timed out: the request failed, the run goes on
        stream.error = (type(e).__name__, str(e) or repr(e))
    return stream.fill(record, time.perf_counter() - start)


def error_body(body: bytes) -> object:
    """The `error` of an OpenAI error response, or the body's text."""
    text = body.decode(errors="replace")
    try:
        payload = json.loads(text)
    except json.JSONDecodeError:
        return text[:500]
    return payload.get("error", payload) if isinstance(payload, dict) else payload


def served_model(target: str, name: str | None, api_key: str | None) -> tuple[str, dict]:
    """(the name requests carry, the target's /models entry for it, {} if unasked):
    `name`, else the first id `GET {target}/models` lists."""
    if name:
        return name, {}
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.get(target.rstrip("/") + "/models", headers=headers, timeout=MODELS_TIMEOUT_S,
                             trust_env=False)
        response.raise_for_status()
        entries = response.json().get("data") or []
    except (httpx.HTTPError, ValueError, AttributeError) as e:
        raise SystemExit(f"bench serve: GET {target}/models failed ({e}); is the server up? "
                         "Or name the model with --served-model-name") from e
    if not entries or "id" not in entries[0]:
        raise SystemExit(f"bench serve: GET {target}/models lists no model; name it with --served-model-name")
    return entries[0]["id"], entries[0]


def describe_target(args, target: str) -> tuple[dict, Callable[[str, bool], int]]:
    """The run's model facts (the keys GetModelInfo gives over gRPC) and a token counter for
    text, from `target`'s /models (the OpenAI base URL) and the model's local files."""
    from engine.model_runner import MAX_DEFAULT_MODEL_LEN
    from engine.models.loader import read_arch_config
    from engine.models.source import model_files, tokenizer_path
    name, entry = served_model(target, args.served_model_name, args.api_key)
    path = model_files(args)
    arch = read_arch_config(path)
    # vLLM lists its limit as max_model_len, llama-server its context per slot (-c / -np) as meta.n_ctx.
    max_model_len = (args.max_model_len or entry.get("max_model_len") or (entry.get("meta") or {}).get("n_ctx")
                     or min(arch.max_position_embeddings, MAX_DEFAULT_MODEL_LEN))
    model = {"model_name": name, "architecture": arch.model_type, "dtype": "as served",
             "vocab_size": arch.vocab_size, "max_model_len": max_model_len, "local_files": str(path),
             "served_model": entry}
    return model, _token_counter(str(path), tokenizer_path(args))


def _token_counter(path: str, tokenizer: Path | None) -> Callable[[str, bool], int]:
    @functools.cache
    def load():
        from engine.models.loader import load_tokenizer
        return load_tokenizer(Path(path), tokenizer)

    return lambda text, add_special_tokens: len(load().encode(text, add_special_tokens=add_special_tokens))
