"""End to end for a pooling model: a real `pagedserve serve --model all-MiniLM-L6-v2` (engine and
frontend processes, dtype auto), asked through the unmodified `openai` SDK, raw HTTP (/score,
/v1/rerank) and the generated gRPC stubs (Embedding, Generation), each answer checked against
sentence-transformers run in this process. Every test ends with every KV block free (over gRPC)."""

from __future__ import annotations

import asyncio
import base64
import math
import random

import grpc
import numpy as np
import pytest
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from grpc_client import EMBEDDING, SERVING, embed_request, generate_error, request, rpc_error
from http_client import kv_free_after, model  # noqa: F401 - shared fixtures
from http_client import assert_error, async_openai_client, openai_client, post
from common.v1 import embedding_pb2 as emb, info_pb2

pytestmark = pytest.mark.heavy(45)  # seconds on the 2-core CI machine: scheduled first
MAX_TOKENS = 256  # the model's max_seq_length (sentence_bert_config.json)
MIN_COSINE = 0.9999
# Scores against sentence-transformers' float32 ones: 1e-4 when the engine runs float32; dtype
# auto is bfloat16 on CPUs with bf16 instructions, whose vectors (cosine ~0.99997 to the
# float32 ones) move a cosine score by up to ~2e-3.
SCORE_ATOL = {"float32": 1e-4}
BF16_SCORE_ATOL = 5e-3
WORDS = ("the a of and to in is was cat dog river market bank money quantum physics music guitar "
         "running jumped quickly slowly beautiful ancient modern city village mountain ocean "
         "tokenization pagedserve naïve café Zürich 1234 3.14159 hyper-parameter e-mail don't "
         "embeddings retrieval search engine neural network transformer attention kitten stock").split()


def make_texts(count: int, seed: int) -> list[str]:
    """Deterministic varied texts: mostly short, some long (log-uniform in words), with words
    that split into several word pieces and punctuation; cut to <= 250 tokens later."""
    rng = random.Random(seed)
    texts = []
    for i in range(count):
        num_words = 240 if i % 40 == 0 else int(math.exp(rng.uniform(0, math.log(160))))
        words = [rng.choice(WORDS) for _ in range(num_words)]
        texts.append(" ".join(words) + rng.choice(("", ".", "?", "!")))
    return texts


class Reference:
    """sentence-transformers' answers for TEXTS, computed once (float32, on CPU)."""

    def __init__(self) -> None:
        from sentence_transformers import SentenceTransformer

        from engine.models.source import minilm_model_path
        self.st = SentenceTransformer(str(minilm_model_path()), device="cpu")
        self.texts = [self._fit(t) for t in make_texts(300, seed=0)]
        self.token_ids = [self.count_ids(t) for t in self.texts]
        self.vectors = self.embed(self.texts)

    def count_ids(self, text: str) -> list[int]:
        return self.st.tokenizer(text, verbose=False)["input_ids"]  # (no warning for the ones cut later)

    def _fit(self, text: str) -> str:
        words = text.split(" ")
        while len(self.count_ids(" ".join(words))) > MAX_TOKENS - 6:
            words = words[:-4]
        return " ".join(words)

    def embed(self, texts: list[str]) -> np.ndarray:
        return self.st.encode(texts, batch_size=64, convert_to_numpy=True, normalize_embeddings=True)


@pytest.fixture(scope="module")
def reference() -> Reference:
    return Reference()


@pytest.fixture(scope="module")
def frontend(procs, request):
    fe = procs.start_serve("--model", "all-MiniLM-L6-v2", "--num-kv-blocks", "256", "--num-threads", "1")
    try:
        request.getfixturevalue("reference")  # computed while the engine loads
        fe.wait_serving(timeout_s=120)
        yield fe
    finally:
        fe.close()


@pytest.fixture(scope="module")
def score_atol(frontend) -> float:
    dtype = frontend.info.GetModelInfo(info_pb2.GetModelInfoRequest(), timeout=10).dtype
    return SCORE_ATOL.get(dtype, BF16_SCORE_ATOL)


def cosines(got, want: np.ndarray) -> np.ndarray:
    got = np.asarray(got, dtype=np.float64)
    return (got * want).sum(-1) / np.linalg.norm(got, axis=-1) / np.linalg.norm(want, axis=-1)


def split(items: list, sizes: list[int]) -> list[list]:
    assert sum(sizes) == len(items)
    bounds = np.cumsum([0, *sizes])
    return [items[a:b] for a, b in zip(bounds, bounds[1:])]


# -- /v1/embeddings through the openai SDK ----------------------------------------------------

def test_embeddings_match_sentence_transformers(frontend, model, reference):
    """All 300 texts, twice over: in a shuffled order cut into batches of 1 to 120 (the SDK's
    default base64), and reversed in batches of 75 (floats); every request concurrently."""
    n = len(reference.texts)
    assert max(map(len, reference.token_ids)) > 200 and min(map(len, reference.token_ids)) <= 4
    order = list(range(n))
    random.Random(1).shuffle(order)
    batches = [(b, {}) for b in split(order, [1, 2, 5, 12, 30, 50, 80, 120])]
    batches += [(b, {"encoding_format": "float"}) for b in split(order[::-1], [75] * 4)]

    async def run():
        async with async_openai_client(frontend) as client:
            return await asyncio.gather(*(client.embeddings.create(
                model=model, input=[reference.texts[i] for i in batch], **kwargs) for batch, kwargs in batches))

    for (batch, _), r in zip(batches, asyncio.run(run())):
        assert r.model == model and r.object == "list"
        assert [d.index for d in r.data] == list(range(len(batch)))
        assert all(d.object == "embedding" and len(d.embedding) == 384 for d in r.data)
        cos = cosines([d.embedding for d in r.data], reference.vectors[batch])
        assert cos.min() >= MIN_COSINE, (cos.min(), batch[int(cos.argmin())])
        num_tokens = sum(len(reference.token_ids[i]) for i in batch)
        assert r.usage.prompt_tokens == r.usage.total_tokens == num_tokens


def test_sdk_default_is_base64(frontend, model, reference):
    with openai_client(frontend) as client:
        raw = client.embeddings.with_raw_response.create(model=model, input=reference.texts[3])
    assert b'"encoding_format":"base64"' in raw.http_request.content.replace(b" ", b"")
    encoded = raw.http_response.json()["data"][0]["embedding"]
    assert isinstance(encoded, str)
    vector = np.frombuffer(base64.b64decode(encoded), dtype="<f4")
    assert vector.shape == (384,) and cosines(vector, reference.vectors[3]) >= MIN_COSINE
    assert np.allclose(raw.parse().data[0].embedding, vector)


def test_token_id_inputs(frontend, model, reference):
    """list[int] and list[list[int]] (with the tokenizer's [CLS] ... [SEP]) embed as their texts do."""
    picks = [0, 5, 17, 40, 99, 250]
    ids = [reference.token_ids[i] for i in picks]
    with openai_client(frontend) as client:
        texts = client.embeddings.create(model=model, input=[reference.texts[i] for i in picks],
                                         encoding_format="float")
        as_ids = client.embeddings.create(model=model, input=ids, encoding_format="float")
        one = client.embeddings.create(model=model, input=ids[1])
    assert [d.index for d in as_ids.data] == list(range(len(picks)))
    assert cosines([d.embedding for d in as_ids.data], np.array([d.embedding for d in texts.data])).min() >= 0.99999
    assert cosines([d.embedding for d in as_ids.data], reference.vectors[picks]).min() >= MIN_COSINE
    assert as_ids.usage.prompt_tokens == texts.usage.prompt_tokens == sum(map(len, ids))
    assert len(one.data) == 1 and one.usage.prompt_tokens == len(ids[1])
    assert cosines(one.data[0].embedding, reference.vectors[picks[1]]) >= MIN_COSINE


def test_truncate_prompt_tokens(frontend, model, reference):
    long_text = " ".join(["embeddings"] * 150 + ["retrieval"] * 150)
    r = post(frontend, "/v1/embeddings", {"model": model, "input": long_text, "truncate_prompt_tokens": -1})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == MAX_TOKENS
    # sentence-transformers cuts at its max_seq_length (256) too
    want = reference.embed([long_text])[0]
    assert cosines(r.json()["data"][0]["embedding"], want) >= MIN_COSINE
    r = post(frontend, "/v1/embeddings", {"model": model, "input": [long_text, "a cat"], "truncate_prompt_tokens": 10})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 10 + len(reference.count_ids("a cat"))


# -- /score and /v1/rerank ----------------------------------------------------------------------

def separated(reference: Reference, query: int, count: int, gap: float = 0.02) -> list[int]:
    """`count` texts whose scores against texts[query] lie at least `gap` apart (no near ties,
    so the ranking cannot flip within the tolerance), in a shuffled order."""
    sims = reference.vectors @ reference.vectors[query]
    picked: list[int] = []
    for i in sorted(range(len(sims)), key=lambda i: -sims[i]):
        if i != query and all(abs(sims[i] - sims[j]) >= gap for j in picked):
            picked.append(i)
        if len(picked) == count:
            break
    random.Random(2).shuffle(picked)
    return picked


def test_rerank(frontend, model, reference, score_atol):
    query, docs = 7, separated(reference, 7, 8)
    documents = [reference.texts[i] for i in docs]
    want = reference.vectors[docs] @ reference.vectors[query]
    body = {"model": model, "query": reference.texts[query], "documents": documents}
    full = post(frontend, "/v1/rerank", body)
    assert full.status_code == 200, full.text
    results = full.json()["results"]
    scores = [r["relevance_score"] for r in results]
    assert scores == sorted(scores, reverse=True) and len(results) == len(docs)
    assert [r["index"] for r in results] == list(np.argsort(-want))
    for r in results:
        assert r["relevance_score"] == pytest.approx(want[r["index"]], abs=score_atol)
        assert r["document"] == {"text": documents[r["index"]]}
    assert full.json()["usage"]["total_tokens"] == sum(len(reference.token_ids[i]) for i in [query, *docs])

    top = post(frontend, "/rerank", {**body, "top_n": 3, "return_documents": False}).json()
    assert [r["index"] for r in top["results"]] == [r["index"] for r in results[:3]]
    assert all(set(r) == {"index", "relevance_score"} for r in top["results"])
    assert post(frontend, "/v2/rerank", {**body, "top_n": 100}).json()["results"][-1]["index"] == results[-1]["index"]


def test_score_shapes(frontend, model, reference, score_atol):
    a, b, c, d = (reference.texts[i] for i in (3, 11, 12, 13))
    v = reference.vectors
    one_to_n = post(frontend, "/score", {"model": model, "text_1": a, "text_2": [b, c, d]})
    assert one_to_n.status_code == 200, one_to_n.text
    body = one_to_n.json()
    assert body["id"].startswith("score-") and body["object"] == "list" and body["model"] == model
    assert isinstance(body["created"], int) and set(body["usage"]) == {"prompt_tokens", "total_tokens"}
    assert [(x["index"], x["object"]) for x in body["data"]] == [(0, "score"), (1, "score"), (2, "score")]
    assert [x["score"] for x in body["data"]] == pytest.approx(v[[11, 12, 13]] @ v[3], abs=score_atol)

    n_to_n = post(frontend, "/v1/score", {"model": model, "text_1": [a, b, c], "text_2": [d, d, a]}).json()
    want = [v[3] @ v[13], v[11] @ v[13], v[12] @ v[3]]
    assert [x["score"] for x in n_to_n["data"]] == pytest.approx(want, abs=score_atol)

    one_to_one = post(frontend, "/score", {"model": model, "text_1": a, "text_2": a}).json()
    assert [x["score"] for x in one_to_one["data"]] == pytest.approx([1.0], abs=1e-6)

    mismatch = post(frontend, "/score", {"model": model, "text_1": [a, b], "text_2": [b, c, d]})
    assert assert_error(mismatch, 400, "invalid_request_error")["param"] == "text_1"


# -- errors --------------------------------------------------------------------------------------

BAD_EMBEDDINGS = {
    "empty-list": ({"input": []}, "input"),
    "empty-string": ({"input": ""}, "input"),
    "empty-string-in-list": ({"input": ["a cat", ""]}, "input[1]"),
    "too-long": ({"input": "embeddings " * 300}, "input"),
    "dimensions-not-matryoshka": ({"input": "a cat", "dimensions": 128}, "dimensions"),
    "truncate-zero": ({"input": "a cat", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    "token-outside-vocab": ({"input": [[101, 10**6, 102]]}, "input"),
}


@pytest.mark.parametrize("case", BAD_EMBEDDINGS, ids=list(BAD_EMBEDDINGS))
def test_bad_embedding_requests(frontend, model, case):
    body, param = BAD_EMBEDDINGS[case]
    error = assert_error(post(frontend, "/v1/embeddings", {"model": model, **body}), 400, "invalid_request_error")
    assert error["param"] == param, error
    if case == "too-long":
        assert "256" in error["message"] and "truncate_prompt_tokens" in error["message"]


def test_generation_routes_name_the_embed_task(frontend, model):
    chat = post(frontend, "/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": "hi"}]})
    completion = post(frontend, "/v1/completions", {"model": model, "prompt": "hi", "max_tokens": 4})
    for response in (chat, completion):
        assert "embed" in assert_error(response, 400, "invalid_request_error")["message"]
    unknown = post(frontend, "/v1/embeddings", {"model": "no-such-model", "input": "a cat"})
    assert assert_error(unknown, 404, "not_found_error")["param"] == "model"


# -- gRPC ----------------------------------------------------------------------------------------

def test_grpc_embed_equals_http(frontend, model, reference):
    picks = [2, 9, 40, 41, 120]
    inputs = [reference.texts[i] for i in picks[:3]] + [reference.token_ids[i] for i in picks[3:]]
    r = frontend.embedding.Embed(embed_request(*inputs, request_id="embed-1"), timeout=60)
    assert r.request_id == "embed-1"
    assert [e.index for e in r.embeddings] == list(range(len(picks)))
    assert [e.prompt_tokens for e in r.embeddings] == [len(reference.token_ids[i]) for i in picks]
    assert r.prompt_tokens == sum(e.prompt_tokens for e in r.embeddings)
    with openai_client(frontend) as client:
        http = client.embeddings.create(model=model, input=[reference.texts[i] for i in picks])
    got = np.array([list(e.values) for e in r.embeddings])
    assert cosines(got, np.array([d.embedding for d in http.data])).min() >= 0.99999
    assert cosines(got, reference.vectors[picks]).min() >= MIN_COSINE

    truncated = frontend.embedding.Embed(embed_request("embeddings " * 300, truncate_prompt_tokens=-1), timeout=60)
    assert truncated.embeddings[0].prompt_tokens == MAX_TOKENS and truncated.request_id


def test_grpc_request_id_in_use(frontend, reference):
    """A request id names one running call: a second Embed with it while the first runs (300
    inputs, a second or more) is refused, and the first is unharmed."""
    calls = [frontend.embedding.Embed.future(embed_request(*texts, request_id="same"), timeout=60)
             for texts in (reference.texts, reference.texts[:2])]
    errors = [c.exception() for c in calls]
    assert sum(e is None for e in errors) == 1, errors
    [error] = [e for e in errors if e is not None]
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "already in use" in error.details()
    [ok] = [c.result() for c, e in zip(calls, errors) if e is None]
    assert ok.request_id == "same" and len(ok.embeddings) in (2, len(reference.texts))


def test_grpc_score(frontend, reference, score_atol):
    docs = [5, 6, 70]
    req = emb.ScoreRequest(query=reference.texts[4], documents=[reference.texts[i] for i in docs])
    r = frontend.embedding.Score(req, timeout=60)
    assert [s.index for s in r.scores] == [0, 1, 2] and r.request_id
    want = reference.vectors[docs] @ reference.vectors[4]
    assert [s.score for s in r.scores] == pytest.approx(want, abs=score_atol)
    assert r.prompt_tokens == sum(len(reference.token_ids[i]) for i in [4, *docs])


@pytest.mark.parametrize("call, req, field", [
    ("Embed", emb.EmbedRequest(), "inputs"),
    ("Embed", embed_request("a cat", ""), "inputs[1]"),
    ("Embed", embed_request("a cat", dimensions=64), "dimensions"),
    ("Embed", embed_request("embeddings " * 300), "inputs"),
    ("Score", emb.ScoreRequest(query="a cat"), "documents"),
    ("Score", emb.ScoreRequest(query="", documents=["a"]), "query"),
], ids=["no-inputs", "empty-text", "dimensions", "too-long", "no-documents", "empty-query"])
def test_grpc_invalid_argument(frontend, call, req, field):
    error = rpc_error(getattr(frontend.embedding, call), req, timeout=10)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details().startswith(f"{field}: "), error.details()


def test_grpc_generate_names_the_embed_task(frontend):
    error = generate_error(frontend, request(text="Hello"))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "embed task" in error.details(), error.details()
    info = frontend.info.GetModelInfo(info_pb2.GetModelInfoRequest(), timeout=10)
    assert (info.task, info.embedding_dimensions) == ("embed", 384)  # what a client can ask first


def test_grpc_reflection_and_health(frontend):
    db = ProtoReflectionDescriptorDatabase(frontend.channel)
    assert EMBEDDING in set(db.get_services())
    service = DescriptorPool(db).FindServiceByName(EMBEDDING)
    assert {m.name for m in service.methods} == {"Embed", "Score"}
    assert service.methods_by_name["Embed"].output_type.full_name == "pagedserve.v1.EmbedResponse"
    status = frontend.health.Check(health_pb2.HealthCheckRequest(service=EMBEDDING), timeout=5).status
    assert status == SERVING


# -- a model that generates ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def generator(procs):
    """The bundled SmolLM2 (task generate), small: it only has to refuse pooling requests."""
    with procs.serving("--num-kv-blocks", "16", "--max-model-len", "256", "--num-threads", "1") as fe:
        yield fe


def test_pooling_on_a_generating_model_names_the_generate_task(generator):
    for path, body in (("/v1/embeddings", {"input": "a cat"}), ("/v1/rerank", {"query": "a", "documents": ["b"]}),
                       ("/score", {"text_1": "a", "text_2": "b"})):
        error = assert_error(post(generator, path, body), 400, "invalid_request_error")
        assert "generate task" in error["message"], (path, error)
    for call, req in (("Embed", embed_request("a cat")), ("Score", emb.ScoreRequest(query="a", documents=["b"]))):
        error = rpc_error(getattr(generator.embedding, call), req, timeout=10)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "generate task" in error.details()
    info = generator.info.GetModelInfo(info_pb2.GetModelInfoRequest(), timeout=10)
    assert (info.task, info.embedding_dimensions) == ("generate", 0)
    generator.wait_kv_free()
