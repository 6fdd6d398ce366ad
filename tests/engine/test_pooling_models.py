"""Pooling models through the offline API (`LLM.embed`, `LLM.score`) equal their references:
the bundled all-MiniLM-L6-v2 equals sentence-transformers' encode, a tiny random Qwen3 run
with --task embed equals HF's last hidden state (normalized), a tiny random BERT cross-encoder
equals sentence-transformers' CrossEncoder.predict; and bad requests are refused by name."""

from __future__ import annotations

import contextlib
import io
import json
import random
import shutil

import numpy as np
import pytest
import torch

from common.errors import InvalidRequest
from pagedserve import LLM
from helpers import assert_no_leak

pytestmark = pytest.mark.heavy(45)  # seconds on the 2-core CI machine: scheduled first

WORDS = ("the quick brown fox jumps over lazy dog while rain falls on green hills and people walk to market "
         "with bread cheese wine apples music plays in old town square children laugh at people near river "
         "boats drift slowly under bridge stone tower clock strikes noon birds sing loudly summer winter "
         "spring autumn light dark water fire earth wind mountain valley forest desert ocean city village").split()


def cosines(ours, ref) -> np.ndarray:
    ours, ref = np.asarray(ours, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    return (ours * ref).sum(-1) / np.linalg.norm(ours, axis=-1) / np.linalg.norm(ref, axis=-1)


def bf16_cpu() -> bool:
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


# -- all-MiniLM-L6-v2 (BERT, mean pooling, normalized) vs sentence-transformers ---------------


@pytest.fixture(scope="module")
def minilm(tmp_path_factory):
    from all_minilm_l6_v2 import extract_model
    with contextlib.redirect_stdout(io.StringIO()):  # the package prints as it unpacks
        return extract_model(str(tmp_path_factory.mktemp("minilm")))


@pytest.fixture(scope="module")
def sentence_transformer(minilm):
    from sentence_transformers import SentenceTransformer
    return SentenceTransformer(str(minilm), device="cpu")


@pytest.fixture(scope="module")
def minilm_llm(minilm):
    return LLM(model=str(minilm), dtype="float32")


@pytest.fixture(scope="module")
def texts() -> list[str]:
    """100 texts of 1 to 250 words (each word one WordPiece token), short ones most often
    (~3,500 tokens in all: a few seconds a pass on two cores)."""
    rng = random.Random(0)
    lengths = [1, 2, 3, 250] + [int(250 ** (rng.random() ** 2)) for _ in range(96)]
    return [" ".join(rng.choice(WORDS) for _ in range(n)) for n in lengths]


@pytest.fixture(scope="module")
def reference(sentence_transformer, texts) -> np.ndarray:
    return sentence_transformer.encode(texts)


@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=pytest.mark.skipif(
    not bf16_cpu(), reason="this CPU has no bfloat16 arithmetic"))])
def test_minilm_matches_sentence_transformers(minilm, texts, reference, dtype):
    """Every vector equals sentence-transformers' (float32), whatever the order and batch
    composition: shuffled with the default step budget (the 100 inputs in a few steps), then
    in reverse through a small budget (a few inputs a step). And a text's vector is the same
    in both: it does not depend on the texts that share its steps (bert.py's _dense; bitwise
    on the Intel AMX VM, 1e-6 allowed for other CPUs' matmul kernels)."""
    order = list(range(len(texts)))
    random.Random(1).shuffle(order)
    vectors = []
    for config, inputs in (({}, order), (dict(max_num_batched_tokens=300, max_num_seqs=5), order[::-1])):
        llm = LLM(model=str(minilm), dtype=dtype, **config)
        outputs = llm.embed([texts[i] for i in inputs])
        assert max(len(o.prompt_token_ids) for o in outputs) == 252  # the longest text: 250 words + CLS, SEP
        got = cosines([o.embedding for o in outputs], reference[inputs])
        assert got.min() >= 0.9999, f"{dtype} {config}: min cosine {got.min():.6f} at input {inputs[got.argmin()]}"
        print(f"{dtype} {config}: min cosine {got.min():.7f}")
        assert all(abs(np.linalg.norm(o.embedding) - 1) < 1e-3 for o in outputs)  # the Normalize module
        assert_no_leak(llm)
        vectors.append({i: np.asarray(o.embedding) for i, o in zip(inputs, outputs)})
    worst = max(np.abs(vectors[0][i] - vectors[1][i]).max() for i in order)
    assert worst <= 1e-6, f"{dtype}: a vector moved by {worst:.2e} with the texts batched beside it"


def test_minilm_truncates_as_sentence_transformers(minilm_llm, sentence_transformer):
    """truncate_prompt_tokens=-1 cuts to the model's 256 tokens (max_seq_length), as encode
    does; k keeps the first k tokens ([CLS] ... then [SEP]) as encode with max_seq_length k."""
    long_text = " ".join(WORDS * 4)  # 266 tokens
    out = minilm_llm.embed([long_text, "short"], truncate_prompt_tokens=-1)
    assert [len(o.prompt_token_ids) for o in out] == [256, 3]
    assert cosines([o.embedding for o in out], sentence_transformer.encode([long_text, "short"])).min() >= 0.9999
    out = minilm_llm.embed(long_text, truncate_prompt_tokens=20)
    assert len(out[0].prompt_token_ids) == 20 and out[0].prompt_token_ids[-1] == 102  # [SEP] kept
    sentence_transformer.max_seq_length = 20
    try:
        assert cosines(out[0].embedding, sentence_transformer.encode(long_text)) >= 0.9999
    finally:
        sentence_transformer.max_seq_length = 256
    assert_no_leak(minilm_llm)


def test_minilm_saved_by_sentence_transformers_6(tmp_path, sentence_transformer, texts):
    """The same model saved by the installed sentence-transformers (`"pooling_mode": "mean"`,
    its max_seq_length as the tokenizer's model_max_length) is served alike."""
    sentence_transformer.save(str(tmp_path))
    assert json.loads((tmp_path / "1_Pooling" / "config.json").read_text()).get("pooling_mode") == "mean"
    llm = LLM(model=str(tmp_path), dtype="float32")
    assert llm.pooling.pooler.max_tokens == 256
    got = cosines([o.embedding for o in llm.embed(texts[:10])], sentence_transformer.encode(texts[:10]))
    assert got.min() >= 0.9999, f"min cosine {got.min():.6f}"
    assert_no_leak(llm)


def test_minilm_token_ids_and_score_by_cosine(minilm_llm, sentence_transformer):
    """Token ids are embedded as given; score on an embedding model is the cosine of the
    query's and each document's embeddings."""
    text = "the quick brown fox"
    ids = minilm_llm.embed(text)[0].prompt_token_ids
    assert minilm_llm.embed([ids])[0].embedding == minilm_llm.embed(ids)[0].embedding
    assert cosines(minilm_llm.embed(ids)[0].embedding, sentence_transformer.encode(text)) >= 0.9999
    query, docs = "a fox in the forest", ["the quick brown fox", "summer rain on the city", "music plays"]
    scores = [s.score for s in minilm_llm.score(query, docs)]
    q, d = sentence_transformer.encode(query), sentence_transformer.encode(docs)
    np.testing.assert_allclose(scores, cosines(d, q[None, :]), atol=1e-5)
    assert max(scores) - min(scores) > 0.05  # documents told apart: the check above says something
    assert_no_leak(minilm_llm)


# -- a tiny random Qwen3 with --task embed: the last token's hidden state, normalized -------------


def build_tiny_qwen3(folder, tokenizer, **extra):
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, intermediate_size=128, max_position_embeddings=512,
                         tie_word_embeddings=False, initializer_range=0.2, bos_token_id=1, eos_token_id=2,
                         pad_token_id=0, **extra)
    model = Qwen3ForCausalLM(config).eval()
    model.save_pretrained(str(folder), safe_serialization=True)
    tokenizer.save_pretrained(str(folder))
    return folder, model.model


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory, bundled_tokenizer):
    return build_tiny_qwen3(tmp_path_factory.mktemp("qwen3"), bundled_tokenizer)


@torch.inference_mode()
def last_token_embeddings(hf_model, prompts: list[list[int]]) -> np.ndarray:
    """HF's last hidden state (after the final norm) at each prompt's last token, normalized."""
    rows = [hf_model(torch.tensor([p])).last_hidden_state[0, -1] for p in prompts]
    return torch.nn.functional.normalize(torch.stack(rows), dim=-1).numpy()


def qwen3_prompts() -> list[list[int]]:
    rng = random.Random(2)
    prefix = [rng.randrange(3, 512) for _ in range(40)]  # 2.5 blocks shared by the first three
    return ([prefix + [rng.randrange(3, 512) for _ in range(n)] for n in (1, 9, 30)]
            + [[rng.randrange(3, 512) for _ in range(n)] for n in (1, 2, 17, 64, 200)])


@pytest.mark.parametrize("config", [dict(enable_prefix_caching=False),
                                    dict(enable_prefix_caching=True, max_num_batched_tokens=256)])
def test_qwen3_embed_matches_hf_last_token(tiny_qwen3, config):
    folder, hf_model = tiny_qwen3
    prompts = qwen3_prompts()
    reference = last_token_embeddings(hf_model, prompts)
    llm = LLM(model=str(folder), dtype="float32", task="embed", **config)
    # Twice: with prefix caching on, the second round's prompts start in the cache.
    for _ in range(2 if config["enable_prefix_caching"] else 1):
        outputs = llm.embed(prompts)
        ours = np.array([o.embedding for o in outputs])
        got = cosines(ours, reference)
        assert got.min() >= 0.9999, f"min cosine {got.min():.6f} at prompt {got.argmin()}"
        np.testing.assert_allclose(ours, reference, atol=1e-4)
        assert [o.prompt_token_ids for o in outputs] == prompts
    if config["enable_prefix_caching"]:
        assert llm.engine.stats().num_prefix_cache_hits > 0
    assert_no_leak(llm)


def test_qwen3_matryoshka_dimensions(tmp_path, bundled_tokenizer):
    """`is_matryoshka` in config.json: dimensions=16 gives the first 16 values, renormalized."""
    folder, hf_model = build_tiny_qwen3(tmp_path, bundled_tokenizer, is_matryoshka=True)
    assert json.loads((folder / "config.json").read_text())["is_matryoshka"] is True
    llm = LLM(model=str(folder), dtype="float32", task="embed")
    prompts = [[5, 6, 7, 8], [100, 200, 300]]
    full = [o.embedding for o in llm.embed(prompts)]
    short = [o.embedding for o in llm.embed(prompts, dimensions=16)]
    assert [len(v) for v in full] == [64, 64] and [len(v) for v in short] == [16, 16]
    expected = [np.asarray(v[:16]) / np.linalg.norm(v[:16]) for v in full]
    np.testing.assert_allclose(short, expected, atol=1e-6)
    np.testing.assert_allclose(np.linalg.norm(short, axis=1), 1, atol=1e-6)
    reference = last_token_embeddings(hf_model, prompts)[:, :16]
    np.testing.assert_allclose(short, reference / np.linalg.norm(reference, axis=1, keepdims=True), atol=1e-4)
    assert len(llm.embed(prompts[0], dimensions=64)[0].embedding) == 64
    with pytest.raises(InvalidRequest, match="dimensions"):
        llm.embed(prompts, dimensions=65)
    assert_no_leak(llm)


# -- a tiny random BERT cross-encoder vs sentence-transformers' CrossEncoder ------------------------


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory, minilm):
    """BertForSequenceClassification (one label) with MiniLM's real WordPiece tokenizer."""
    from transformers import BertConfig, BertForSequenceClassification
    folder = tmp_path_factory.mktemp("cross-encoder")
    torch.manual_seed(0)
    config = BertConfig(vocab_size=30522, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=128, num_labels=1, initializer_range=0.2)
    BertForSequenceClassification(config).save_pretrained(str(folder), safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(minilm / name, folder / name)
    return folder


QUERY = "where do the boats drift"
DOCS = ["boats drift slowly under the old stone bridge", "the clock strikes noon", "fire",
        "children laugh near the river while people walk to market with bread and cheese"]


def test_cross_encoder_matches_sentence_transformers(cross_encoder):
    from sentence_transformers import CrossEncoder
    llm = LLM(model=str(cross_encoder), dtype="float32")
    assert llm.pooling.pooler.task == "score"
    long_doc = " ".join(WORDS * 2)  # 132 words: cut below
    docs = DOCS + [long_doc]
    outputs = llm.score(QUERY, docs)
    reference = CrossEncoder(str(cross_encoder), device="cpu").predict([(QUERY, d) for d in docs])
    ours = [o.score for o in outputs]
    np.testing.assert_allclose(ours, reference, atol=1e-5)
    assert max(ours) - min(ours) > 0.05  # random weights still tell the pairs apart
    assert all(o.prompt_token_ids[0] == 101 and o.prompt_token_ids[-1] == 102 for o in outputs)  # [CLS] ... [SEP]
    # Cut longest-first to 32 tokens, as CrossEncoder(max_length=32) cuts.
    outputs = llm.score(QUERY, docs, truncate_prompt_tokens=32)
    assert max(len(o.prompt_token_ids) for o in outputs) == 32
    reference = CrossEncoder(str(cross_encoder), device="cpu", max_length=32).predict([(QUERY, d) for d in docs])
    np.testing.assert_allclose([o.score for o in outputs], reference, atol=1e-5)
    assert [o.score for o in llm.score(QUERY, DOCS[0])] == pytest.approx([ours[0]], abs=1e-6)
    with pytest.raises(InvalidRequest, match="serves the score task"):
        llm.embed("a text")
    with pytest.raises(InvalidRequest, match=r"documents\[1\]"):
        llm.score(QUERY, ["fine", " ".join(WORDS * 8)])  # 536 tokens > 512, no truncation asked
    with pytest.raises(InvalidRequest, match="documents"):
        llm.score(QUERY, [])
    assert_no_leak(llm)


def test_cross_encoder_with_identity_activation_gives_logits(cross_encoder, tmp_path):
    """A cross-encoder whose config names Identity as its activation (as some public ones do):
    CrossEncoder.predict gives the raw logits, and so do we."""
    from sentence_transformers import CrossEncoder
    folder = tmp_path / "identity"
    shutil.copytree(cross_encoder, folder)
    config = json.loads((folder / "config.json").read_text())
    config["sentence_transformers"] = {"activation_fn": "torch.nn.modules.linear.Identity"}
    (folder / "config.json").write_text(json.dumps(config))
    ours = [o.score for o in LLM(model=str(folder), dtype="float32").score(QUERY, DOCS)]
    reference = CrossEncoder(str(folder), device="cpu").predict([(QUERY, d) for d in DOCS])
    np.testing.assert_allclose(ours, reference, atol=1e-5)
    assert not all(0 < v < 1 for v in ours)  # logits, not probabilities


# -- bad requests -------------------------------------------------------------------------------


def test_task_mismatch_is_refused(minilm_llm, tiny_qwen3):
    from common.sampling_params import SamplingParams
    with pytest.raises(InvalidRequest, match="serves the embed task"):
        minilm_llm.generate("hello", SamplingParams(max_tokens=2))
    assert_no_leak(minilm_llm)
    folder, _ = tiny_qwen3
    llm = LLM(model=str(folder), dtype="float32", task="generate")
    with pytest.raises(InvalidRequest, match="serves the generate task"):
        llm.embed([[5, 6, 7]])
    with pytest.raises(InvalidRequest, match="serves the generate task"):
        llm.score("a", ["b"])
    assert len(llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2))[0].outputs[0].token_ids) == 2
    assert_no_leak(llm)


@pytest.mark.parametrize("inputs,kwargs,match", [
    ([], {}, "inputs: must not be empty"),
    ("", {}, "inputs: must be a non-empty string"),
    (["fine", ""], {}, r"inputs\[1\]: must be a non-empty string"),
    (" ".join(WORDS * 4), {}, "inputs: 266 tokens is more than the 256 this model takes.*truncate_prompt_tokens"),
    ([[101, 30522, 102]], {}, "inputs: token id 30522 is outside the vocabulary"),
    ("fine", dict(truncate_prompt_tokens=0), "truncate_prompt_tokens"),
    ("fine", dict(truncate_prompt_tokens=257), "truncate_prompt_tokens"),
    ("fine", dict(dimensions=16), "dimensions"),
])
def test_bad_embed_requests_name_the_field(minilm_llm, inputs, kwargs, match):
    with pytest.raises(InvalidRequest, match=match):
        minilm_llm.embed(inputs, **kwargs)
    assert_no_leak(minilm_llm)


def test_refused_midway_leaves_nothing_behind(minilm):
    """The engine refuses the third input (its waiting queue is full): the call raises, and the
    two already queued are aborted, their blocks freed."""
    from common.errors import EngineOverloaded
    llm = LLM(model=str(minilm), dtype="float32", max_waiting_requests=2)
    with pytest.raises(EngineOverloaded, match="max-waiting-requests 2"):
        llm.embed(["one", "two", "three"])
    assert_no_leak(llm)
    assert len(llm.embed(["one", "two"])) == 2
