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


def pytest_collection_modifyitems(config, items):
    """The heavy modules first, longest first: `make test` hands whole modules to its workers in
    this order (pytest-xdist's --dist loadscope --no-loadscope-reorder), so a minutes-long module
    starts early rather than ending the run alone while the other workers idle."""
    def weight(item) -> float:
        marker = item.get_closest_marker("heavy")
        return marker.args[0] if marker else 0
    items.sort(key=weight, reverse=True)  # stable: the rest keep their order


@pytest.fixture(scope="session")
def bundled_path():
    from engine.models.source import bundled_model_path
    return bundled_model_path()


@pytest.fixture(scope="session")
def bundled_tokenizer(bundled_path):
    from engine.models.loader import load_tokenizer
    return load_tokenizer(bundled_path)


@pytest.fixture(scope="session")
def bundled_hf_model(bundled_path):
    """HF transformers' own GGUF loader and Llama implementation, in fp32: the reference
    (converted once, then kept in the cache)."""
    from bench.hf_reference import load_hf_float32
    return load_hf_float32(bundled_path)


@pytest.fixture(scope="session")
def weight_checkpoints(tmp_path_factory, bundled_tokenizer):
    """The weight-update tests' checkpoints (tests/weight_checkpoints.py), built once a session."""
    from weight_checkpoints import weight_checkpoints as build
    return build(tmp_path_factory.mktemp("weights"), bundled_tokenizer)


@pytest.fixture(scope="session")
def hub():
    """A local Hugging Face Hub (tests/hub_server.py) for the session: give each test repos of
    its own names; faults (cut_after, claimed_size) want a file name of their own too."""
    from hub_server import HubServer
    with HubServer() as server:
        yield server


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
