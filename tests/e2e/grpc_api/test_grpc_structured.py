"""gRPC end to end: the `constraint` oneof holds every sample to its schema."""

from __future__ import annotations

import json
import re

import jsonschema

from grpc_client import FR, generate, greedy
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
