"""`--dtype auto`, the default: on a CPU what the measured kernel plan prefers
(tests/kernels/test_cpu_dispatch.py), else bfloat16 where the CPU has bf16 instructions,
float32 elsewhere; a real dtype for the rest of the engine."""

from __future__ import annotations

import argparse

import pytest

from cpu_kernels import dispatch
from engine import config
from engine import main as engine_main
from engine.arg_utils import add_engine_args, engine_config_from_args
from engine.config import EngineConfig, resolve_dtype
from pagedserve import serve


@pytest.fixture
def no_plan(monkeypatch):
    """No measured plan (the kernels cannot run here): the rule from the CPU's flags."""
    monkeypatch.setattr(dispatch, "machine_plan", lambda: None)


@pytest.mark.parametrize("has_bf16, expected", [(True, "bfloat16"), (False, "float32")])
def test_auto_on_cpu_follows_bf16_instructions(monkeypatch, no_plan, has_bf16, expected):
    monkeypatch.setattr(config, "cpu_has_bf16", lambda: has_bf16)
    assert EngineConfig(dtype="auto").dtype == expected


@pytest.mark.parametrize("has_bf16, expected", [(True, "bfloat16"), (False, "float32")])
def test_default_is_auto_for_llm_engine_and_serve(monkeypatch, no_plan, has_bf16, expected):
    monkeypatch.setattr(config, "cpu_has_bf16", lambda: has_bf16)
    assert EngineConfig().dtype == expected
    assert EngineConfig.from_kwargs(model=None).dtype == expected  # what LLM() builds
    assert EngineConfig(device="cuda").dtype == "bfloat16"
    for add_arguments in (engine_main.add_arguments, serve.add_arguments):
        parser = argparse.ArgumentParser()
        add_arguments(parser)
        args = parser.parse_args([])
        assert args.dtype == "auto"
        assert engine_config_from_args(args).dtype == expected
        assert engine_config_from_args(parser.parse_args(["--dtype", "float32"])).dtype == "float32"


def test_help_names_auto_as_the_default():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    text = " ".join(parser.format_help().split())
    assert "measured per machine" in text and "(default: auto)" in text, text


def test_auto_on_cuda_is_bf16_and_explicit_dtypes_stay():
    assert resolve_dtype("auto", "cuda:1") == "bfloat16"
    for dtype in ("float32", "bfloat16", "float16"):
        assert resolve_dtype(dtype, "cpu") == dtype


def test_cpu_flags_are_read(monkeypatch, tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor : 0\nflags : fpu sse avx2 avx512f avx512_bf16\n")
    real_open = open
    monkeypatch.setattr("builtins.open", lambda path, *a, **k: real_open(
        cpuinfo if path == "/proc/cpuinfo" else path, *a, **k))
    assert config.cpu_has_bf16()
    cpuinfo.write_text("flags : fpu sse avx2\n")
    assert not config.cpu_has_bf16()


def test_unknown_dtype_is_refused():
    with pytest.raises(ValueError, match="dtype: must be one of"):
        EngineConfig(dtype="int8")
