"""`bench serve --dataset-name embeddings`: POST /v1/embeddings under bench serve's load.

Each request carries --embed-batch-size texts of our own prose (bench.datasets.sized_texts),
their lengths uniform in [--embed-min-len, --embed-max-len] tokens of the model's tokenizer,
special tokens included, to `{base}/embeddings` of a `pagedserve serve` started here or of
--backend openai --target. A request is ok on a 200 with one vector per input. Its record
holds the usage's prompt tokens and no output tokens, so its only latency is E2E (send to the
whole response); the summary adds texts/s and prompt tok/s. bench.embeddings times the same
requests against sentence-transformers.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import httpx

from bench.datasets import BenchRequest, EmbedRequest, embedding_requests, sized_texts
from bench.load import RequestRecord
from bench.openai_client import error_body, error_code

DEFAULT_MODEL = "all-MiniLM-L6-v2"


def workload_requests(count_tokens: Callable[[str, bool], int], args: argparse.Namespace, seed: str
                      ) -> tuple[list[EmbedRequest], dict]:
    """--num-prompts requests of --embed-batch-size texts each, and what the JSON says of them."""
    texts = sized_texts(count_tokens, args.num_prompts * args.embed_batch_size, args.embed_min_len,
                        args.embed_max_len, seed)
    return embedding_requests(texts, args.embed_batch_size), {
        "texts_per_request": args.embed_batch_size, "num_texts": len(texts), "min_len": args.embed_min_len,
        "max_len": args.embed_max_len, "mean_text_len": statistics.fmean(n for _, n in texts)}


def num_inputs(request: BenchRequest) -> int:
    return len(request.texts) if isinstance(request, EmbedRequest) else 1


async def embed(client: httpx.AsyncClient, model: str, request: BenchRequest, run_start: float | None = None,
                on_vectors: Callable[[BenchRequest, list[list[float]]], None] | None = None) -> RequestRecord:
    """One /v1/embeddings call: an EmbedRequest's texts, or another request's prompt (the
    warm-up's token ids) as one input. `on_vectors` sees a completed request's vectors (a
    caller that checks them)."""
    record, vectors = RequestRecord(prompt_tokens=request.prompt_len), []
    inputs = request.texts if isinstance(request, EmbedRequest) else request.prompt
    start = time.perf_counter()
    record.sent_at_s = start - (run_start or start)
    try:
        response = await client.post("embeddings", json={"model": model, "input": inputs})
        vectors = check_response(record, response, num_inputs(request))  # parsing the JSON is timed too
    except httpx.HTTPError as e:  # refused, reset, timed out: the request failed, the run goes on
        record.code, record.error = type(e).__name__, str(e) or repr(e)
    record.e2e_s = time.perf_counter() - start
    if vectors and on_vectors is not None:
        on_vectors(request, vectors)
    return record


def check_response(record: RequestRecord, response: httpx.Response, expected: int) -> list[list[float]]:
    """The vectors of an OpenAI embeddings response, in input order, with `record` filled in
    (ok and the usage's prompt tokens, or the error); [] when it failed."""
    if response.status_code != 200:
        record.code, record.error = error_code(response.status_code, error_body(response.content))
        return []
    try:
        body = response.json()
        data = sorted(body["data"], key=lambda d: d["index"])
        vectors = [d["embedding"] for d in data]
        tokens = body["usage"]["prompt_tokens"]
    except (ValueError, KeyError, TypeError) as e:
        record.code, record.error = "BAD_RESPONSE", f"not an embeddings response: {e!r}"
        return []
    if len(vectors) != expected or not all(isinstance(v, list) and v for v in vectors):
        record.code, record.error = "BAD_RESPONSE", f"{len(vectors)} vectors for {expected} inputs"
        return []
    record.ok, record.prompt_tokens = True, tokens
    return vectors


def summary_extras(records: list[RequestRecord], requests: list[BenchRequest], duration_s: float) -> dict:
    """texts/s and prompt tok/s over the completed requests."""
    done = [(r, q) for r, q in zip(records, requests) if r.ok]
    texts = sum(num_inputs(q) for _, q in done)
    tokens = sum(r.prompt_tokens for r, _ in done)
    return {"texts": texts, "texts_per_s": texts / duration_s, "prompt_tok_s": tokens / duration_s}
