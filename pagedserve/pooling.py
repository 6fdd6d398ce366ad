"""The offline API's pooling side: `LLM.embed` and `LLM.score` (vLLM's offline shapes).

The input checks and the output math are frontend/pooling.py's, shared with HTTP and gRPC:

    texts / token ids ──► pooling_inputs / score_plan ──► EngineCore.add_pooling_request ×n
        ──► step until each has its vector ──► embedding_vector (dimensions) / ScorePlan.scores
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tqdm import tqdm

from common.ipc import pooler_to_proto
from engine.core import EngineCore
from engine.models.loader import tokenizer_files
from frontend.pooling import (PooledInput, PoolingState, as_inputs, check_dimensions, embedding_vector, pooling_inputs,
                              require_task, score_plan)
from frontend.tokenizer import Tokenizer


@dataclass
class EmbeddingOutput:
    """One input's embedding."""

    request_id: str
    prompt_token_ids: list[int]
    embedding: list[float]

    @property
    def outputs(self) -> EmbeddingOutput:  # vLLM's EmbeddingRequestOutput.outputs.embedding
        return self


@dataclass
class ScoringOutput:
    """One document's relevance to the query: a cross-encoder's sigmoid, or the cosine of the
    two embeddings. `prompt_token_ids`: the pair's tokens (an embedding model: the query's,
    then the document's, as vLLM gives them)."""

    request_id: str
    prompt_token_ids: list[int]
    score: float

    @property
    def outputs(self) -> ScoringOutput:  # vLLM's ScoringRequestOutput.outputs.score
        return self


class OfflinePooling:
    """Runs an `LLM`'s pooling requests on its EngineCore, in this process."""

    def __init__(self, engine: EngineCore, hf_tokenizer) -> None:
        self.engine = engine
        self.pooler = pooler_to_proto(engine.pooler, engine.max_pooling_tokens)
        # The frontend's tokenizer (it truncates as sentence-transformers does); a generating
        # model never needs it, and converting some vocabularies takes seconds.
        self.tokenizer = Tokenizer.from_files(tokenizer_files(hf_tokenizer)) if engine.pooler.pools else None

    def embed(self, inputs: str | Sequence[int] | Sequence[str | Sequence[int]], request_ids,
              truncate_prompt_tokens: int | None, dimensions: int | None, use_tqdm: bool) -> list[EmbeddingOutput]:
        require_task(self.pooler, "embed")
        dimensions = check_dimensions(dimensions, self.pooler)
        pooled = pooling_inputs(self.tokenizer, as_inputs(inputs), self.pooler, self.engine.vocab_size,
                                truncate_prompt_tokens, field_name="inputs")
        ids = [next(request_ids) for _ in pooled]
        vectors = self.run(ids, pooled, use_tqdm, "embedding")
        return [EmbeddingOutput(i, p.token_ids, embedding_vector(v, dimensions, self.pooler))
                for i, p, v in zip(ids, pooled, vectors)]

    def score(self, query: str, documents: str | Sequence[str], request_ids,
              truncate_prompt_tokens: int | None, use_tqdm: bool) -> list[ScoringOutput]:
        require_task(self.pooler, "score", "embed")
        plan = score_plan(self.tokenizer, self.pooler, self.engine.vocab_size, query, documents,
                          truncate_prompt_tokens, names=("query", "documents"))
        ids = [next(request_ids) for _ in plan.inputs]
        values = plan.scores(self.run(ids, plan.inputs, use_tqdm, "scoring"))
        if plan.pairs is None:  # a cross-encoder: one input per pair
            return [ScoringOutput(i, p.token_ids, s) for i, p, s in zip(ids, plan.inputs, values)]
        # An embedding model: each distinct text ran once, so a pair gets an id of its own.
        return [ScoringOutput(next(request_ids), plan.inputs[a].token_ids + plan.inputs[b].token_ids, s)
                for (a, b), s in zip(plan.pairs, values)]

    def run(self, request_ids: list[str], inputs: list[PooledInput], use_tqdm: bool, desc: str) -> list[list[float]]:
        """Each input's vector, in order. On an error (the engine refused one) the rest are
        aborted, so no request or KV block outlives the call."""
        states = {i: PoolingState(i, p) for i, p in zip(request_ids, inputs)}
        pending = set()
        bar = tqdm(total=len(states), desc=desc, unit="input", disable=not use_tqdm)
        try:
            for request_id, state in states.items():
                self.engine.add_pooling_request(request_id, state.prompt, state.pooling)
                pending.add(request_id)
            while pending:
                outputs = self.engine.step()
                if not outputs and not self.engine.has_unfinished_requests():
                    raise RuntimeError(f"the engine dropped {len(pending)} pooling requests")  # never spin
                for out in outputs:
                    if out.request_id in pending:
                        states[out.request_id].process([out])  # raises InvalidRequest for a refused one
                        if states[out.request_id].done:
                            pending.discard(out.request_id)
                            bar.update()
        finally:
            bar.close()
            if pending:
                self.engine.abort_requests(sorted(pending))  # frees their blocks at once
        missing = [i for i, s in states.items() if s.vector is None]
        if missing:
            raise RuntimeError(f"the engine ended {len(missing)} pooling requests without a vector, e.g. {missing[0]}")
        return [states[i].vector for i in request_ids]
