"""The committed stubs in common/v1 are exactly what `make protos` (protos/generate.py) makes
from protos/."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_generated_stubs_are_up_to_date():
    pytest.importorskip("grpc_tools.protoc")
    spec = importlib.util.spec_from_file_location("generate_protos", ROOT / "protos" / "generate.py")
    generate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generate)
    fresh = generate.generate()
    assert fresh, "protoc generated nothing"
    for name, text in fresh.items():
        committed = generate.OUT / name
        assert committed.is_file(), f"common/v1/{name} is not committed: run `make protos`"
        assert committed.read_text() == text, f"common/v1/{name} is stale: run `make protos`"
    assert not any("pagedserve.v1 import" in text for text in fresh.values()), "imports left absolute"


def test_public_api_names():
    from common.v1 import generation_pb2, info_pb2, tokenization_pb2
    services = {**generation_pb2.DESCRIPTOR.services_by_name, **info_pb2.DESCRIPTOR.services_by_name,
                **tokenization_pb2.DESCRIPTOR.services_by_name}
    assert set(services["Generation"].methods_by_name) == {"Generate", "Abort"}
    assert set(services["Tokenization"].methods_by_name) == {"Tokenize", "Detokenize"}
    assert set(services["Info"].methods_by_name) == {"GetModelInfo", "GetServerInfo"}
    request = generation_pb2.GenerateRequest.DESCRIPTOR
    assert [o.name for o in request.oneofs_by_name["input"].fields] == ["text", "token_ids", "chat"]
    sampling = generation_pb2.SamplingParams.DESCRIPTOR
    # proto3 `optional` on every field whose default is not zero
    for name in ("n", "temperature", "top_p", "max_tokens", "repetition_penalty", "seed", "logprobs"):
        assert sampling.fields_by_name[name].has_presence, name
