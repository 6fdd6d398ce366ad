"""`--random-weights SHAPE` of `bench offline` and `bench serve`: the flag, its folder, and one
tiny offline run end to end (seconds: the tiny shape is one layer of width 64)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import random_model
from bench.offline import random_prompts
from bench.random_model import random_weights_dtype, use_random_weights
from bench.throughput_report import offline_rows
from pagedserve.cli import build_parser, main


@pytest.fixture(scope="session")
def models_root(tmp_path_factory):
    """Random models built once per session under a temporary folder, not the user's cache."""
    root = tmp_path_factory.mktemp("random-models")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(random_model, "random_models_root", lambda: root)
        yield root


def _parse(*flags: str):
    return build_parser().parse_args(["bench", *flags])


@pytest.mark.parametrize("command", ["offline", "serve"])
def test_random_weights_resolves_to_a_model_folder(models_root, command):
    from transformers import AutoConfig

    from engine.models.loader import load_tokenizer
    args = _parse(command, "--random-weights", "tiny")
    use_random_weights(args, f"bench {command}")
    assert Path(args.model) == models_root / "tiny-float32"  # auto on CPU: float32
    assert args.dtype == "float32"
    assert (Path(args.model) / "config.json").is_file()
    assert AutoConfig.from_pretrained(args.model).vocab_size == random_model.SHAPES["tiny"][1]["vocab_size"]
    assert load_tokenizer(Path(args.model)).encode("hello world")


@pytest.mark.parametrize("command", ["offline", "serve"])
def test_random_weights_with_model_is_refused(monkeypatch, tmp_path, command):
    monkeypatch.setattr(random_model, "random_models_root", lambda: tmp_path)
    args = _parse(command, "--random-weights", "tiny", "--model", "/some/model")
    with pytest.raises(SystemExit, match=f"bench {command}: error: --random-weights tiny is the model: "
                                         "drop --model /some/model"):
        use_random_weights(args, f"bench {command}")
    assert not any(tmp_path.iterdir())  # refused before building anything


def test_unknown_shape_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit):
        _parse("offline", "--random-weights", "gpt-5")
    assert "invalid choice: 'gpt-5'" in capsys.readouterr().err


def test_without_the_flag_nothing_changes():
    args = _parse("offline", "--model", "/some/model")
    use_random_weights(args, "bench offline")
    assert (args.model, args.dtype) == ("/some/model", "auto")


@pytest.mark.parametrize("dtype, device, expected", [
    ("auto", "cuda", "bfloat16"), ("auto", "cuda:1", "bfloat16"), ("auto", "cpu", "float32"),
    ("float16", "cuda", "float16"), ("bfloat16", "cpu", "bfloat16")])
def test_dtype_auto_is_bfloat16_on_cuda_and_float32_on_cpu(dtype, device, expected):
    assert random_weights_dtype(dtype, device) == expected


def test_random_prompts_stay_inside_the_vocabulary():
    prompts = random_prompts(64, 128, vocab_size=1024, seed=0)
    ids = [t for p in prompts for t in p]
    assert min(ids) >= 100 and max(ids) < 1024
    assert max(ids) > 1000  # drawn over the whole range, not a corner of it


def test_bench_offline_runs_on_random_weights_and_writes_json(models_root, tmp_path):
    rc = main(["bench", "offline", "--random-weights", "tiny", "--num-prompts", "4", "--input-len", "16",
               "--output-len", "8", "--repeats", "1", "--single-repeats", "1", "--output-dir", str(tmp_path),
               "--compare-hf", "--hf-dtypes", "float32", "--hf-sequential-prompts", "1"])
    assert rc == 0
    [path] = tmp_path.glob("offline-*.json")
    result = json.loads(path.read_text())
    assert result["workload"]["random_weights"] == "tiny"
    assert result["engine_config"]["model"] == str(models_root / "tiny-float32")
    assert result["engine_config"]["dtype"] == "float32"
    assert result["results"]["engine_batch"]["output_tokens"] == 4 * 8
    assert result["results"]["engine_single"]["decode_tok_s"] > 0
    assert result["results"]["hf_float32_sequential"]["output_tokens"] == 1 * 8
    assert set(result["ratios"]) == {"engine_vs_hf_float32_sequential", "engine_vs_hf_float32_batch32"}
    # bench/gpu_session.sh's closing table reads the same file
    rows = offline_rows(tmp_path)
    assert [r[0] for r in rows] == ["engine " + result["engine_config"]["attention_backend"],
                                    "hf float32 sequential", "hf float32 batch32"]
    assert rows[0][1] == result["results"]["engine_batch"]["output_tok_s"]
