"""`pagedserve serve`'s engine command lines: data parallel endpoints, metrics ports, threads."""

from __future__ import annotations

import argparse
import os

import pytest

from pagedserve.serve import add_arguments, engine_addresses, engine_command


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(argv)


def _flag(cmd: list[str], name: str) -> str | None:
    return cmd[cmd.index(name) + 1] if name in cmd else None


def test_engine_addresses_are_distinct():
    assert engine_addresses("tcp://127.0.0.1:5570", 3) == [
        "tcp://127.0.0.1:5570", "tcp://127.0.0.1:5571", "tcp://127.0.0.1:5572"]
    assert engine_addresses("ipc:///tmp/e", 2) == ["ipc:///tmp/e-0", "ipc:///tmp/e-1"]
    assert engine_addresses("tcp://127.0.0.1:5570", 1) == ["tcp://127.0.0.1:5570"]


def test_data_parallel_engines_share_the_cores_unless_told():
    argv = ["--data-parallel-size", "2", "--routing-policy", "round_robin", "--max-num-seqs", "8"]
    cmd = engine_command(_parse(argv), argv, "tcp://127.0.0.1:6000", 9000)
    assert _flag(cmd, "--num-threads") == str(max(1, (os.cpu_count() or 1) // 2))
    assert (_flag(cmd, "--address"), _flag(cmd, "--metrics-port"), _flag(cmd, "--max-num-seqs")) == (
        "tcp://127.0.0.1:6000", "9000", "8")
    assert "--data-parallel-size" not in cmd and "--routing-policy" not in cmd  # the frontend's own
    argv = ["--data-parallel-size", "2", "--num-threads", "3"]
    assert engine_command(_parse(argv), argv, "tcp://127.0.0.1:6000").count("--num-threads") == 1
    assert _flag(engine_command(_parse(argv), argv, "tcp://127.0.0.1:6000"), "--num-threads") == "3"
    assert "--num-threads" not in engine_command(_parse([]), [])  # one engine: torch's default


def test_the_model_as_a_positional_argument_reaches_the_engine_as_model():
    """`serve ORG/NAME ...` (vLLM's form) is `serve --model ORG/NAME ...`; the token given with
    --hf-token reaches the engine in its environment (set by the CLI), not its command line."""
    from pagedserve.cli import _take_positional_model, build_parser
    argv = ["serve", "--grpc-port", "0", "Qwen/Qwen3-0.6B", "--revision", "v1", "--hf-token", "hf_secret"]
    args = build_parser().parse_args(argv)
    rest = _take_positional_model(args, argv[1:])
    assert args.model == "Qwen/Qwen3-0.6B" and args.revision == "v1"
    cmd = engine_command(args, rest)
    assert _flag(cmd, "--model") == "Qwen/Qwen3-0.6B" and _flag(cmd, "--revision") == "v1"
    assert "Qwen/Qwen3-0.6B" not in cmd[:cmd.index("--model")] and "hf_secret" not in cmd
    args = build_parser().parse_args(["serve", "Qwen/Qwen3-0.6B", "--model", "other/model"])
    with pytest.raises(ValueError, match="given twice"):
        _take_positional_model(args, ["Qwen/Qwen3-0.6B", "--model", "other/model"])
