"""The grammar library's tokenizer from the tokenizer.json a served engine already wrote for
its frontends (engine/main.py): the same tokenizer as from the tokenizer object, built
without serializing the tokenizer again (that holds the GIL for about a second on gpt-oss's
201,088-token vocabulary, long enough under load to starve the engine's heartbeats: a 503
"no answer from the engine" in a loaded test run)."""

from __future__ import annotations

import json

import llguidance.hf
import pytest

from common.structured_output.llguidance_backend import LLGuidanceBackend
from common.structured_output.params import StructuredOutputsParams
from engine.models.loader import load_tokenizer, tokenizer_files
from engine.models.source import bundled_model_path

TEXTS = ["Hello, world!", '{"name": "Ada", "age": 36}', " leading space and ünïcödé, 12345"]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(bundled_model_path())


def test_the_written_json_gives_the_same_grammar_tokenizer(tokenizer, monkeypatch):
    theirs = LLGuidanceBackend(tokenizer, 49152, (2,))
    written = tokenizer_files(tokenizer)["tokenizer.json"].decode()
    monkeypatch.setattr(llguidance.hf, "from_tokenizer", lambda *a, **k: pytest.fail("serialized the tokenizer"))
    ours = LLGuidanceBackend(tokenizer, 49152, (2,), written)
    assert ours.tokenizer.vocab_size == theirs.tokenizer.vocab_size == 49152
    assert ours.tokenizer.eos_token == theirs.tokenizer.eos_token
    for text in TEXTS:
        assert ours.tokenizer.tokenize_str(text) == theirs.tokenizer.tokenize_str(text)
    params = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}})
    matcher = ours.compile(params).matcher()
    assert not matcher.dead_end()


def test_padding_and_truncation_in_the_json_are_dropped(tokenizer):
    data = json.loads(tokenizer_files(tokenizer)["tokenizer.json"])
    data["truncation"] = {"direction": "Right", "max_length": 4, "strategy": "LongestFirst", "stride": 0}
    data["padding"] = {"strategy": {"Fixed": 128}, "direction": "Right", "pad_to_multiple_of": None, "pad_id": 0,
                       "pad_type_id": 0, "pad_token": "<|endoftext|>"}
    backend = LLGuidanceBackend(tokenizer, 49152, (2,), json.dumps(data))
    assert backend.tokenizer.tokenize_str(TEXTS[1]) == tokenizer.encode(TEXTS[1], add_special_tokens=False)
