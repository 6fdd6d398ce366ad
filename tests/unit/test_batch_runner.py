"""The batch runner and file store without processes: a small FastAPI app stands in for the
frontend's (the same ASGI path), so line parsing, concurrency, retries and leaving on cancel
are checked in milliseconds. The real routes are tests/e2e/test_batch.py's and test_run_batch.py's."""

from __future__ import annotations

import asyncio
import json

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from frontend.batch.files import FileStore
from frontend.batch.runner import BatchRunner, LineError, served_urls
from frontend.http.runner import unless_disconnected


class FakeApp:
    """/v1/completions: {"n": N} answers {"echo": N}; {"busy": K} answers 429 K times first;
    {"hang": true} waits until its client leaves; a missing n is a 400."""

    def __init__(self) -> None:
        self.app, self.in_flight, self.most, self.left, self.busy = FastAPI(), 0, 0, 0, 0

        @self.app.post("/v1/completions")
        async def completions(request: Request):
            body = await request.json()
            self.in_flight += 1
            self.most = max(self.most, self.in_flight)
            try:
                if body.get("hang"):
                    try:
                        await unless_disconnected(request, asyncio.sleep(60))
                    except asyncio.CancelledError:
                        self.left += 1
                        raise
                await asyncio.sleep(0.01)
                if self.busy < body.get("busy", 0):
                    self.busy += 1
                    return JSONResponse({"error": {"message": "busy"}}, 429, headers={"Retry-After": "0"})
                if "n" not in body:
                    return JSONResponse({"error": {"message": "n: missing", "param": "n"}}, 400)
                return {"echo": body["n"], "usage": {"prompt_tokens": 1, "completion_tokens": 2}}
            finally:
                self.in_flight -= 1


def line(custom_id: str, **body) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/completions", "body": body})


def run(runner: BatchRunner, lines: list[str]) -> list:
    results = []
    asyncio.run(runner.run(lines, results.append))
    return results


@pytest.mark.parametrize("text, code, words", [
    ("{not json", "invalid_json_line", "not a JSON object"),
    ("[1, 2]", "invalid_json_line", "not a JSON object"),
    ('{"url": "/v1/completions", "body": {}}', "missing_required_parameter", "custom_id"),
    ('{"custom_id": 7, "url": "/v1/completions", "body": {}}', "missing_required_parameter", "custom_id"),
    ('{"custom_id": "a", "body": {}}', "missing_required_parameter", "url: missing"),
    ('{"custom_id": "a", "url": "/v1/completions"}', "missing_required_parameter", "body: missing"),
    ('{"custom_id": "a", "url": "/v1/completions", "body": [1]}', "missing_required_parameter", "JSON object"),
    ('{"custom_id": "a", "method": "GET", "url": "/v1/completions", "body": {}}', "invalid_request", "POST"),
    ('{"custom_id": "a", "url": "/v1/messages", "body": {}}', "invalid_url", "is not one of"),
    ('{"custom_id": "a", "url": "/v1/embeddings", "body": {}}', "invalid_url", "not served"),
    ('{"custom_id": "a", "url": "/v1/completions", "body": {"stream": true}}', "invalid_request", "stream"),
])
def test_a_line_that_cannot_be_sent_says_why(text, code, words):
    runner = BatchRunner(FakeApp().app, asyncio.Semaphore(1))
    with pytest.raises(LineError, match=words) as e:
        runner.parse(text)
    assert e.value.code == code


def test_the_endpoint_and_custom_ids_are_checked():
    runner = BatchRunner(FakeApp().app, asyncio.Semaphore(1), endpoint="/v1/chat/completions")
    with pytest.raises(LineError, match="differs from the batch's endpoint"):
        runner.parse(line("a", n=1))
    runner = BatchRunner(FakeApp().app, asyncio.Semaphore(1))
    runner.parse(line("a", n=1))
    with pytest.raises(LineError, match="earlier line") as e:
        runner.parse(line("a", n=2))
    assert e.value.code == "duplicate_custom_id" and e.value.custom_id == "a"


def test_the_models_task_decides_the_urls():
    app = FakeApp().app
    app.post("/v1/embeddings")(lambda: {})
    assert served_urls(app) == ["/v1/completions", "/v1/embeddings"]  # no task: every route
    assert served_urls(app, "generate") == ["/v1/completions"]
    assert served_urls(app, "embed") == ["/v1/embeddings"]
    assert served_urls(app, "score") == []
    runner = BatchRunner(app, asyncio.Semaphore(1), task="embed")
    with pytest.raises(LineError, match="not served by this server .*: /v1/embeddings") as e:
        runner.parse(line("a", n=1))
    assert e.value.code == "invalid_url"
    runner.parse('{"custom_id": "b", "url": "/v1/embeddings", "body": {"input": "x"}}')


def test_every_line_gets_one_result_within_the_concurrency():
    fake = FakeApp()
    lines = [line(f"c{i}", n=i) for i in range(20)] + ["", "oops", line("refused"), line("busy", n=99, busy=2)]
    results = run(BatchRunner(fake.app, asyncio.Semaphore(3)), lines)
    assert len(results) == 23 and fake.most <= 3
    by_id = {r.record["custom_id"]: r for r in results}
    for i in range(20):
        response = by_id[f"c{i}"].record["response"]
        assert by_id[f"c{i}"].ok and response["status_code"] == 200 and response["body"]["echo"] == i
    assert by_id["busy"].ok and fake.busy == 2  # 429s are waited out, not results
    refused = by_id["refused"]
    assert not refused.ok and refused.record["response"]["status_code"] == 400 and refused.record["error"] is None
    assert by_id[None].line == 22 and by_id[None].record["error"]["code"] == "invalid_json_line"
    assert by_id[None].record["error"]["message"].startswith("line 22: ")


def test_cancelling_a_run_makes_its_lines_leave():
    """A cancelled run's lines in flight see their client disconnect (as over the network),
    so their routes stop them; they report nothing, and no new line is sent."""
    fake, results = FakeApp(), []

    async def main() -> None:
        lines = [line(f"h{i}", n=i, hang=True) for i in range(10)]
        task = asyncio.ensure_future(BatchRunner(fake.app, asyncio.Semaphore(4)).run(lines, results.append))
        while fake.in_flight < 4:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 5)

    asyncio.run(main())
    assert (fake.left, fake.in_flight, fake.most, results) == (4, 0, 4, [])


def test_the_file_store_keeps_files_by_id(tmp_path):
    store = FileStore(tmp_path / "files")
    assert store.list() == [] and not (tmp_path / "files").exists()  # nothing made until a write
    ids = []
    for name, purpose in (("a.jsonl", "batch"), ("b.jsonl", "batch_output")):
        scratch = store.scratch()
        scratch.write_bytes(name.encode())
        obj = store.publish(scratch, name, purpose)
        assert (obj["filename"], obj["purpose"], obj["bytes"], obj["object"]) == (name, purpose, 7, "file")
        assert store.path(obj["id"]).read_bytes() == name.encode() and not scratch.exists()
        ids.append(obj["id"])
    assert [f["id"] for f in store.list()] == ids[::-1]  # newest first
    assert [f["id"] for f in store.list("batch")] == ids[:1]
    assert FileStore(tmp_path / "files").get(ids[0])["filename"] == "a.jsonl"  # on disk: another process sees it
    for bad in ("../files/" + ids[0], ids[0] + "\n", "file-x", ""):
        assert store.get(bad) is None and store.path(bad) is None and not store.delete(bad)
    assert store.delete(ids[0]) and store.get(ids[0]) is None and not store.delete(ids[0])
    assert [f["id"] for f in store.list()] == ids[1:]
