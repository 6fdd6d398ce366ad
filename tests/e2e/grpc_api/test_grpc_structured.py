"""gRPC end to end: the `constraint` oneof holds every sample to its schema."""

from __future__ import annotations

import json
import re

import grpc
import jsonschema
import pytest

from grpc_client import FR, generate, generate_error, greedy, names_field
from common.v1 import generation_pb2 as gen


# -- structured output ---------------------------------------------------------------------

ITEM = {"type": "object", "additionalProperties": False, "required": ["sku", "qty", "colour"],
        "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
                       "qty": {"type": "integer", "minimum": 1, "maximum": 99},
                       "colour": {"enum": ["red", "green", "blue"]},
                       "notes": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 2}}}


def test_constraints_hold_for_every_sample(frontend):
    r = generate(frontend, text="An order line as JSON:", json_schema=json.dumps(ITEM),
                 sampling=gen.SamplingParams(n=4, temperature=1.0, seed=5, max_tokens=120))
    for i in range(4):
        jsonschema.validate(json.loads(r.texts[i]), ITEM)
        assert r.finished[i].reason == FR.FINISH_REASON_EOS  # the grammar's end, as eos would be
    r = generate(frontend, text="Sentiment of 'meh':", choice=gen.Choices(choices=["good", "bad", "meh"]),
                 sampling=gen.SamplingParams(n=3, temperature=1.5, seed=1, max_tokens=8))
    assert all(r.texts[i] in ("good", "bad", "meh") for i in range(3))
    r = generate(frontend, text="A date:", regex=r"20[0-9]{2}-[01][0-9]-[0-3][0-9]", sampling=greedy(16))
    assert re.fullmatch(r"20[0-9]{2}-[01][0-9]-[0-3][0-9]", r.texts[0])
    info = frontend.wait_kv_free()
    assert info.num_running == 0 and info.num_waiting == 0


# The bundled tokenizer has no token holding the byte 0xF1, which starts U+40000's UTF-8.
UNWRITABLE = "\U00040000"


def test_a_constraint_the_vocabulary_cannot_write_is_invalid_argument(frontend):
    """At its start (refused when it compiles, before any message) or on the way (after `a`):
    INVALID_ARGUMENT naming the field, never INTERNAL; the next request runs."""
    error = generate_error(frontend, gen.GenerateRequest(text="Say:", regex=UNWRITABLE, sampling=greedy(8)))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (error.code(), error.details())
    assert names_field(error.details(), "structured_outputs.regex") and "vocabulary" in error.details()
    for request in (gen.GenerateRequest(text="Say:", regex="a" + UNWRITABLE, sampling=greedy(8)),
                    gen.GenerateRequest(text="Say:", json_schema=json.dumps({"const": UNWRITABLE}),
                                        sampling=gen.SamplingParams(temperature=1.0, seed=3, max_tokens=8))):
        with pytest.raises(grpc.RpcError) as info:
            list(frontend.generation.Generate(request, timeout=60))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (info.value.code(), info.value.details())
        assert names_field(info.value.details(), f"structured_outputs.{'json' if request.json_schema else 'regex'}")
    r = generate(frontend, text="A date:", regex=r"20[0-9]{2}-[01][0-9]", sampling=greedy(8))
    assert re.fullmatch(r"20[0-9]{2}-[01][0-9]", r.texts[0])
    info = frontend.wait_kv_free()
    assert info.num_running == 0 and info.num_waiting == 0
