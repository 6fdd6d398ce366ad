"""Embeddings and scores: the input and output side of pooling requests, shared by HTTP
(/v1/embeddings, /score, /v1/rerank), gRPC (Embedding) and the offline `LLM`.

    inputs (texts, token ids, text pairs) ──► pooling_inputs / score_plan ──► PooledInput ×n
        ──► the engine (one pooling request each, batched there) ──► vectors
        ──► embedding_vector (dimensions) / scores (cosine, or a cross-encoder's sigmoid)

What a model serves comes from the engine's handshake (Welcome.pooler, engine/pooling.py):
a request for another task gets an InvalidRequest naming the task the model serves.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from common.errors import InvalidRequest
from common.pooling_params import PoolingParams
from common.v1 import engine_ipc_pb2 as ipc
from common.validation import check_pooling_prompt
from frontend.output_processor import SampleDelta

MAX_INPUTS = 2048  # inputs per request (OpenAI's limit for /v1/embeddings)
MAX_INPUT_CHARS = 1_000_000
_ROUTES = {"embed": "/v1/embeddings (gRPC Embedding.Embed)", "score": "/score and /v1/rerank (gRPC Embedding.Score)",
           "generate": "/v1/chat/completions, /v1/completions (gRPC Generation.Generate)"}


@dataclass(frozen=True, slots=True)
class PooledInput:
    token_ids: list[int]
    params: PoolingParams = field(default_factory=PoolingParams)


def as_inputs(value) -> list:
    """An API's `input`: one input (a text, or a list of token ids) or a list of them."""
    one = isinstance(value, str) or (isinstance(value, list) and bool(value)
                                     and all(isinstance(t, int) and not isinstance(t, bool) for t in value))
    return [value] if one else list(value)


def served_task(pooler: ipc.Pooler) -> str:
    return pooler.task or "generate"


def require_task(pooler: ipc.Pooler, *wanted: str) -> None:
    """Refuse a request for a task the model does not serve, naming the one it does."""
    task = served_task(pooler)
    if task not in wanted:
        raise InvalidRequest(f"this model serves the {task} task (--task {task}: {_ROUTES[task]}), "
                             f"not {' or '.join(wanted)}")


def pooling_model(llm, *tasks: str) -> tuple:
    """(input processor, the engine's pooler) for a pooling request to `llm` (an AsyncLLM): a
    ready engine whose model serves one of `tasks` (InvalidRequest naming the task it serves)."""
    processor = llm.require_ready(generates=False)
    require_task(llm.welcome.pooler, *tasks)
    return processor, llm.welcome.pooler


def check_truncate(truncate_prompt_tokens: int | None, max_tokens: int) -> int | None:
    """vLLM's truncate_prompt_tokens: k keeps each input's first k tokens, -1 the model's
    limit; None keeps all (a longer input is refused)."""
    if truncate_prompt_tokens is None:
        return None
    if isinstance(truncate_prompt_tokens, bool) or not isinstance(truncate_prompt_tokens, int) or not (
            truncate_prompt_tokens == -1 or 1 <= truncate_prompt_tokens <= max_tokens):
        raise InvalidRequest(f"truncate_prompt_tokens: must be -1 or in [1, {max_tokens}] (this model's "
                             f"longest input), got {truncate_prompt_tokens!r}")
    return max_tokens if truncate_prompt_tokens == -1 else truncate_prompt_tokens


def pooling_inputs(tokenizer, inputs: Sequence[str | Sequence[int]], pooler: ipc.Pooler, vocab_size: int,
                   truncate_prompt_tokens: int | None = None, field_name: str = "input") -> list[PooledInput]:
    """Texts and token-id lists -> the engine's inputs, checked: a text is tokenized with its
    special tokens ([CLS] ... [SEP]) and cut as sentence-transformers cuts it; a token list is
    taken as it is (its first tokens kept when truncated)."""
    if not inputs:
        raise InvalidRequest(f"{field_name}: must not be empty")
    if len(inputs) > MAX_INPUTS:
        raise InvalidRequest(f"{field_name}: at most {MAX_INPUTS} inputs per request, got {len(inputs)}")
    limit = check_truncate(truncate_prompt_tokens, pooler.max_tokens)
    out = []
    for i, item in enumerate(inputs):
        name = f"{field_name}[{i}]" if len(inputs) > 1 else field_name
        if isinstance(item, str):
            _check_text(item, name)
            ids, _ = tokenizer.encode_truncated(item, limit)
        elif isinstance(item, (list, tuple)):
            ids = list(item)[:limit] if limit is not None else list(item)
        else:
            raise InvalidRequest(f"{name}: must be a string or a list of token ids, got {type(item).__name__}")
        check_pooled_ids(ids, pooler, vocab_size, name)
        out.append(PooledInput(ids))
    return out


@dataclass
class ScorePlan:
    """The pooling requests that score text pairs, and how their vectors become scores: a
    cross-encoder runs each pair as one input; an embedding model embeds each distinct text
    once and scores a pair by the cosine of its two vectors."""

    pooler: ipc.Pooler
    inputs: list[PooledInput]
    pairs: list[tuple[int, int]] | None = None  # embed: each pair's two inputs

    def scores(self, vectors: list[list[float]]) -> list[float]:
        if self.pairs is None:
            return scores(self.pooler, None, vectors)
        unit = [_normalized(v) for v in vectors]  # each once, however many pairs it is in
        return [_dot(unit[a], unit[b]) for a, b in self.pairs]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(i.token_ids) for i in self.inputs)


def score_plan(tokenizer, pooler: ipc.Pooler, vocab_size: int, text_1: str | Sequence[str],
               text_2: str | Sequence[str], truncate_prompt_tokens: int | None = None,
               names: tuple[str, str] = ("text_1", "text_2")) -> ScorePlan:
    """vLLM's /score pairing: one text_1 against each text_2, or text_1[i] against text_2[i]."""
    left = [text_1] if isinstance(text_1, str) else list(text_1)
    right = [text_2] if isinstance(text_2, str) else list(text_2)
    if not left or not right:
        raise InvalidRequest(f"{names[0] if not left else names[1]}: must not be empty")
    if len(left) != 1 and len(left) != len(right):
        raise InvalidRequest(f"{names[0]}: give one text, or as many as {names[1]} ({len(right)}), got {len(left)}")
    left = left * len(right) if len(left) == 1 else left
    if len(right) > MAX_INPUTS:
        raise InvalidRequest(f"{names[1]}: at most {MAX_INPUTS} per request, got {len(right)}")
    for i, (a, b) in enumerate(zip(left, right)):
        _check_text(a, names[0] if isinstance(text_1, str) else f"{names[0]}[{i}]")
        _check_text(b, names[1] if isinstance(text_2, str) else f"{names[1]}[{i}]")
    if served_task(pooler) == "score":
        limit = check_truncate(truncate_prompt_tokens, pooler.max_tokens)
        inputs = []
        for i, (a, b) in enumerate(zip(left, right)):
            ids, start = tokenizer.encode_truncated(a, limit, b)
            check_pooled_ids(ids, pooler, vocab_size, f"{names[1]}[{i}]")
            inputs.append(PooledInput(ids, PoolingParams(start)))
        return ScorePlan(pooler, inputs)
    texts = list(dict.fromkeys(left + right))  # each distinct text embedded once
    where = {t: i for i, t in enumerate(texts)}
    inputs = pooling_inputs(tokenizer, texts, pooler, vocab_size, truncate_prompt_tokens, names[1])
    return ScorePlan(pooler, inputs, [(where[a], where[b]) for a, b in zip(left, right)])


def check_pooled_ids(ids: list[int], pooler: ipc.Pooler, vocab_size: int, name: str) -> None:
    """The engine's own check of a pooling prompt (common.validation), made before any is sent."""
    check_pooling_prompt(ids, vocab_size, pooler.max_tokens, name)


def check_dimensions(dimensions: int | None, pooler: ipc.Pooler) -> int | None:
    """OpenAI's `dimensions`: a Matryoshka model's vectors cut to their first n values."""
    if dimensions is None:
        return None
    if isinstance(dimensions, bool) or not isinstance(dimensions, int) or not 1 <= dimensions <= pooler.dimensions:
        raise InvalidRequest(f"dimensions: must be in [1, {pooler.dimensions}], got {dimensions!r}")
    if not pooler.matryoshka and dimensions != pooler.dimensions:
        raise InvalidRequest(f"dimensions: this model's embeddings cannot be shortened (it is not a "
                             f"Matryoshka model); leave it unset or give {pooler.dimensions}")
    return dimensions


def embedding_vector(vector: list[float], dimensions: int | None, pooler: ipc.Pooler) -> list[float]:
    """The vector a client gets: cut to `dimensions` (and normalized again where the model
    normalizes), as sentence-transformers' truncate_dim does."""
    if dimensions is None or dimensions >= len(vector):
        return vector
    vector = vector[:dimensions]
    return _normalized(vector) if pooler.normalize else vector


def scores(pooler: ipc.Pooler, query: list[float] | None, outputs: list[list[float]]) -> list[float]:
    """Relevance per document: a cross-encoder's logit, through a sigmoid where the model says
    so (CrossEncoder.predict's activation: the default for one label); for an embedding model,
    the cosine of the query's and the document's embeddings (`query` is the query's vector then)."""
    if served_task(pooler) == "score":
        return [1.0 / (1.0 + math.exp(-v[0])) if pooler.sigmoid else v[0] for v in outputs]
    q = _normalized(query)
    return [_dot(q, _normalized(v)) for v in outputs]


def _dot(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b))


def _normalized(vector: list[float]) -> list[float]:
    norm = math.sqrt(sum(v * v for v in vector)) or 1.0
    return [v / norm for v in vector]


def _check_text(text: object, name: str) -> None:
    if not isinstance(text, str) or not text:
        raise InvalidRequest(f"{name}: must be a non-empty string")
    if len(text) > MAX_INPUT_CHARS:
        raise InvalidRequest(f"{name}: {len(text)} characters is more than the {MAX_INPUT_CHARS} allowed")


class PoolingState:
    """One pooling request's outcome, fed with its engine outputs like a RequestState (the
    AsyncLLM runs both alike): the vector, with its one finish."""

    def __init__(self, engine_id: str, pooled: PooledInput) -> None:
        self.engine_id = engine_id
        self.prompt = pooled.token_ids
        self.pooling = pooled.params
        self.vector: list[float] | None = None
        self.finish_reason: str | None = None
        self.num_cached_tokens = 0
        self.num_completion_tokens = 0

    @property
    def samples(self) -> list[PoolingState]:  # (for the request log's summary)
        return [self]

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def add_request(self) -> ipc.AddRequest:
        return ipc.AddRequest(request_id=self.engine_id, prompt_token_ids=self.prompt,
                              pooling=ipc.Pooling(token_type_start=self.pooling.token_type_start))

    def process(self, outputs: list) -> tuple[list[SampleDelta], list[str]]:
        for out in outputs:
            if out.finish_reason in ("invalid", "error"):
                raise InvalidRequest(out.error or "the engine refused the request")
            self.num_cached_tokens = out.num_cached_tokens
            if out.finish_reason is not None:
                self.vector, self.finish_reason = out.pooled, out.finish_reason
        return ([SampleDelta(0, finish_reason=self.finish_reason)] if self.done else []), []

    def finish_all(self, reason: str) -> list[SampleDelta]:
        if self.done:
            return []
        self.finish_reason = reason
        return [SampleDelta(0, finish_reason=reason)]
