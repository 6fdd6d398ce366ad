"""The embeddings benchmarks' parts without a server: sized texts, requests of several texts,
the /v1/embeddings client over httpx's mock transport, and the flags of `bench serve
--dataset-name embeddings` and `bench embeddings`."""

from __future__ import annotations

import argparse
import asyncio
import json

import httpx
import pytest

from bench import serve_embeddings
from bench.datasets import BenchRequest, EmbedRequest, embedding_requests, sized_texts
from bench.load import RequestRecord
from bench.serve_args import add_arguments, check_args

TARGET = "http://127.0.0.1:9/v1"


def _words(text: str, special: bool) -> int:
    """A tokenizer of one token per word, and [CLS] ... [SEP]."""
    return len(text.split()) + (2 if special else 0)


def test_sized_texts_are_seeded_and_as_long_as_drawn():
    texts = sized_texts(_words, 400, 8, 256, seed=3)
    assert texts == sized_texts(_words, 400, 8, 256, seed=3)
    assert texts != sized_texts(_words, 400, 8, 256, seed=4)
    lengths = [n for _, n in texts]
    assert all(_words(t, True) == n for t, n in texts)
    assert min(lengths) >= 8 and max(lengths) <= 256
    # uniform over [8, 256]: every quarter of the range gets about a quarter of the texts
    quarters = [sum(8 + 62 * q <= n < 8 + 62 * (q + 1) for n in lengths) for q in range(4)]
    assert all(70 <= c <= 130 for c in quarters), quarters
    assert len({t for t, _ in texts}) > 390  # they start at random words: nearly all differ


def test_sized_texts_never_pass_the_longest():
    # a tokenizer that counts a joined text as more than its words: the text is cut back
    texts = sized_texts(lambda text, special: 2 * len(text.split()) + 2 * special, 50, 4, 20, seed=0)
    assert all(n <= 20 for _, n in texts)
    with pytest.raises(ValueError, match="min <= max"):
        sized_texts(_words, 1, 30, 20, seed=0)


def test_embedding_requests_keep_the_order_and_count_the_tokens():
    texts = [(f"t{i}", i + 1) for i in range(10)]
    requests = embedding_requests(texts, 4)
    assert [r.texts for r in requests] == [["t0", "t1", "t2", "t3"], ["t4", "t5", "t6", "t7"], ["t8", "t9"]]
    assert [r.prompt_len for r in requests] == [10, 26, 19] and all(r.output_len == 0 for r in requests)


def _embed(answer, request: BenchRequest) -> tuple[RequestRecord, list, list[dict]]:
    sent, vectors = [], []

    def handle(req: httpx.Request) -> httpx.Response:
        sent.append(json.loads(req.content))
        return answer(req)

    async def go():
        async with httpx.AsyncClient(base_url=TARGET + "/", transport=httpx.MockTransport(handle)) as client:
            return await serve_embeddings.embed(client, "minilm", request,
                                                on_vectors=lambda r, v: vectors.append(v))

    return asyncio.run(go()), vectors, sent


def _body(num: int, tokens: int = 7) -> dict:
    data = [{"object": "embedding", "index": i, "embedding": [0.1 * (i + 1)] * 4} for i in reversed(range(num))]
    return {"object": "list", "data": data, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def test_embed_posts_the_texts_and_reads_the_vectors_in_order():
    record, [vectors], [sent] = _embed(lambda _: httpx.Response(200, json=_body(2, 9)),
                                       EmbedRequest("", 8, 0, ["a b", "c"]))
    assert sent == {"model": "minilm", "input": ["a b", "c"]}
    assert record.ok and record.code == "OK" and record.prompt_tokens == 9  # the server's count wins
    assert record.e2e_s > 0 and record.num_output_tokens == 0
    assert vectors == [[0.1] * 4, [0.2] * 4]  # by index, whatever order they came in
    # the warm-up's requests are token ids: one input
    record, _, [sent] = _embed(lambda _: httpx.Response(200, json=_body(1)), BenchRequest([101, 102], 2, 4))
    assert sent["input"] == [101, 102] and record.ok


@pytest.mark.parametrize("answer,code", [
    (lambda _: httpx.Response(400, json={"error": {"message": "too long", "type": "invalid_request_error"}}),
     "HTTP_400"),
    (lambda _: httpx.Response(200, json=_body(1)), "BAD_RESPONSE"),  # one vector for two texts
    (lambda _: httpx.Response(200, text="not json"), "BAD_RESPONSE"),
    (lambda _: (_ for _ in ()).throw(httpx.ConnectError("refused")), "ConnectError"),
])
def test_embed_failures_are_records_not_exceptions(answer, code):
    record, vectors, _ = _embed(answer, EmbedRequest("", 8, 0, ["a", "b"]))
    assert not record.ok and record.code == code and record.error and vectors == []


def test_summary_extras_count_texts_of_completed_requests():
    requests = embedding_requests([("a", 3)] * 5, 2)  # 2 + 2 + 1 texts
    records = [RequestRecord(prompt_tokens=6, ok=True), RequestRecord(prompt_tokens=6),
               RequestRecord(prompt_tokens=3, ok=True)]
    assert serve_embeddings.summary_extras(records, requests, 2.0) == {
        "texts": 3, "texts_per_s": 1.5, "prompt_tok_s": 4.5}


def _serve_args(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(["--dataset-name", "embeddings", *flags])


def test_bench_serve_embeddings_defaults_to_minilm():
    args = _serve_args("--embed-batch-size", "16")
    plan = check_args(args)
    assert plan.dataset == "embeddings" and args.model == "all-MiniLM-L6-v2" and args.embed_batch_size == 16
    args = _serve_args("--model", "/some/folder", "--backend", "openai", "--target", TARGET, "--goodput", "e2e:50")
    assert check_args(args).slos == {"e2e": 50} and args.model == "/some/folder"


@pytest.mark.parametrize("flags,message", [
    (["--backend", "hf"], "posts to /v1/embeddings"),
    (["--target", "127.0.0.1:50051"], "posts to /v1/embeddings"),
    (["--sweep-rates", "1,2"], "one --request-rate at a time"),
    (["--goodput", "ttft:100"], "only an E2E latency"),
    (["--embed-min-len", "300"], "--embed-max-len"),
    (["--embed-batch-size", "0"], "--embed-batch-size"),
])
def test_bench_serve_embeddings_refuses(flags, message):
    with pytest.raises(SystemExit, match=message):
        check_args(_serve_args(*flags))


def test_bench_embeddings_flags():
    from pagedserve.cli import build_parser
    args = build_parser().parse_args(["bench", "embeddings", "--st-batch-sizes", "8,16", "--st-dtypes", "float32"])
    assert (args.model, args.num_texts, args.min_len, args.max_len) == ("all-MiniLM-L6-v2", 2000, 8, 256)
    assert (args.st_batch_sizes, args.st_dtypes, args.texts_per_request, args.clients) == ([8, 16], ["float32"], 64, 8)
    assert (args.latency_requests, args.latency_clients, args.offline) == (1000, 32, True)
    for bad in (["--st-batch-sizes", "0"], ["--st-dtypes", "float16"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["bench", "embeddings", *bad])
