"""`pagedserve run-batch` as a real process on the bundled model: a 200-line file in OpenAI's
batch format, some lines bad. Every line gets exactly one result line; good lines a 200 with
a real completion, bad ones an error line or the route's 400; the run exits 0."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.heavy(40)  # seconds on the 2-core CI machine: scheduled first

ROOT = Path(__file__).resolve().parents[2]
# conftest's ENGINE_FLAGS (a test module cannot import it)
ENGINE_FLAGS = ["--dtype", "float32", "--num-kv-blocks", "512", "--max-model-len", "2048", "--num-threads", "1"]
NUM_GOOD = 190
MAX_TOKENS = 4


def good_line(i: int) -> dict:
    if i % 2:
        return {"custom_id": f"good-{i}", "method": "POST", "url": "/v1/completions",
                "body": {"prompt": f"Fact {i}:", "max_tokens": MAX_TOKENS, "temperature": 0}}
    return {"custom_id": f"good-{i}", "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": f"Say {i}."}], "max_tokens": MAX_TOKENS}}


# (the line, the custom_id its result carries, what its result must be: an error code or a status)
BAD = [
    ('{"custom_id": "cut-short", "url": "/v1/completions", "body": {"prompt"', None, "invalid_json_line"),
    ('["a", "list"]', None, "invalid_json_line"),
    ('{"url": "/v1/completions", "body": {"prompt": "x"}}', None, "missing_required_parameter"),
    ('{"custom_id": "no-url", "body": {"prompt": "x"}}', "no-url", "missing_required_parameter"),
    ('{"custom_id": "no-body", "url": "/v1/completions"}', "no-body", "missing_required_parameter"),
    ('{"custom_id": "messages", "url": "/v1/messages", "body": {"max_tokens": 4}}', "messages", "invalid_url"),
    ('{"custom_id": "embeddings", "url": "/v1/embeddings", "body": {"input": "x"}}', "embeddings", "invalid_url"),
    ('{"custom_id": "good-1", "url": "/v1/completions", "body": {"prompt": "x"}}', "good-1", "duplicate_custom_id"),
    ('{"custom_id": "negative", "url": "/v1/completions", "body": {"prompt": "x", "max_tokens": -1}}',
     "negative", 400),
    ('{"custom_id": "no-messages", "url": "/v1/chat/completions", "body": {"max_tokens": 4}}', "no-messages", 400),
]


def test_run_batch_answers_every_line_once(tmp_path):
    lines = [json.dumps(good_line(i)) for i in range(NUM_GOOD)]
    for k, (text, _, _) in enumerate(BAD):
        lines.insert(k * 19 + 5, text)  # spread among the good ones
    assert len(lines) == 200
    requests, results = tmp_path / "requests.jsonl", tmp_path / "results.jsonl"
    requests.write_text("\n".join(lines) + "\n\n")  # a blank line is no request
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "pagedserve", "run-batch", "-i", str(requests), "-o", str(results),
                           *ENGINE_FLAGS], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    elapsed = time.monotonic() - start
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "200 requests in" in proc.stderr and "190 succeeded, 10 failed" in proc.stderr, proc.stderr[-2000:]
    print(f"run-batch: 200 lines in {elapsed:.1f}s, engine start included")

    out = [json.loads(line) for line in results.read_text().splitlines()]
    assert len(out) == 200
    assert len({r["id"] for r in out}) == 200 and all(r["id"].startswith("batch_req_") for r in out)
    by_id: dict[str | None, list[dict]] = {}
    for r in out:
        assert set(r) == {"id", "custom_id", "response", "error"}, r
        assert (r["response"] is None) != (r["error"] is None), r
        by_id.setdefault(r["custom_id"], []).append(r)

    for i in range(NUM_GOOD):
        records = by_id.pop(f"good-{i}")
        [answer] = [r["response"] for r in records if r["error"] is None]
        assert answer["status_code"] == 200 and answer["request_id"].startswith("req_"), answer
        body = answer["body"]
        assert 1 <= body["usage"]["completion_tokens"] <= MAX_TOKENS, body
        choice = body["choices"][0]
        text = choice["text"] if i % 2 else choice["message"]["content"]
        assert body["object"] == ("text_completion" if i % 2 else "chat.completion") and text, body
        # good-1's custom_id comes again later: that line is refused, the first runs
        refused = [r["error"]["code"] for r in records if r["error"] is not None]
        assert refused == (["duplicate_custom_id"] if i == 1 else []), records

    for text, custom_id, want in BAD:
        if custom_id is not None and custom_id != "good-1":
            [r] = by_id.pop(custom_id)
            if isinstance(want, int):
                assert r["response"]["status_code"] == want, r
                assert r["response"]["body"]["error"]["type"] == "invalid_request_error", r
            else:
                assert r["error"]["code"] == want and r["error"]["message"].startswith("line "), r
    # no custom_id to give: the two lines that are not JSON objects, and the one without it
    unnamed = sorted(r["error"]["code"] for r in by_id.pop(None))
    assert unnamed == ["invalid_json_line", "invalid_json_line", "missing_required_parameter"]
    assert not by_id, by_id  # nothing else came back


def test_run_batch_refuses_a_missing_input_before_starting_an_engine(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "pagedserve", "run-batch", "-i", str(tmp_path / "none.jsonl"),
                           "-o", str(tmp_path / "out.jsonl")], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "no such file" in proc.stderr, proc.stderr
