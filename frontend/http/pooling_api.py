"""Embeddings and scores over HTTP, in the shapes clients already speak:

    POST /v1/embeddings            OpenAI's (the `openai` SDK's embeddings.create)
    POST /score, /v1/score         vLLM's text_1 / text_2 scores
    POST /rerank, /v1/rerank, /v2/rerank   Cohere's and Jina's rerank (as vLLM serves it)

The input and output logic is frontend/pooling.py's, shared with gRPC and the offline LLM;
the inputs run as one pooling request each, batched by the engine's scheduler.
"""

from __future__ import annotations

import base64
import struct
import time
import uuid

from fastapi import FastAPI, Request

from common.errors import InvalidRequest

from frontend.http.context import HttpContext, parse_body
from frontend.http.protocol import EmbeddingRequest, RerankRequest, ScoreRequest
from frontend.http.runner import unless_disconnected
from frontend.pooling import as_inputs, check_dimensions, embedding_vector, pooling_inputs, pooling_model, score_plan


def add_pooling_routes(app: FastAPI, ctx: HttpContext) -> None:
    @app.post("/v1/embeddings")
    async def embeddings(request: Request):
        return await create_embeddings(ctx, request)

    async def score(request: Request):
        return await create_score(ctx, request)

    async def rerank(request: Request):
        return await create_rerank(ctx, request)

    for path in ("/score", "/v1/score"):
        app.post(path)(score)
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        app.post(path)(rerank)


async def create_embeddings(ctx: HttpContext, request: Request):
    body = await parse_body(request, EmbeddingRequest)
    ctx.resolve_model(body.model)
    processor, pooler = pooling_model(ctx.llm, "embed")
    dimensions = check_dimensions(body.dimensions, pooler)
    inputs = pooling_inputs(processor.tokenizer, as_inputs(body.input), pooler, processor.limits.vocab_size,
                            body.truncate_prompt_tokens)
    vectors = await _run(ctx, request, inputs, body.priority)
    encode = _base64 if body.encoding_format == "base64" else (lambda v: v)
    data = [{"object": "embedding", "index": i, "embedding": encode(embedding_vector(v, dimensions, pooler))}
            for i, v in enumerate(vectors)]
    tokens = sum(len(i.token_ids) for i in inputs)
    return {"object": "list", "data": data, "model": body.model or ctx.served_name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


async def create_score(ctx: HttpContext, request: Request):
    body = await parse_body(request, ScoreRequest)
    ctx.resolve_model(body.model)
    processor, pooler = pooling_model(ctx.llm, "score", "embed")
    plan = score_plan(processor.tokenizer, pooler, processor.limits.vocab_size, body.text_1, body.text_2,
                      body.truncate_prompt_tokens)
    values = plan.scores(await _run(ctx, request, plan.inputs, body.priority))
    tokens = plan.num_prompt_tokens
    return {"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
            "model": body.model or ctx.served_name,
            "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(values)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


async def create_rerank(ctx: HttpContext, request: Request):
    body = await parse_body(request, RerankRequest)
    ctx.resolve_model(body.model)
    processor, pooler = pooling_model(ctx.llm, "score", "embed")
    if body.top_n is not None and body.top_n < 1:
        raise InvalidRequest(f"top_n: must be at least 1, got {body.top_n}")
    plan = score_plan(processor.tokenizer, pooler, processor.limits.vocab_size, body.query, body.documents,
                      body.truncate_prompt_tokens, names=("query", "documents"))
    values = plan.scores(await _run(ctx, request, plan.inputs, body.priority))
    ranked = sorted(range(len(values)), key=lambda i: -values[i])[:body.top_n]
    results = [{"index": i, "relevance_score": values[i],
                **({"document": {"text": body.documents[i]}} if body.return_documents else {})} for i in ranked]
    return {"id": f"rerank-{uuid.uuid4().hex}", "model": body.model or ctx.served_name,
            "usage": {"total_tokens": plan.num_prompt_tokens}, "results": results}


async def _run(ctx: HttpContext, request: Request, inputs, priority: int) -> list[list[float]]:
    return await unless_disconnected(request, ctx.counted_call(ctx.llm.encode(inputs, priority=priority)))



def _base64(vector: list[float]) -> str:
    """OpenAI's base64 encoding: the float32 values, little-endian."""
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
