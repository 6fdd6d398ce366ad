"""The committed stubs in pagedserve/v1 are exactly what protoc makes from protos/."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_generated_stubs_are_up_to_date(tmp_path):
    grpc_tools = pytest.importorskip("grpc_tools.protoc")
    protos = sorted(str(p.relative_to(ROOT / "protos")) for p in (ROOT / "protos").rglob("*.proto"))
    args = ["protoc", f"-I{ROOT / 'protos'}", f"--python_out={tmp_path}", f"--pyi_out={tmp_path}",
            f"--grpc_python_out={tmp_path}", *protos]
    assert grpc_tools.main(args) == 0
    fresh = {p.relative_to(tmp_path): p.read_text() for p in tmp_path.rglob("*.py*")}
    assert fresh, "protoc generated nothing"
    for rel, text in fresh.items():
        committed = ROOT / rel
        assert committed.is_file(), f"{rel} is not committed: run `make protos`"
        assert committed.read_text() == text, f"{rel} is stale: run `make protos`"


def test_public_api_names():
    from pagedserve.v1 import generation_pb2, info_pb2, tokenization_pb2
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
