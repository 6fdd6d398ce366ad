"""An empty --model or --revision is the flag left out: the bundled model, the Hub's default
branch. The deployment templates pass both flags always, empty for the default (compose.yaml's
${PAGEDSERVE_MODEL:-}, the Kubernetes engine's $(PAGEDSERVE_MODEL) from its ConfigMap)."""

from __future__ import annotations

import pytest

from engine.arg_utils import engine_config_from_args
from engine.models.source import bundled_model_path, check_model, check_models
from pagedserve.cli import build_parser


@pytest.mark.parametrize("command", ["engine", "serve"])
def test_an_empty_model_is_the_bundled_one(command):
    args = build_parser().parse_args([command, "--model", "", "--revision", ""])
    assert args.model is None and args.revision is None
    check_models(args)  # the bundled model, found and checked (no Hub request: it has no name)
    assert check_model(args.model) == bundled_model_path()
    if command == "engine":
        config = engine_config_from_args(args)
        assert config.model is None and config.revision is None


def test_a_named_model_is_kept():
    args = build_parser().parse_args(["engine", "--model", "Qwen/Qwen3-0.6B", "--revision", "v1"])
    assert (args.model, args.revision) == ("Qwen/Qwen3-0.6B", "v1")
