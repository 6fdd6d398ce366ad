"""`bench serve --backend openai` without a server: SSE parsing, token times, the records
the metrics take, and the client over httpx's mock transport."""

from __future__ import annotations

import argparse
import asyncio
import json
import re

import httpx
import pytest

from bench import openai_client
from bench.datasets import BenchRequest
from bench.load import RequestRecord
from bench.openai_client import CompletionStream, completion_body, error_code, spread_token_times, sse_data
from bench.serve_args import add_arguments, check_args
from bench.serve_metrics import summarize

TARGET = "http://127.0.0.1:9/v1"


def _chunk(text: str, finish_reason: str | None = None) -> str:
    return "data: " + json.dumps({"object": "text_completion", "choices": [
        {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}]})


def _usage(completion_tokens: int, prompt_tokens: int = 8, cached_tokens: int | None = None) -> str:
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
             "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return "data: " + json.dumps({"object": "text_completion", "choices": [], "usage": usage})


def _record(output_len: int = 4) -> RequestRecord:
    return RequestRecord(prompt_tokens=8, expected_output_tokens=output_len)


def _feed(lines: list[tuple[str, float]]) -> CompletionStream:
    stream = CompletionStream()
    for line, now_s in lines:
        stream.feed(line, now_s)
    return stream


# --- SSE lines --------------------------------------------------------------------------

def test_sse_data_takes_data_lines_only():
    assert sse_data('data: {"a": 1}') == '{"a": 1}'
    assert sse_data('data:{"a": 1}') == '{"a": 1}'  # the space after the colon is optional
    assert sse_data("data:  x") == " x"  # only one space is stripped
    assert sse_data("data: [DONE]") == "[DONE]"
    for other in ("", ":", ": ping", "event: error", "id: 3", "retry: 10", '{"data": 1}'):
        assert sse_data(other) is None


# --- token times ------------------------------------------------------------------------

@pytest.mark.parametrize("times,num_tokens,expected", [
    ([1.0, 2.0, 3.0], 3, [1.0, 2.0, 3.0]),  # one token a chunk
    ([1.0, 2.0, 3.0], 7, [1.0, 1.0, 1.0, 2.0, 2.0, 3.0, 3.0]),  # 3, 2, 2: the first takes the rest
    ([1.0, 2.0], 6, [1.0, 1.0, 1.0, 2.0, 2.0, 2.0]),
    ([1.0, 2.0, 3.0, 4.0], 2, [1.0, 3.0]),  # more chunks than tokens: 1, 0, 1, 0
    ([1.0, 2.0], 1, [1.0]),
    ([1.0, 2.0], 0, []),
    ([], 5, []),
])
def test_spread_token_times(times, num_tokens, expected):
    assert spread_token_times(times, num_tokens) == expected


# --- one stream into one record ---------------------------------------------------------

def test_stream_of_one_token_per_chunk_becomes_a_record():
    stream = _feed([(_chunk(" Hello"), 0.25), (_chunk(","), 0.30), (_chunk(" world"), 0.35),
                    (_chunk("!", "length"), 0.40), ("", 0.40), (_usage(4, cached_tokens=0), 0.41),
                    ("data: [DONE]", 0.42)])
    record = stream.fill(_record(), end_s=0.43)
    assert record.ok and record.code == "OK" and record.error == ""
    assert record.token_times_s == [0.25, 0.30, 0.35, 0.40]
    assert record.num_output_tokens == 4
    assert record.ttft_s == 0.25 and record.e2e_s == 0.43
    assert (record.prompt_tokens, record.cached_tokens) == (8, 0)


def test_chunks_without_text_do_not_start_the_clock():
    # vLLM may send an empty first chunk; llama-server pings with comments while it is busy.
    stream = _feed([(_chunk(""), 0.1), (": ping", 0.2), (_chunk(" a"), 0.5), (_chunk(" b", "length"), 0.6),
                    (_usage(2), 0.6), ("data: [DONE]", 0.6)])
    record = stream.fill(_record(2), end_s=0.61)
    assert record.ttft_s == 0.5 and record.token_times_s == [0.5, 0.6]


def test_usage_count_wins_over_chunk_count():
    # Five tokens in two chunks (a server that batches its writes under load).
    stream = _feed([(_chunk(" one two three"), 1.0), (_chunk(" four five", "length"), 2.0), (_usage(5, 16, 12), 2.0),
                    ("data: [DONE]", 2.0)])
    record = stream.fill(_record(5), end_s=2.0)
    assert record.token_times_s == [1.0, 1.0, 1.0, 2.0, 2.0]
    assert (record.prompt_tokens, record.cached_tokens) == (16, 12)


def test_without_usage_each_text_chunk_is_a_token():
    stream = _feed([(_chunk("a"), 1.0), (_chunk("b"), 1.5), ("data: [DONE]", 1.6)])
    record = stream.fill(_record(2), end_s=1.6)
    assert record.ok and record.token_times_s == [1.0, 1.5]
    assert record.prompt_tokens == 8  # the planned length stands


def test_tokens_without_text_count_at_the_end():
    stream = _feed([(_chunk("", "length"), 0.9), (_usage(3), 0.9), ("data: [DONE]", 0.9)])
    record = stream.fill(_record(3), end_s=1.0)
    assert record.ok and record.token_times_s == [1.0, 1.0, 1.0] and record.ttft_s == 1.0


def test_error_event_fails_the_request_with_its_message():
    error = {"error": {"code": 500, "message": "the slot's context is full", "type": "server_error"}}
    stream = _feed([(_chunk(" a"), 0.1), ("data: " + json.dumps(error), 0.2), ("data: [DONE]", 0.3)])
    record = stream.fill(_record(), end_s=0.3)
    assert not record.ok
    assert (record.code, record.error) == ("HTTP_500", "the slot's context is full")
    assert record.e2e_s == 0.3


def test_stream_without_done_or_with_bad_json_fails():
    cut = _feed([(_chunk(" a"), 0.1)]).fill(_record(), end_s=0.2)
    assert not cut.ok and cut.code == "UNKNOWN" and "[DONE]" in cut.error
    bad = _feed([("data: {not json", 0.1), ("data: [DONE]", 0.2)]).fill(_record(), end_s=0.2)
    assert not bad.ok and bad.code == "BAD_EVENT"


def test_error_codes():
    assert error_code(400, {"message": "too long", "type": "invalid_request_error"}) == ("HTTP_400", "too long")
    assert error_code(None, {"message": "m", "type": "BadRequestError", "code": 400}) == ("HTTP_400", "m")
    assert error_code(None, {"message": "m", "type": "server_error"}) == ("server_error", "m")
    assert error_code(503, "Service Unavailable") == ("HTTP_503", "Service Unavailable")
    assert error_code(None, "boom") == ("ERROR", "boom")


def test_records_from_both_apis_give_the_same_metrics():
    stream = _feed([(_chunk(" a"), 0.1), (_chunk(" b c"), 0.3), (_chunk(" d", "length"), 0.4), (_usage(4), 0.4),
                    ("data: [DONE]", 0.4)])
    openai = stream.fill(_record(), end_s=0.4)
    # What bench.load.generate makes of the same tokens in gRPC Chunks of 1, 2 and 1.
    grpc = RequestRecord(prompt_tokens=8, expected_output_tokens=4, ok=True, ttft_s=0.1, e2e_s=0.4,
                         token_times_s=[0.1, 0.3, 0.3, 0.4])
    a, b = summarize([openai], 1.0), summarize([grpc], 1.0)
    assert a["output_tokens"] == b["output_tokens"] == 4
    assert a["median_ttft_ms"] == b["median_ttft_ms"] == pytest.approx(100.0)
    assert a["mean_tpot_ms"] == pytest.approx(b["mean_tpot_ms"]) == pytest.approx(100.0)
    # The spread gives the first chunk the extra token: the same ITLs (0, 100, 200 ms), in another order.
    assert openai.token_times_s == [0.1, 0.1, 0.3, 0.4]
    for stat in ("mean", "median", "p99"):
        assert a[f"{stat}_itl_ms"] == pytest.approx(b[f"{stat}_itl_ms"])


# --- the request and the client ---------------------------------------------------------

def test_completion_body_asks_for_exactly_the_planned_tokens():
    ids = completion_body(BenchRequest([101, 102, 103], 3, 16), "smol")
    assert ids == {"model": "smol", "prompt": [101, 102, 103], "max_tokens": 16, "temperature": 0.0,
                   "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    text = completion_body(BenchRequest("How do magnets work?", 6, 5), "smol")
    assert text["prompt"] == "How do magnets work?" and text["max_tokens"] == 5


def _sse(*lines: str) -> bytes:
    return "".join(line + "\n\n" for line in lines).encode()


def _run_generate(handler, request: BenchRequest) -> tuple[RequestRecord, list[httpx.Request]]:
    seen = []

    def record_and_answer(req: httpx.Request) -> httpx.Response:
        seen.append(req)
        return handler(req)

    async def go() -> RequestRecord:
        async with httpx.AsyncClient(base_url=TARGET + "/", transport=httpx.MockTransport(record_and_answer),
                                     headers={"Authorization": "Bearer k"}) as client:
            return await openai_client.generate(client, "smol", request)

    return asyncio.run(go()), seen


def test_generate_posts_to_completions_and_reads_the_stream():
    body = _sse(_chunk(" x"), _chunk(" y"), _chunk(" z", "length"), _usage(3, 3, 0), "data: [DONE]")
    record, [sent] = _run_generate(
        lambda req: httpx.Response(200, content=body, headers={"content-type": "text/event-stream"}),
        BenchRequest([101, 102, 103], 3, 3))
    assert sent.method == "POST" and str(sent.url) == TARGET + "/completions"
    assert sent.headers["authorization"] == "Bearer k"
    assert json.loads(sent.content)["prompt"] == [101, 102, 103]
    assert record.ok and record.num_output_tokens == 3 and record.expected_output_tokens == 3
    assert 0 <= record.ttft_s <= record.token_times_s[-1] <= record.e2e_s
    assert record.sent_at_s == 0.0


def test_generate_counts_http_errors_and_refused_connections():
    too_long = {"error": {"code": 400, "message": "the prompt exceeds the context size",
                          "type": "invalid_request_error"}}
    record, _ = _run_generate(lambda req: httpx.Response(400, json=too_long), BenchRequest([101], 1, 2))
    assert not record.ok and (record.code, record.error) == ("HTTP_400", "the prompt exceeds the context size")
    record, _ = _run_generate(lambda req: httpx.Response(502, text="Bad Gateway"), BenchRequest([101], 1, 2))
    assert (record.code, record.error) == ("HTTP_502", "Bad Gateway")

    def refuse(req: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=req)

    record, _ = _run_generate(refuse, BenchRequest([101], 1, 2))
    assert not record.ok and record.code == "ConnectError" and "refused" in record.error
    assert record.e2e_s >= 0


def test_served_model_is_the_named_one_or_the_first_listed(monkeypatch):
    assert openai_client.served_model(TARGET, "mine", None) == ("mine", {})
    calls = []

    def fake_get(url, **kwargs):
        calls.append((url, kwargs["headers"]))
        listing = {"object": "list", "data": [{"id": "smol.gguf", "object": "model", "meta": {"n_vocab": 49152}},
                                              {"id": "other"}]}
        return httpx.Response(200, json=listing, request=httpx.Request("GET", url))

    monkeypatch.setattr(openai_client.httpx, "get", fake_get)
    name, entry = openai_client.served_model(TARGET, None, "k")
    assert name == "smol.gguf" and entry["meta"]["n_vocab"] == 49152
    assert calls == [(TARGET + "/models", {"Authorization": "Bearer k"})]
    monkeypatch.setattr(openai_client.httpx, "get", lambda url, **kw: httpx.Response(
        200, json={"data": []}, request=httpx.Request("GET", url)))
    with pytest.raises(SystemExit, match="--served-model-name"):
        openai_client.served_model(TARGET, None, None)


# --- flags ------------------------------------------------------------------------------

def _check(*flags: str):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(list(flags))
    return args, check_args(args)


def test_openai_backend_needs_a_url_target():
    args, plan = _check("--backend", "openai", "--target", TARGET + "/", "--label", "llama-server")
    assert plan.backends == ["openai"] and args.target == TARGET  # the trailing slash goes
    for flags, message in [(["--backend", "openai"], "--target http://HOST:PORT/v1"),
                           (["--backend", "openai", "--target", "127.0.0.1:50051"], "--target http://"),
                           (["--backend", "pagedserve,openai"], "give it alone"),
                           (["--target", TARGET], "add --backend openai"),
                           (["--served-model-name", "x"], "for --backend openai"),
                           (["--backend", "openai", "--target", TARGET, "--label", "a/b"], "--label")]:
        with pytest.raises(SystemExit, match=re.escape(message)):
            _check(*flags)


# --- the peer comparison's summary ------------------------------------------------------

def test_peer_comparison_report_writes_table_json_and_png(tmp_path, capsys):
    from bench.compare_peers import _report
    rows = [{"peer": peer, "concurrency": c, "completed": 4, "failed": 0, "output_tok_s": tok_s,
             "median_ttft_ms": 50.0 * c, "p99_ttft_ms": 80.0 * c, "median_tpot_ms": 10.0 * c, "p99_tpot_ms": 15.0 * c}
            for peer, base in (("pagedserve-grpc", 40.0), ("llama-server", 90.0))
            for c, tok_s in ((1, base), (32, 8 * base))]
    rows.append({"peer": "pagedserve-http", "concurrency": 1, "error": "bench serve wrote no JSON"})
    args = argparse.Namespace(input_len=128, output_len=128, threads=2, dtype="auto", cpu_arithmetic="auto",
                              output_dir=tmp_path, loadavg_before=(1.5, 1.0, 0.5),
                              offline_results=None)  # as run() sets them
    _report(rows, args, tmp_path / "model.gguf", ["pagedserve-grpc", "pagedserve-http"])
    out = capsys.readouterr().out
    assert "TPOT p99" in out and "llama-server" in out and "720" in out  # 8 x 90 tok/s
    [path] = tmp_path.glob("compare-peers-*.json")
    payload = json.loads(path.read_text())
    assert payload["runs"] == rows and payload["llama_server"] is None and payload["offline"] is None
    assert payload["loadavg_before"] == [1.5, 1.0, 0.5] and len(payload["loadavg_after"]) == 3
    assert "cpu_flags" in payload["machine"] and payload["machine"]["cpu"]
    assert (tmp_path / payload["plot"]).stat().st_size > 10_000
