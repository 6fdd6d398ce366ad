"""A bad --model (or --tokenizer, --speculative-model) is refused before anything starts: one
line naming the problem and what is accepted, exit code 2, no traceback, no port opened
(issue 44). The commands run as real subprocesses."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

# A refusal reads a few bytes and exits; the rest is the CLI's imports (about 2 s here).
REFUSAL_S = 30


def _gguf(path: Path, arch: str) -> Path:
    """A GGUF file with metadata and no tensors, as gguf-py writes it."""
    import gguf
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("tiny")
    writer.add_block_count(2)
    writer.add_token_list([b"a", b"b", b"c"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _hf_folder(path: Path, model_type: str) -> Path:
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": model_type, "architectures": ["X"]}))
    (path / "model.safetensors").write_bytes(b"")
    return path


# kind -> (make the bad model under tmp_path, words the error line must hold)
BAD_MODELS = {
    "missing": (lambda tmp: tmp / "no" / "such.gguf", "no such file or folder"),
    "folder without config.json": (lambda tmp: (tmp / "empty").mkdir() or tmp / "empty", "no config.json"),
    "unsupported config.json": (lambda tmp: _hf_folder(tmp / "gpt2", "gpt2"), "'gpt2' is not supported"),
    "unsupported GGUF architecture": (lambda tmp: _gguf(tmp / "gpt2.gguf", "gpt2"), "'gpt2' is not supported"),
    "corrupt GGUF": (lambda tmp: (tmp / "bad.gguf").write_bytes(b"this is not GGUF" * 4) and tmp / "bad.gguf",
                     "not a GGUF file"),
    "neither .gguf nor a folder": (lambda tmp: (tmp / "model.bin").write_bytes(b"\0" * 64) and tmp / "model.bin",
                                   "not a .gguf file"),
}


def _refused(argv: list[str], flag: str) -> str:
    """Run `pagedserve ARGV`; check it is refused as a bad `flag` at once; its error line."""
    start = time.monotonic()
    run = subprocess.run([sys.executable, "-m", "pagedserve", *argv], capture_output=True, text=True,
                         timeout=REFUSAL_S * 2)
    elapsed = time.monotonic() - start
    output = run.stdout + run.stderr
    assert run.returncode == 2, output
    assert "Traceback" not in output and "listening" not in output, output
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, output
    command = " ".join(a for a in argv[:2] if not a.startswith("-"))
    assert lines[0].startswith(f"pagedserve {command}: error: {flag} "), lines[0]
    assert elapsed < REFUSAL_S, elapsed
    return lines[0]


@pytest.mark.parametrize("kind", BAD_MODELS)
def test_serve_refuses_a_bad_model_before_listening(tmp_path, kind):
    make, words = BAD_MODELS[kind]
    model = make(tmp_path)
    line = _refused(["serve", "--model", str(model), "--grpc-port", "0", "--http-port", "0"], "--model")
    assert words in line and str(model) in line
    assert "HF" in line or "Hugging Face" in line or "supported:" in line  # says what is accepted


def _quantized_folder(path: Path, quantization_config: dict, scales: bool = True) -> Path:
    """A tiny GPTQ-style llama folder: config.json with `quantization_config`, and one layer's
    qweight/qzeros (and scales) in its safetensors."""
    import torch
    from safetensors.torch import save_file
    path.mkdir()
    config = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
              "quantization_config": quantization_config}
    (path / "config.json").write_text(json.dumps(config))
    layer = "model.layers.0.mlp.down_proj"
    tensors = {f"{layer}.qweight": torch.zeros(16, 64, dtype=torch.int32),
               f"{layer}.qzeros": torch.zeros(4, 8, dtype=torch.int32)}
    if scales:
        tensors[f"{layer}.scales"] = torch.ones(4, 64, dtype=torch.float16)
    save_file(tensors, str(path / "model.safetensors"))
    return path


GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True}
# kind -> (quantization_config, whether the scales are there, words the error line must hold)
BAD_QUANTIZED = {
    "bits 3": (GPTQ | {"bits": 3}, True, "gptq with bits 3 is not supported (supported: gptq (4 or 8 bit"),
    "unknown quant_method": (GPTQ | {"quant_method": "bitsandbytes"}, True,
                             "quant_method 'bitsandbytes' is not supported (supported: gptq"),
    "group size not dividing": (GPTQ | {"group_size": 96}, True, "group_size 96 does not divide the model's hidden_size 64"),
    "missing scale tensor": (GPTQ, False, "'model.layers.0.mlp.down_proj.qweight' has no "
                                          "model.layers.0.mlp.down_proj.scales beside it"),
}


@pytest.mark.parametrize("kind", BAD_QUANTIZED)
def test_serve_refuses_a_bad_quantized_checkpoint_before_listening(tmp_path, kind):
    """Read from config.json and the safetensors headers before anything starts (issue 46)."""
    config, scales, words = BAD_QUANTIZED[kind]
    model = _quantized_folder(tmp_path / "q", config, scales)
    line = _refused(["serve", "--model", str(model), "--grpc-port", "0", "--http-port", "0"], "--model")
    assert words in line and str(model) in line


def test_engine_refuses_a_bad_model_before_binding(tmp_path):
    model = _hf_folder(tmp_path / "gpt2", "gpt2")
    line = _refused(["engine", "--model", str(model), "--address", f"ipc://{tmp_path}/e", "--health-port", "0"],
                    "--model")
    assert "supported: " in line and "llama" in line


def test_run_batch_refuses_a_bad_model_before_writing(tmp_path):
    requests, results = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    requests.write_text("")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF")  # the magic, then nothing: a cut-off file
    line = _refused(["run-batch", "-i", str(requests), "-o", str(results), "--model", str(bad)], "--model")
    assert "GGUF" in line
    assert not results.exists()


def test_a_bad_tokenizer_or_draft_model_is_refused(tmp_path):
    line = _refused(["serve", "--tokenizer", str(tmp_path / "nothing"), "--grpc-port", "0", "--http-port", "0"],
                    "--tokenizer")
    assert "no such" in line
    line = _refused(["engine", "--speculative-model", str(tmp_path / "draft.gguf"),
                     "--address", f"ipc://{tmp_path}/e"], "--speculative-model")
    assert "no such file or folder" in line
    # The frontend reads its own tokenizer folder (tokenizer.json), and imports no engine code to check it.
    (tmp_path / "slow").mkdir()
    (tmp_path / "slow" / "tokenizer_config.json").write_text("{}")
    line = _refused(["frontend", "--tokenizer", str(tmp_path / "slow"), "--engine-address", f"ipc://{tmp_path}/e"],
                    "--tokenizer")
    assert "no tokenizer.json" in line


def test_offline_llm_raises_a_value_error(tmp_path):
    from pagedserve import LLM
    with pytest.raises(ValueError, match=r"^model '.*such\.gguf': no such file or folder"):
        LLM(str(tmp_path / "such.gguf"))
    with pytest.raises(ValueError, match="'gpt2' is not supported"):
        LLM(str(_gguf(tmp_path / "gpt2.gguf", "gpt2")))


def test_the_check_reads_headers_not_weights(tmp_path, bundled_path):
    from engine.models.source import ModelError, check_model
    start = time.monotonic()
    assert check_model(None) == check_model(str(bundled_path)) == bundled_path
    assert time.monotonic() - start < 1.0  # two GGUF headers; the weights are 98 MB
    import gguf
    mixtral = tmp_path / "moe.gguf"  # Mixtral GGUFs say llama, with experts
    writer = gguf.GGUFWriter(str(mixtral), "llama")
    writer.add_expert_count(8)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    with pytest.raises(ModelError, match="'llama' with experts is not supported"):
        check_model(str(mixtral))


def test_a_model_and_flags_that_do_not_fit_end_the_engine_in_one_line(tmp_path):
    """Refused once the model is read (its positions): exit 2 and the reason, no traceback."""
    run = subprocess.run([sys.executable, "-m", "pagedserve", "engine", "--max-model-len", "100000",
                          "--address", f"ipc://{tmp_path}/e", "--num-threads", "1"],
                         capture_output=True, text=True, timeout=REFUSAL_S * 4)
    output = run.stdout + run.stderr
    assert run.returncode == 2, output
    assert "cannot start: max_model_len: 100000 exceeds the model's" in output and "Traceback" not in output, output
