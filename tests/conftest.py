"""Fixtures shared by the engine tests: the bundled model, its tokenizer, HF references."""

from __future__ import annotations

import os

import pytest
import torch

torch.set_flush_denormal(True)  # without it some models run 5x slower on CPU


def pytest_addoption(parser):
    parser.addoption("--long", action="store_true",
                     help="release checks: 20x the fuzz examples, a 5x cancellation storm, a 30-minute soak")


def pytest_configure(config):
    # Read by helpers.LONG when test modules are imported (after this hook).
    if config.getoption("--long"):
        os.environ["PAGEDSERVE_LONG_TESTS"] = "1"


@pytest.fixture(scope="session")
def bundled_path():
    from engine.models.loader import bundled_model_path
    return bundled_model_path()


@pytest.fixture(scope="session")
def bundled_tokenizer(bundled_path):
    from engine.models.loader import load_tokenizer
    return load_tokenizer(bundled_path)


@pytest.fixture(scope="session")
def bundled_hf_model(bundled_path):
    """HF transformers' own GGUF loader and Llama implementation, in fp32: the reference."""
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(str(bundled_path.parent), gguf_file=bundled_path.name,
                                                dtype=torch.float32).eval()


@pytest.fixture(autouse=True)
def no_kv_leak(monkeypatch):
    """Every engine a test builds must end the test with all KV blocks free and no request left."""
    from engine.core import EngineCore
    from helpers import assert_engine_idle
    created: list[EngineCore] = []
    original = EngineCore.__init__

    def tracking_init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        created.append(self)

    monkeypatch.setattr(EngineCore, "__init__", tracking_init)
    yield
    for core in created:
        assert_engine_idle(core)
