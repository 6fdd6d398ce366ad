"""Pooling without a model: the task and pooler a model folder resolves to (engine/pooling.py),
and the frontend's input checks and output math (frontend/pooling.py)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from common.errors import InvalidRequest
from common.v1 import engine_ipc_pb2 as ipc
from engine.pooling import Pooler, pool, resolve_pooler, sentence_transformers_max_len
from frontend.pooling import (as_inputs, check_dimensions, check_truncate, embedding_vector, pooling_inputs, require_task,
                              score_plan, scores)

LEGACY_MEAN = {"word_embedding_dimension": 8, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True,
               "pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False}


def st_folder(path, pooling: dict, normalize: bool = True, extra_modules: tuple[str, ...] = ()):
    """A sentence-transformers folder's module files (nothing else is read here)."""
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    modules += [{"idx": 3 + i, "name": kind, "path": kind, "type": f"sentence_transformers.models.{kind}"}
                for i, kind in enumerate(extra_modules)]
    path.mkdir(exist_ok=True)
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    return path


# -- resolve_pooler ----------------------------------------------------------------------------


def test_auto_task_from_the_model(tmp_path):
    plain = tmp_path / "plain"
    plain.mkdir()
    assert resolve_pooler(plain, encoder=False, classifier_labels=0, hidden_size=64) == Pooler("generate")
    # An encoder without sentence-transformers files: its CLS token, normalized (as vLLM).
    assert resolve_pooler(plain, True, 0, 64) == Pooler("embed", "cls", True, 64)
    assert resolve_pooler(plain, True, 1, 64) == Pooler("score", "cls", False, 1, sigmoid=True)
    # A decoder with sentence-transformers files embeds (Qwen3-Embedding: last token).
    st = st_folder(tmp_path / "st", {"pooling_mode": "lasttoken"})
    assert resolve_pooler(st, False, 0, 64) == Pooler("embed", "last", True, 64)


@pytest.mark.parametrize("pooling,normalize,expected", [
    (LEGACY_MEAN, True, ("mean", True)),
    ({"pooling_mode_cls_token": True}, False, ("cls", False)),
    ({"pooling_mode_mean_tokens": False}, True, ("mean", True)),  # no flag set: sentence-transformers' mean
    ({"embedding_dimension": 8, "pooling_mode": "mean", "include_prompt": True}, True, ("mean", True)),  # 6.x
    ({"pooling_mode": "cls"}, False, ("cls", False)),
])
def test_sentence_transformers_pooling(tmp_path, pooling, normalize, expected):
    folder = st_folder(tmp_path, pooling, normalize)
    pooler = resolve_pooler(folder, True, 0, 8)
    assert (pooler.task, pooler.mode, pooler.normalize, pooler.dimensions) == ("embed", *expected, 8)


@pytest.mark.parametrize("pooling,extra,match", [
    ({"pooling_mode": "max"}, (), "pooling 'max' is not supported"),
    ({"pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": True}, (), r"\['max', 'mean'\]"),  # concatenated
    ({"pooling_mode": ["cls", "mean"]}, (), "not supported"),
    (LEGACY_MEAN, ("Dense",), "module 'sentence_transformers.models.Dense' is not supported"),
])
def test_sentence_transformers_pooling_we_cannot_run(tmp_path, pooling, extra, match):
    with pytest.raises(ValueError, match=match):
        resolve_pooler(st_folder(tmp_path, pooling, extra_modules=extra), True, 0, 8)


def test_pooling_flag_overrides_and_task_errors(tmp_path):
    folder = st_folder(tmp_path, LEGACY_MEAN)
    assert resolve_pooler(folder, True, 0, 8, pooling="cls") == Pooler("embed", "cls", True, 8)
    assert resolve_pooler(tmp_path / "1_Pooling", False, 0, 8, task="embed") == Pooler("embed", "last", True, 8)
    with pytest.raises(ValueError, match="pooling: a decoder embeds with its last token only"):
        resolve_pooler(tmp_path / "1_Pooling", False, 0, 8, task="embed", pooling="mean")
    with pytest.raises(ValueError, match="pooling: only for --task embed"):
        resolve_pooler(tmp_path / "1_Pooling", False, 0, 8, task="generate", pooling="last")
    with pytest.raises(ValueError, match="it serves embed, not generate"):
        resolve_pooler(folder, True, 0, 8, task="generate")
    with pytest.raises(ValueError, match="it serves score, not generate"):
        resolve_pooler(folder, True, 1, 8, task="generate")
    with pytest.raises(ValueError, match="it serves score, not embed"):
        resolve_pooler(folder, True, 1, 8, task="embed")
    with pytest.raises(ValueError, match="score needs a cross-encoder with one label"):
        resolve_pooler(folder, True, 2, 8, task="score")
    with pytest.raises(ValueError, match="score needs"):
        resolve_pooler(folder, True, 0, 8, task="score")
    with pytest.raises(ValueError, match="task: must be one of"):
        resolve_pooler(folder, True, 0, 8, task="classify")
    with pytest.raises(ValueError, match="pooling: must be one of"):
        resolve_pooler(folder, True, 0, 8, pooling="max")


def test_matryoshka_and_max_len(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"matryoshka_dimensions": [8, 4], "max_position_embeddings": 512}))
    assert resolve_pooler(tmp_path, True, 0, 8).matryoshka
    assert sentence_transformers_max_len(tmp_path) is None  # not a sentence-transformers folder
    (tmp_path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 256}))
    assert sentence_transformers_max_len(tmp_path) == 256
    # sentence-transformers 6 saves it as the tokenizer's model_max_length, capped by the positions.
    (tmp_path / "sentence_bert_config.json").write_text(json.dumps({"transformer_task": "feature-extraction"}))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 128}))
    assert sentence_transformers_max_len(tmp_path) == 128
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"model_max_length": int(1e30)}))
    assert sentence_transformers_max_len(tmp_path) == 512


def test_pool():
    hidden = torch.tensor([[3.0, 0.0], [1.0, 2.0], [2.0, 4.0]])
    assert pool(hidden, "mean", False).tolist() == [2.0, 2.0]
    assert pool(hidden, "cls", False).tolist() == [3.0, 0.0]
    assert pool(hidden, "last", False).tolist() == [2.0, 4.0]
    assert pool(hidden, "cls", True).tolist() == [1.0, 0.0]
    assert pool(hidden.bfloat16(), "mean", True).dtype == torch.float32


# -- frontend/pooling.py -------------------------------------------------------------------------


def proto(task="embed", normalize=True, dimensions=4, matryoshka=False, max_tokens=8, sigmoid=False) -> ipc.Pooler:
    return ipc.Pooler(task=task, mode="mean", normalize=normalize, dimensions=dimensions, matryoshka=matryoshka,
                      max_tokens=max_tokens, sigmoid=sigmoid)


def test_require_task():
    require_task(proto("embed"), "score", "embed")
    with pytest.raises(InvalidRequest, match="serves the embed task.*not generate"):
        require_task(proto("embed"), "generate")
    with pytest.raises(InvalidRequest, match="serves the generate task.*not embed"):
        require_task(ipc.Pooler(), "embed")  # a generating engine's Welcome leaves it unset


def test_check_truncate():
    assert check_truncate(None, 8) is None
    assert check_truncate(-1, 8) == 8
    assert check_truncate(3, 8) == 3 and check_truncate(8, 8) == 8
    for bad in (0, -2, 9, True, 2.0, "3"):
        with pytest.raises(InvalidRequest, match=r"truncate_prompt_tokens: must be -1 or in \[1, 8\]"):
            check_truncate(bad, 8)


def test_check_dimensions():
    assert check_dimensions(None, proto()) is None
    assert check_dimensions(4, proto()) == 4  # the full size is always fine
    assert check_dimensions(2, proto(matryoshka=True)) == 2
    with pytest.raises(InvalidRequest, match="dimensions: this model's embeddings cannot be shortened"):
        check_dimensions(2, proto())
    for bad in (0, 5, True, 2.5):
        with pytest.raises(InvalidRequest, match=r"dimensions: must be in \[1, 4\]"):
            check_dimensions(bad, proto(matryoshka=True))


def test_embedding_vector():
    vector = [0.5, 0.5, 0.5, 0.5]
    assert embedding_vector(vector, None, proto()) == vector
    assert embedding_vector(vector, 4, proto()) == vector
    assert embedding_vector(vector, 2, proto()) == pytest.approx([math.sqrt(0.5)] * 2)  # renormalized
    assert embedding_vector([3.0, 4.0, 1.0], 2, proto(normalize=False)) == [3.0, 4.0]  # cut only


def test_scores():
    cross = proto("score", normalize=False, dimensions=1, sigmoid=True)
    assert scores(cross, None, [[0.0], [2.0], [-1.0]]) == pytest.approx([0.5, 1 / (1 + math.exp(-2)),
                                                                         1 / (1 + math.exp(1))])
    # A cross-encoder whose activation is Identity (its config's sentence_transformers.activation_fn): the logit.
    assert scores(proto("score", normalize=False, dimensions=1), None, [[2.0], [-1.0]]) == [2.0, -1.0]
    # An embedding model: cosines, whatever the vectors' lengths.
    assert scores(proto(), [2.0, 0.0], [[3.0, 0.0], [0.0, 5.0], [1.0, 1.0], [-1.0, 0.0]]) == pytest.approx(
        [1.0, 0.0, math.sqrt(0.5), -1.0])


class CharTokenizer:
    """One token per character (its code point), no special tokens; a pair: the second text's
    tokens start after the first's, cut longest-first."""

    def encode_truncated(self, text, max_tokens, pair=None):
        first, second = [ord(c) for c in text], [ord(c) for c in pair or ""]
        while max_tokens is not None and len(first) + len(second) > max_tokens:
            (first if len(first) >= len(second) else second).pop()
        return first + second, len(first) if pair is not None else 0


def test_pooling_inputs():
    tok = CharTokenizer()
    inputs = pooling_inputs(tok, ["ab", [1, 2, 3]], proto(), 200)
    assert [i.token_ids for i in inputs] == [[97, 98], [1, 2, 3]]
    assert [i.token_ids for i in pooling_inputs(tok, ["abcd", [1, 2, 3]], proto(), 200, 2)] == [[97, 98], [1, 2]]
    with pytest.raises(InvalidRequest, match=r"input\[1\]: 9 tokens is more than the 8"):
        pooling_inputs(tok, ["a", "abcdefghi"], proto(), 200)
    with pytest.raises(InvalidRequest, match="input: token id 300 is outside the vocabulary"):
        pooling_inputs(tok, [[300]], proto(), 200)
    with pytest.raises(InvalidRequest, match="input: must contain at least one token"):
        pooling_inputs(tok, [[]], proto(), 200)
    with pytest.raises(InvalidRequest, match=r"input\[0\]: must be a string or a list of token ids, got int"):
        pooling_inputs(tok, [1, "a"], proto(), 200)  # a mixed list


def test_score_plan():
    tok = CharTokenizer()
    cross = score_plan(tok, proto("score", dimensions=1, sigmoid=True), 200, "ab", ["cde", "f"],
                       truncate_prompt_tokens=4)
    assert [(i.token_ids, i.params.token_type_start) for i in cross.inputs] == [([97, 98, 99, 100], 2),
                                                                               ([97, 98, 102], 2)]
    assert cross.scores([[0.0], [0.0]]) == [0.5, 0.5]
    # An embedding model embeds each distinct text once and scores by cosine.
    embed = score_plan(tok, proto(), 200, "a", ["b", "a"])
    assert [i.token_ids for i in embed.inputs] == [[97], [98]] and embed.pairs == [(0, 1), (0, 0)]
    assert embed.scores([[1.0, 0.0], [0.0, 1.0]]) == pytest.approx([0.0, 1.0])
    with pytest.raises(InvalidRequest, match="text_2: must not be empty"):
        score_plan(tok, proto(), 200, "a", [])


def test_as_inputs():
    """An API's input: one text or one token list is one input; a list of them, several."""
    assert as_inputs("a") == ["a"]
    assert as_inputs([1, 2]) == [[1, 2]]
    assert as_inputs(["a", "b"]) == ["a", "b"]
    assert as_inputs([[1], [2, 3]]) == [[1], [2, 3]]
    assert as_inputs([]) == []  # refused by pooling_inputs, naming the field
    assert as_inputs([True, False]) == [True, False]  # not token ids: each refused by name
