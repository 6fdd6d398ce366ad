"""OpenAI's /v1/files and /v1/batches end to end: the official, unmodified `openai` SDK against
real engine and frontend processes (conftest's engine, a frontend with its data dir in a
temporary folder): upload, create, poll, read the output and error files; cancel a running
batch; list; 404s and 400s. Every test ends with every KV block free and no 500 logged."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from http_client import kv_free_after  # noqa: F401 - the shared fixture (autouse)
from http_client import assert_error, openai_client, post

TERMINAL = ("completed", "failed", "cancelled", "expired")
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def client(frontend):
    with openai_client(frontend) as c:
        yield c


def chat_line(custom_id: str, content: str, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": CHAT,
            "body": {"messages": [{"role": "user", "content": content}], "max_tokens": 6, **body}}


def upload(client, lines: list[dict | str], name: str = "requests.jsonl"):
    data = "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines).encode()
    return client.files.create(file=(name, data), purpose="batch"), data


def create(client, file_id: str, endpoint: str = CHAT, **kwargs):
    return client.batches.create(input_file_id=file_id, endpoint=endpoint, completion_window="24h", **kwargs)


def wait_done(client, batch_id: str, timeout_s: float = 120):
    deadline = time.monotonic() + timeout_s
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in TERMINAL:
            return batch
        assert time.monotonic() < deadline, batch
        time.sleep(0.2)


def jsonl(client, file_id: str) -> list[dict]:
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


def test_a_batch_runs_to_its_output_and_error_files(client, frontend):
    refused = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": -1}
    lines = [chat_line(f"q{i}", f"Name a colour ({i}).") for i in range(6)]
    lines += [{"custom_id": "refused", "method": "POST", "url": CHAT, "body": refused},
              {"custom_id": "other-url", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}]
    f, data = upload(client, lines)
    assert f.id.startswith("file-") and f.object == "file" and f.purpose == "batch"
    assert (f.bytes, f.filename) == (len(data), "requests.jsonl")
    batch = create(client, f.id, metadata={"run": "e2e"})
    assert batch.id.startswith("batch_") and batch.status in ("validating", "in_progress")
    assert (batch.input_file_id, batch.endpoint, batch.completion_window) == (f.id, CHAT, "24h")
    assert batch.metadata == {"run": "e2e"} and batch.expires_at == batch.created_at + 24 * 3600

    batch = wait_done(client, batch.id)
    assert batch.status == "completed" and batch.errors is None, batch
    counts = batch.request_counts
    assert (counts.total, counts.completed, counts.failed) == (8, 6, 2)
    assert batch.created_at <= batch.in_progress_at <= batch.finalizing_at <= batch.completed_at

    output = jsonl(client, batch.output_file_id)
    assert sorted(r["custom_id"] for r in output) == [f"q{i}" for i in range(6)]
    for r in output:
        assert r["id"].startswith("batch_req_") and r["error"] is None
        body = r["response"]["body"]
        assert r["response"]["status_code"] == 200 and body["object"] == "chat.completion", r
        assert body["choices"][0]["message"]["content"] and 1 <= body["usage"]["completion_tokens"] <= 6
    assert batch.usage.output_tokens == sum(r["response"]["body"]["usage"]["completion_tokens"] for r in output)
    assert batch.usage.input_tokens == sum(r["response"]["body"]["usage"]["prompt_tokens"] for r in output)

    errors = {r["custom_id"]: r for r in jsonl(client, batch.error_file_id)}
    assert set(errors) == {"refused", "other-url"}
    # exactly what the route answers over the network
    direct = post(frontend, CHAT, refused)
    assert errors["refused"]["response"] == {"status_code": 400, "body": direct.json(),
                                             "request_id": errors["refused"]["response"]["request_id"]}
    assert errors["other-url"]["response"] is None
    assert errors["other-url"]["error"]["code"] == "invalid_url" and CHAT in errors["other-url"]["error"]["message"]

    for file_id in (batch.output_file_id, batch.error_file_id):
        assert client.files.retrieve(file_id).purpose == "batch_output"
    with pytest.raises(openai.BadRequestError, match="purpose"):  # an output file is no batch input
        create(client, batch.output_file_id)


def test_cancel_stops_a_running_batch(client, frontend):
    long = {"prompt": "Once upon a time", "max_tokens": 400, "temperature": 0, "ignore_eos": True}
    f, _ = upload(client, [{"custom_id": f"long{i}", "method": "POST", "url": "/v1/completions", "body": long}
                           for i in range(12)])
    batch = create(client, f.id, endpoint="/v1/completions")
    deadline = time.monotonic() + 60
    while not frontend.server_info().num_running:  # its requests run in the engine
        assert time.monotonic() < deadline
        time.sleep(0.1)
    running = client.batches.retrieve(batch.id)
    assert running.status == "in_progress" and not running.request_counts.completed, running
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled") and cancelling.cancelling_at is not None
    assert client.batches.cancel(batch.id).status in ("cancelling", "cancelled")  # again: no harm
    batch = wait_done(client, batch.id, timeout_s=30)
    assert batch.status == "cancelled" and batch.cancelled_at >= batch.cancelling_at
    assert batch.request_counts.total == 12 and batch.request_counts.completed < 12
    assert batch.completed_at is None
    # (kv_free_after: the lines in flight were aborted in the engine)


def test_a_finished_batch_cannot_be_cancelled(client):
    f, _ = upload(client, [chat_line("one", "Hi", max_tokens=1)])
    batch = wait_done(client, create(client, f.id).id)
    with pytest.raises(openai.BadRequestError, match="completed"):
        client.batches.cancel(batch.id)


def test_an_empty_file_fails_the_batch(client):
    f, _ = upload(client, ["", "   "])
    batch = wait_done(client, create(client, f.id).id)
    assert batch.status == "failed" and batch.failed_at is not None
    assert [e.code for e in batch.errors.data] == ["empty_file"]
    assert batch.output_file_id is None and batch.error_file_id is None


def test_batches_list_newest_first_in_pages(client, frontend):
    f, _ = upload(client, [chat_line("one", "Hi", max_tokens=1)])
    made = [create(client, f.id).id for _ in range(3)]
    page = client.batches.list(limit=2)
    assert [b.id for b in page.data] == made[::-1][:2] and page.has_more
    every = [b.id for b in client.batches.list(limit=2)]  # the SDK follows `after` page by page
    assert every[:3] == made[::-1] and len(every) == len(set(every))
    for batch_id in made:
        wait_done(client, batch_id)
    r = httpx.get(f"{frontend.http_url}/v1/batches", params={"limit": 0}, timeout=10)
    assert_error(r, 400, "invalid_request_error", "limit")["param"] == "limit"


def test_files_round_trip(client, frontend):
    f, data = upload(client, [chat_line("x", "Hi")], name="mine.jsonl")
    assert client.files.retrieve(f.id).model_dump() == f.model_dump()
    assert client.files.content(f.id).content == data
    assert (frontend.data_dir / "files" / f.id).read_bytes() == data  # kept under --data-dir
    assert f.id in [x.id for x in client.files.list(purpose="batch")]
    assert f.id not in [x.id for x in client.files.list(purpose="batch_output")]
    listed = client.files.list(order="asc").data
    assert [x.created_at for x in listed] == sorted(x.created_at for x in listed)
    deleted = client.files.delete(f.id)
    assert (deleted.id, deleted.deleted) == (f.id, True)
    assert f.id not in [x.id for x in client.files.list()]
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(f.id)


def test_unknown_ids_are_404s(client, frontend):
    for call in (lambda: client.batches.retrieve("batch_nope"), lambda: client.batches.cancel("batch_nope"),
                 lambda: client.files.retrieve("file-nope"), lambda: client.files.content("file-nope"),
                 lambda: client.files.delete("file-nope"), lambda: create(client, "file-" + "0" * 32)):
        with pytest.raises(openai.NotFoundError):
            call()
    for path in ("/v1/batches/batch_nope", "/v1/files/file-nope", "/v1/files/%2E%2E/content"):
        r = httpx.get(f"{frontend.http_url}{path}", timeout=10)
        assert_error(r, 404, "not_found_error", "No such")  # an id is never a path


@pytest.mark.parametrize("change, field, words", [
    ({"endpoint": "/v1/embeddings"}, "endpoint", "not served"),
    ({"endpoint": "/v1/messages"}, "endpoint", "not a batch endpoint"),
    ({"completion_window": "1h"}, "completion_window", "24h"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata", "16"),
    ({"metadata": {"k": 1}}, "metadata.k", "string"),
    ({"input_file_id": None}, "input_file_id", "input_file_id"),
])
def test_bad_create_bodies_are_400s(client, frontend, change, field, words):
    f, _ = upload(client, [chat_line("x", "Hi")])
    body = {"input_file_id": f.id, "endpoint": CHAT, "completion_window": "24h", **change}
    body = {k: v for k, v in body.items() if v is not None}
    error = assert_error(post(frontend, "/v1/batches", body), 400, "invalid_request_error", words)
    assert error["param"] == field, error


def test_bad_uploads_are_400s(client, frontend):
    with pytest.raises(openai.BadRequestError, match="purpose"):
        client.files.create(file=("a.jsonl", b"{}\n"), purpose="assistants")
    error = assert_error(post(frontend, "/v1/files", {"purpose": "batch"}), 400, "invalid_request_error", "file")
    assert error["param"] == "file"


def test_batch_lines_carry_the_api_key(engine_address, procs, tmp_path):
    """With --api-key, each line passes the app's own key check: the batch carries the key."""
    fe = procs.start_frontend(engine_address, "--api-key", "secret", "--data-dir", str(tmp_path))
    try:
        fe.wait_serving()
        with openai_client(fe, api_key="secret") as keyed:
            f, _ = upload(keyed, [chat_line("one", "Hi", max_tokens=2)])
            batch = wait_done(keyed, create(keyed, f.id).id)
            assert batch.request_counts.completed == 1, batch
        with openai_client(fe, api_key="wrong") as stranger, pytest.raises(openai.AuthenticationError):
            stranger.batches.list()
    finally:
        fe.close()
