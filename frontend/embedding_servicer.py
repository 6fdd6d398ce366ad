"""The gRPC Embedding service: Embed and Score for a pooling model (--task embed or score).

It only translates: the inputs' checks, the pairing and the scores are frontend/pooling.py's,
shared with HTTP's /v1/embeddings, /score and /v1/rerank; the vectors come from
AsyncLLM.encode; errors map to status codes through servicers.status_codes, as for Generate.
"""

from __future__ import annotations

import uuid
from contextlib import asynccontextmanager

from common.v1 import embedding_pb2 as emb, embedding_pb2_grpc
from frontend.metrics import outcome_code
from frontend.pooling import check_dimensions, embedding_vector, pooling_inputs, pooling_model, score_plan
from frontend.request_log import RequestLog
from frontend.servicers import GrpcContext, check_request_id, status_codes


class EmbeddingService(embedding_pb2_grpc.EmbeddingServicer):
    def __init__(self, ctx: GrpcContext) -> None:
        self.ctx = ctx

    async def Embed(self, request: emb.EmbedRequest, context):  # noqa: N802 - gRPC's name
        async with self._call(context, request.request_id) as (request_id, record):
            processor, pooler = pooling_model(self.ctx.llm, "embed")
            dimensions = check_dimensions(request.dimensions if request.HasField("dimensions") else None, pooler)
            inputs = pooling_inputs(processor.tokenizer, [_embed_input(i) for i in request.inputs], pooler,
                                    processor.limits.vocab_size, _truncate(request), "inputs")
            vectors = await self.ctx.llm.encode(inputs, request_id, request.priority)
            embeddings = [emb.EmbeddingVector(index=i, values=embedding_vector(v, dimensions, pooler),
                                              prompt_tokens=len(item.token_ids))
                          for i, (v, item) in enumerate(zip(vectors, inputs))]
            tokens = sum(len(i.token_ids) for i in inputs)
            record.fields.update(inputs=len(inputs), prompt_tokens=tokens)
            return emb.EmbedResponse(request_id=request_id, embeddings=embeddings, prompt_tokens=tokens)

    async def Score(self, request: emb.ScoreRequest, context):  # noqa: N802
        async with self._call(context, request.request_id) as (request_id, record):
            processor, pooler = pooling_model(self.ctx.llm, "score", "embed")
            plan = score_plan(processor.tokenizer, pooler, processor.limits.vocab_size, request.query,
                              list(request.documents), _truncate(request), names=("query", "documents"))
            values = plan.scores(await self.ctx.llm.encode(plan.inputs, request_id, request.priority))
            record.fields.update(inputs=len(values), prompt_tokens=plan.num_prompt_tokens)
            return emb.ScoreResponse(request_id=request_id, prompt_tokens=plan.num_prompt_tokens,
                                     scores=[emb.DocumentScore(index=i, score=s) for i, s in enumerate(values)])

    @asynccontextmanager
    async def _call(self, context, request_id: str):
        """One call: counted as an active gRPC stream, its errors mapped to status codes, one
        request-log line at its end. Yields (the request's id, assigned if the caller gave
        none; its log record)."""
        record, error = RequestLog(self.ctx.log_prompts), None
        active = self.ctx.metrics.active_streams.labels("grpc")
        active.inc()
        try:
            async with status_codes(context):
                check_request_id(request_id)
                record.fields["request_id"] = request_id = request_id or uuid.uuid4().hex
                yield request_id, record
        except BaseException as e:
            error = e
            raise
        finally:
            active.dec()
            record.write(outcome_code(context, error).name)


def _embed_input(item: emb.EmbedInput) -> str | list[int]:
    """One input as pooling_inputs takes it: a text, or token ids (unset: an empty text, refused there)."""
    return list(item.token_ids.ids) if item.WhichOneof("kind") == "token_ids" else item.text


def _truncate(request) -> int | None:
    return request.truncate_prompt_tokens if request.HasField("truncate_prompt_tokens") else None
