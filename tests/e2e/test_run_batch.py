"""`pagedserve run-batch` as a real process on the bundled model: a 100-line file in OpenAI's
batch format, some lines bad. Every line gets exactly one result line; good lines a 200 with
a real completion, bad ones an error line or the route's 400; the run exits 0. And on
all-MiniLM-L6-v2, a file of /v1/embeddings lines, each vector checked against
sentence-transformers'."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.heavy(75)  # seconds on the 2-core CI machine: scheduled first

ROOT = Path(__file__).resolve().parents[2]
# conftest's ENGINE_FLAGS (a test module cannot import it)
ENGINE_FLAGS = ["--dtype", "float32", "--num-kv-blocks", "512", "--max-model-len", "2048", "--num-threads", "1"]
NUM_GOOD = 90  # and len(BAD) bad lines: 100 in all
MAX_TOKENS = 4
MINILM_FLAGS = ["--model", "all-MiniLM-L6-v2", "--dtype", "float32", "--num-threads", "1"]
PROSE = ROOT / "bench" / "data" / "perplexity.txt"


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
        lines.insert(k * 9 + 5, text)  # spread among the good ones
    assert len(lines) == 100
    requests, results = tmp_path / "requests.jsonl", tmp_path / "results.jsonl"
    requests.write_text("\n".join(lines) + "\n\n")  # a blank line is no request
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "pagedserve", "run-batch", "-i", str(requests), "-o", str(results),
                           *ENGINE_FLAGS], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    elapsed = time.monotonic() - start
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "100 requests in" in proc.stderr and "90 succeeded, 10 failed" in proc.stderr, proc.stderr[-2000:]
    print(f"run-batch: 100 lines in {elapsed:.1f}s, engine start included")

    out = [json.loads(line) for line in results.read_text().splitlines()]
    assert len(out) == 100
    assert len({r["id"] for r in out}) == 100 and all(r["id"].startswith("batch_req_") for r in out)
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


def test_run_batch_embeds_as_sentence_transformers_does(tmp_path):
    from sentence_transformers import SentenceTransformer

    from engine.models.source import minilm_model_path
    st = SentenceTransformer(str(minilm_model_path()), device="cpu")
    words = PROSE.read_text().split()
    texts = [" ".join(words[7 * i:7 * i + n]) for i, n in enumerate((1, 3, 12, 40, 90, 160, 5, 25))]
    texts.append(" ".join(words[:600]))  # past the model's 256 tokens: cut, as sentence-transformers cuts it
    ids = st.tokenizer(texts[3])["input_ids"]
    # (custom_id, input, the texts its vectors must match in order)
    lines = [(f"text-{i}", text, [text]) for i, text in enumerate(texts[:-1])]
    lines += [("several", texts[4:7], texts[4:7]), ("token-ids", ids, [texts[3]]),
              ("too-long", texts[-1], [texts[-1]])]
    requests = [{"custom_id": c, "method": "POST", "url": "/v1/embeddings",
                 "body": {"model": "all-MiniLM-L6-v2", "input": x,
                          **({"truncate_prompt_tokens": -1} if c == "too-long" else {})}} for c, x, _ in lines]
    requests.append({"custom_id": "chat", "url": "/v1/chat/completions",
                     "body": {"messages": [{"role": "user", "content": "Hi"}]}})
    path, results = tmp_path / "requests.jsonl", tmp_path / "results.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in requests))
    proc = subprocess.run([sys.executable, "-m", "pagedserve", "run-batch", "-i", str(path), "-o", str(results),
                           *MINILM_FLAGS], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"{len(requests)} requests in" in proc.stderr and f"{len(lines)} succeeded, 1 failed" in proc.stderr

    out = {r["custom_id"]: r for r in map(json.loads, results.read_text().splitlines())}
    assert sorted(out) == sorted(r["custom_id"] for r in requests)  # each line once
    # an embedding model serves no chat: the line is refused before it is sent
    assert out.pop("chat")["error"]["code"] == "invalid_url"
    for custom_id, _, expected in lines:
        record = out[custom_id]
        assert record["error"] is None and record["response"]["status_code"] == 200, record
        body = record["response"]["body"]
        assert [d["index"] for d in body["data"]] == list(range(len(expected))), body  # in input order
        got = np.array([d["embedding"] for d in body["data"]])
        want = st.encode(expected, convert_to_numpy=True)
        assert got.shape == (len(expected), 384)
        cosines = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
        assert cosines.min() >= 0.9999, (custom_id, cosines)
        tokens = sum(min(256, len(st.tokenizer(t)["input_ids"])) for t in expected)
        assert body["usage"]["prompt_tokens"] == tokens, (custom_id, body["usage"])


def test_batches_api_takes_the_embeddings_endpoint_of_an_embedding_model(tmp_path):
    import openai

    from bench.servers import server_for
    from engine.config import EngineConfig
    server = server_for("pagedserve", EngineConfig(model="all-MiniLM-L6-v2", dtype="float32", num_threads=1), 256)
    server.cmd += ["--data-dir", str(tmp_path)]
    server.start()
    try:
        client = openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="unused", max_retries=0)
        lines = [{"custom_id": f"e-{i}", "method": "POST", "url": "/v1/embeddings",
                  "body": {"input": ["a short text", f"text {i}"]}} for i in range(4)]
        upload = client.files.create(file=("e.jsonl", "".join(json.dumps(x) + "\n" for x in lines).encode()),
                                     purpose="batch")
        with pytest.raises(openai.BadRequestError, match="use one of /v1/embeddings"):
            client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
        batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/embeddings", completion_window="24h")
        deadline = time.monotonic() + 60
        while batch.status not in ("completed", "failed", "cancelled", "expired"):
            assert time.monotonic() < deadline, batch
            time.sleep(0.2)
            batch = client.batches.retrieve(batch.id)
        assert batch.status == "completed" and (batch.request_counts.completed, batch.request_counts.failed) == (4, 0)
        out = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
        assert sorted(r["custom_id"] for r in out) == [f"e-{i}" for i in range(4)]
        first = np.array([r["response"]["body"]["data"][0]["embedding"] for r in out])
        assert first.shape == (4, 384)
        # the same text, the same vector (up to rounding: its batch-mates differ from step to step)
        assert np.allclose(first, first[0], atol=1e-5)
    finally:
        server.stop()
