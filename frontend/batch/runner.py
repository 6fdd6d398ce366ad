"""Batch lines through the frontend's own HTTP app, in-process (httpx's ASGI transport): a line
gets exactly what its route answers over the network, 400s included, with no second copy of
any route's logic and no network hop.

An input line (OpenAI's batch format):

    {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {...}}

its result line:

    {"id": "batch_req_...", "custom_id": "a",
     "response": {"status_code": 200, "request_id": "req_...", "body": {...}}, "error": null}

A line that cannot be sent (not JSON, a missing or mistyped field, an unknown url, a custom_id
seen before, "stream": true) gets "response": null and "error": {"code", "message"}; a line
the route refuses gets the route's response (status 400 and its error body). Results come in
the order the lines finish, as OpenAI's do: match them by custom_id.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import httpx

from frontend.batch.app_client import AppClient

log = logging.getLogger("pagedserve.batch")
# The routes a line may name, and those a model of each task serves (frontend/pooling.py's
# served_task): a line naming another task's route is an error line, not a batch of 400s.
BATCH_URLS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings")
TASK_URLS = {"generate": BATCH_URLS[:3], "embed": ("/v1/embeddings",), "score": ()}
# Full (429) or without an engine for now (503): the line waits and tries again, for so long.
BUSY = (429, 503)
RETRY_FOR_S = 300.0


@dataclass
class LineResult:
    line: int  # its line number in the input, from 1
    status: int | None  # the route's HTTP status; None when the line could not be sent
    record: dict  # the output line

    @property
    def ok(self) -> bool:
        return self.status == 200


class LineError(Exception):
    def __init__(self, code: str, message: str, custom_id: str | None = None) -> None:
        super().__init__(message)
        self.code, self.custom_id = code, custom_id


def served_urls(app, task: str | None = None) -> list[str]:
    """The batch urls `app` has a POST route for, of those a model of `task` serves (None:
    whatever the task)."""
    posts = {route.path for route in app.routes if "POST" in getattr(route, "methods", ())}
    return [url for url in BATCH_URLS if url in posts and (task is None or url in TASK_URLS[task])]


class BatchRunner:
    """Sends lines to `app`, at most `slots` at once (a semaphore: online, every batch of the
    process shares one, so batches together leave room for live traffic). `endpoint`: the one
    url every line must name (a /v1/batches batch's); None: any the app serves for the
    model's `task` (None: any it has a route for)."""

    def __init__(self, app, slots: asyncio.Semaphore, endpoint: str | None = None,
                 api_key: str | None = None, task: str | None = None) -> None:
        self.app, self.slots, self.endpoint = app, slots, endpoint
        self.served = served_urls(app, task)
        # The app's own --api-key check runs on every line too: the batch carries the key.
        self.headers = {"content-type": "application/json"}
        if api_key is not None:
            self.headers["authorization"] = f"Bearer {api_key}"
        self.seen: set[str] = set()  # custom_ids so far

    async def run(self, lines: Iterable[str], on_result: Callable[[LineResult], None]) -> None:
        """Every non-blank line's result to `on_result`, as each finishes. Cancelling this stops
        it: no more lines are sent, and those in flight leave (app_client.py), which aborts
        their generations in the engine; their results are not reported."""
        client = AppClient(self.app, self.headers)
        tasks: set[asyncio.Task] = set()
        failed: list[BaseException] = []  # on_result's own failure (a full disk): it ends the run

        def finished(task: asyncio.Task) -> None:
            tasks.discard(task)
            if not task.cancelled() and task.exception() is not None:
                failed.append(task.exception())

        try:
            for number, text in enumerate(lines, 1):
                if failed:
                    break
                if not text.strip():
                    continue
                try:
                    custom_id, url, body = self.parse(text)
                except LineError as e:
                    on_result(_error(number, e.custom_id, e.code, f"line {number}: {e}"))
                    continue
                await self.slots.acquire()
                task = asyncio.ensure_future(self._one(client, number, custom_id, url, body, on_result))
                tasks.add(task)
                task.add_done_callback(finished)
            if tasks:
                await asyncio.wait(tasks)  # not gather: a cancel must not cancel the lines (see finally)
        finally:
            client.leave()  # (nobody is left in flight when every line has finished)
            if tasks:
                await asyncio.wait(tasks)  # they leave at once; a second cancel cuts this short
            await client.aclose()
        if failed:
            raise failed[0]

    def parse(self, text: str) -> tuple[str, str, bytes]:
        """(custom_id, url, the body to post), or a LineError that says what is wrong."""
        try:
            line = json.loads(text)
        except (json.JSONDecodeError, RecursionError) as e:
            raise LineError("invalid_json_line", f"not a JSON object ({e})") from None
        if not isinstance(line, dict):
            raise LineError("invalid_json_line", "not a JSON object")
        custom_id = line.get("custom_id")
        if not isinstance(custom_id, str) or not custom_id:
            raise LineError("missing_required_parameter", "custom_id: must be a non-empty string")
        for name, kind, what in (("url", str, "a string"), ("body", dict, "a JSON object")):
            if not isinstance(line.get(name), kind):
                message = f"{name}: missing" if name not in line else f"{name}: must be {what}"
                raise LineError("missing_required_parameter", message, custom_id)
        url, body = line["url"], line["body"]
        if line.get("method", "POST") != "POST":
            raise LineError("invalid_request", f"method: must be POST, got {line['method']!r}", custom_id)
        self._check_url(url, custom_id)
        if body.get("stream"):
            raise LineError("invalid_request", "body.stream: a batch request cannot stream", custom_id)
        if custom_id in self.seen:
            raise LineError("duplicate_custom_id", f"custom_id: {custom_id!r} is used by an earlier line", custom_id)
        self.seen.add(custom_id)
        try:
            # ASCII JSON: a lone surrogate stays an escape, and the route refuses it with a 400.
            return custom_id, url, json.dumps(body).encode()
        except RecursionError:
            raise LineError("invalid_json_line", "body: nested too deeply", custom_id) from None

    def _check_url(self, url: str, custom_id: str) -> None:
        if url not in BATCH_URLS:
            raise LineError("invalid_url", f"url: {url!r} is not one of {', '.join(BATCH_URLS)}", custom_id)
        if url not in self.served:
            raise LineError("invalid_url", f"url: {url} is not served by this server (its model's batch urls: "
                                           f"{', '.join(self.served) or 'none'})", custom_id)
        if self.endpoint is not None and url != self.endpoint:
            raise LineError("invalid_url", f"url: {url} differs from the batch's endpoint {self.endpoint}", custom_id)

    async def _one(self, client: AppClient, number: int, custom_id: str, url: str, body: bytes,
                   on_result: Callable[[LineResult], None]) -> None:
        try:
            try:
                response = await self._post(client, url, body)
            except Exception as e:  # noqa: BLE001 - one line's failure is its error line, never the file's
                log.exception("batch line %d failed", number)
                result = _error(number, custom_id, "internal_error", f"line {number}: {type(e).__name__}: {e}")
            else:
                result = _response(number, custom_id, response)
        finally:
            self.slots.release()
        if not client.left.is_set():  # a line that left has no result
            on_result(result)

    async def _post(self, client: AppClient, url: str, body: bytes) -> httpx.Response:
        deadline = time.monotonic() + RETRY_FOR_S
        while True:
            response = await client.post(url, body)
            if response.status_code not in BUSY or time.monotonic() > deadline or client.left.is_set():
                return response
            retry_after = response.headers.get("retry-after", "")
            await asyncio.sleep(float(retry_after) if retry_after.isdigit() else 1.0)


def _response(number: int, custom_id: str, response: httpx.Response) -> LineResult:
    try:
        body = response.json()
    except ValueError:  # not JSON (no batch route answers so): keep its text
        body = response.text
    record = {"id": _record_id(), "custom_id": custom_id,
              "response": {"status_code": response.status_code, "request_id": f"req_{uuid.uuid4().hex}",
                           "body": body},
              "error": None}
    return LineResult(number, response.status_code, record)


def _error(number: int, custom_id: str | None, code: str, message: str) -> LineResult:
    record = {"id": _record_id(), "custom_id": custom_id, "response": None,
              "error": {"code": code, "message": message}}
    return LineResult(number, None, record)


def _record_id() -> str:
    return f"batch_req_{uuid.uuid4().hex}"


def count_requests(lines: Iterable[str]) -> int:
    """The non-blank lines: the requests a file holds, good or bad."""
    return sum(1 for text in lines if text.strip())
