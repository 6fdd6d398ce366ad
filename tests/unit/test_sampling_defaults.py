"""--generation-config: the engine's reading of a model's sampling defaults (HF folder, GGUF,
a given folder, vllm), their trip in the Welcome, and how every API applies them to the
fields a request leaves unset."""

from __future__ import annotations

import json
import logging

import pytest

from common.ipc import sampling_defaults_from_proto, sampling_defaults_to_proto, sampling_params_from_proto
from common.sampling_defaults import describe, sampling_params
from common.v1 import generation_pb2 as gen
from common.validation import PromptLimits
from engine.models.generation_config import load_sampling_defaults
from frontend.http.params import chat_params, completion_params, messages_params
from frontend.http.protocol import ChatCompletionRequest, CompletionRequest, MessagesRequest
from frontend.input_processor import InputProcessor

MODEL = dict(temperature=0.6, top_p=0.9, top_k=20, min_p=0.05, repetition_penalty=1.1, max_tokens=7)


def fields(p) -> dict:
    return {name: getattr(p, name) for name in MODEL}


def model_folder(tmp_path, config: dict):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    return tmp_path


# -- the engine reads them -----------------------------------------------------------------------

def test_auto_reads_an_hf_folders_sampling_fields(tmp_path, caplog):
    folder = model_folder(tmp_path, {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
                                     "repetition_penalty": 1.1, "max_new_tokens": 7, "do_sample": True,
                                     "bos_token_id": 1, "eos_token_id": [2, 3]})
    with caplog.at_level(logging.WARNING, "pagedserve.engine"):
        assert load_sampling_defaults("auto", folder) == MODEL
    assert "using the model's generation config defaults: temperature=0.6, top_p=0.9, top_k=20" in caplog.text


def test_auto_without_a_file_or_fields_gives_none(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert load_sampling_defaults("auto", tmp_path) == {}
    assert load_sampling_defaults("auto", model_folder(tmp_path, {"bos_token_id": 1})) == {}


def test_vllm_ignores_them(tmp_path):
    assert load_sampling_defaults("vllm", model_folder(tmp_path, {"temperature": 0.2})) == {}


def test_a_path_is_a_folder_holding_the_file(tmp_path):
    model, other = tmp_path / "model", tmp_path / "other"
    model.mkdir()
    other.mkdir()
    model_folder(model, {"temperature": 0.2})
    (other / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "max_new_tokens": 3}))
    assert load_sampling_defaults(str(other), model) == {"temperature": 0.0, "max_tokens": 3}
    with pytest.raises(ValueError, match="generation_config: .*nowhere/generation_config.json does not exist"):
        load_sampling_defaults(str(tmp_path / "nowhere"), model)


def test_a_value_sampling_params_refuses_is_left_out(tmp_path, caplog):
    folder = model_folder(tmp_path, {"temperature": 0.7, "repetition_penalty": 5.0, "top_p": None})
    with caplog.at_level(logging.WARNING, "pagedserve.engine"):
        assert load_sampling_defaults("auto", folder) == {"temperature": 0.7}
    assert "ignoring repetition_penalty=5.0" in caplog.text


def test_auto_reads_a_ggufs_sampling_keys(tmp_path):
    import gguf
    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_sampling_temp(0.6)
    writer.add_sampling_top_k(40)
    writer.add_sampling_top_p(0.95)
    writer.add_sampling_min_p(0.05)
    writer.add_sampling_penalty_repeat(1.1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert load_sampling_defaults("auto", path) == dict(temperature=0.6, top_k=40, top_p=0.95, min_p=0.05,
                                                        repetition_penalty=1.1)


def test_the_bundled_gguf_carries_none(bundled_path):
    assert load_sampling_defaults("auto", bundled_path) == {}


def test_they_cross_the_welcome_unchanged():
    msg = gen.SamplingParams.FromString(sampling_defaults_to_proto(MODEL).SerializeToString())
    assert sampling_defaults_from_proto(msg) == MODEL  # float32 on the wire, 0.6 again after
    assert sampling_defaults_from_proto(sampling_defaults_to_proto({})) == {}
    assert describe(MODEL) == "temperature=0.6, top_p=0.9, top_k=20, min_p=0.05, repetition_penalty=1.1, max_tokens=7"


# -- every API applies them to what a request leaves unset --------------------------------------

def test_unset_fields_take_the_models_default_then_ours():
    p = sampling_params(MODEL)
    assert fields(p) == MODEL
    p = sampling_params(MODEL, temperature=0.0, top_k=0, min_p=0.0, max_tokens=100)
    assert (p.temperature, p.top_k, p.min_p, p.max_tokens, p.top_p) == (0.0, 0, 0.0, 100, 0.9)
    p = sampling_params({"temperature": 0.5}, temperature=None, top_p=None, max_tokens=None)
    assert (p.temperature, p.top_p, p.max_tokens) == (0.5, 1.0, None)  # None max_tokens: the model's length
    assert sampling_params({}).max_tokens == 16  # absent: SamplingParams' own


def test_grpc_unset_fields_take_them_and_set_ones_win():
    p = sampling_params_from_proto(gen.SamplingParams(), defaults=MODEL)
    assert (p.temperature, p.top_k, p.min_p, p.max_tokens) == (0.6, 20, 0.05, 7)
    p = sampling_params_from_proto(gen.SamplingParams(temperature=0, top_k=0, min_p=0), defaults=MODEL)
    assert (p.temperature, p.top_k, p.min_p) == (0.0, 0, 0.0)
    assert sampling_params_from_proto(gen.SamplingParams()).max_tokens is None  # no defaults: to the length


@pytest.fixture
def processor():
    return InputProcessor(None, PromptLimits(100, 1024, 64, 4), sampling_defaults=MODEL)


def test_http_unset_fields_take_them_and_set_ones_win(processor):
    p = completion_params(CompletionRequest(prompt="x"), processor)
    assert fields(p) == MODEL
    p = completion_params(CompletionRequest(prompt="x", temperature=0, top_k=-1, max_tokens=50), processor)
    assert (p.temperature, p.top_k, p.max_tokens, p.top_p) == (0.0, 0, 50, 0.9)
    p = chat_params(ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], top_p=0.5), None, processor)
    assert (p.temperature, p.top_p, p.max_tokens) == (0.6, 0.5, 7)
    p = messages_params(MessagesRequest(model="m", max_tokens=30, messages=[{"role": "user", "content": "x"}]),
                        None, processor)
    assert (p.temperature, p.top_k, p.min_p, p.repetition_penalty, p.max_tokens) == (0.6, 20, 0.05, 1.1, 30)


def test_without_model_defaults_the_apis_keep_theirs():
    processor = InputProcessor(None, PromptLimits(100, 1024, 64, 4))
    assert completion_params(CompletionRequest(prompt="x"), processor).max_tokens == 16  # OpenAI's
    chat = chat_params(ChatCompletionRequest(messages=[{"role": "user", "content": "x"}]), None, processor)
    assert (chat.temperature, chat.top_k, chat.max_tokens) == (1.0, 0, None)  # chat: the context left
