"""CPU checks of the GPU path's configuration: the cuda_graphs flag resolves and validates
without touching a device, and the decode-graph buckets cover every batch size."""

from __future__ import annotations

import argparse

import pytest

from engine import config
from engine.arg_utils import add_engine_args, engine_config_from_args
from engine.config import EngineConfig
from engine.cuda_graphs import bucket_sizes


def test_cuda_graphs_default_follows_device_and_backend():
    assert EngineConfig(device="cpu").cuda_graphs is False
    assert EngineConfig(device="cuda", attention_backend="cupy").cuda_graphs is True
    assert EngineConfig(device="cuda", attention_backend="cupy", cuda_graphs=False).cuda_graphs is False


def test_auto_backend_on_cuda_means_graphs_where_cupy_runs(monkeypatch):
    """Graphs default on for CUDA when cupy will run attention ("auto" included), else off."""
    monkeypatch.setattr(config, "_cupy_available", lambda: True)
    assert EngineConfig(device="cuda").cuda_graphs
    assert EngineConfig(device="cuda", attention_backend="cupy").cuda_graphs
    assert not EngineConfig(device="cuda", attention_backend="torch").cuda_graphs
    assert not EngineConfig(device="cpu").cuda_graphs
    monkeypatch.setattr(config, "_cupy_available", lambda: False)
    assert not EngineConfig(device="cuda").cuda_graphs
    with pytest.raises(ValueError, match="cuda_graphs: needs"):
        EngineConfig(device="cpu", cuda_graphs=True)


@pytest.mark.parametrize("kwargs, message", [
    (dict(device="cpu", cuda_graphs=True), "cuda_graphs"),
    (dict(device="cuda", cuda_graphs=True), "attention_backend 'cupy'"),
    (dict(attention_backend="cupy"), "needs device 'cuda'"),
])
def test_invalid_gpu_options_are_refused(kwargs, message, monkeypatch):
    monkeypatch.setattr(config, "_cupy_available", lambda: False)  # as on a machine without a GPU
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)


def test_cli_flag():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config_from_args(parser.parse_args(["--device", "cpu"])).cuda_graphs is False
    args = parser.parse_args(["--device", "cuda", "--attention-backend", "cupy", "--no-cuda-graphs"])
    assert engine_config_from_args(args).cuda_graphs is False
    args = parser.parse_args(["--device", "cuda", "--attention-backend", "cupy"])
    assert engine_config_from_args(args).cuda_graphs is True


@pytest.mark.parametrize("max_num_seqs", [1, 3, 8, 20, 128, 256])
def test_buckets_cover_every_batch(max_num_seqs):
    buckets = bucket_sizes(max_num_seqs)
    assert buckets == sorted(set(buckets)) and buckets[-1] == max_num_seqs
    assert all(any(b >= n for b in buckets) for n in range(1, max_num_seqs + 1))
    assert bucket_sizes(128)[:5] == [1, 2, 4, 8, 16]
