"""Fixtures shared by the engine tests: the bundled model, its tokenizer, HF references."""

from __future__ import annotations

import os

import pytest

# Under pytest-xdist (`-n N`) each worker takes one torch thread, and so does every engine it
# starts without --num-threads (common.process_args.default_num_threads reads the variable):
# N workers' thread pools would otherwise outnumber the cores, and OpenMP threads that wait
# for a core slow every step down many times over.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"

import torch  # noqa: E402  (after OMP_NUM_THREADS: torch reads it once)

torch.set_flush_denormal(True)  # without it some models run 5x slower on CPU


def pytest_addoption(parser):
    parser.addoption("--long", action="store_true",
                     help="release checks: 20x the fuzz examples, a 5x cancellation storm, a 30-minute soak")


def pytest_configure(config):
    # Read by helpers.LONG when test modules are imported (after this hook).
    if config.getoption("--long"):
        os.environ["PAGEDSERVE_LONG_TESTS"] = "1"
    # `make test` gates every merge: hypothesis draws the same examples each run, so a failure
    # reproduces and cannot come and go. `--long` explores: fresh random examples every run.
    from hypothesis import settings
    settings.register_profile("gate", derandomize=True)
    settings.register_profile("explore", derandomize=False)
    settings.load_profile("explore" if config.getoption("--long") else "gate")


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
