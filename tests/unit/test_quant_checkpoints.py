"""The quantized test checkpoints of tests/quant_checkpoints.py (issue 46), made by the real tools
from a tiny random Llama: each holds the tensors its format names, in the dtypes and shapes the
format defines; `dequantized_reference` is close to the float weights it was made from, and it
is exactly what the libraries that define each format dequantize (transformers with
compressed-tensors, GPTQModel, transformers' FP8).

The first run on a machine builds the side env of the tools (about 1.5 min) and the checkpoints
(about 40 s); later runs find both in the cache.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

import quant_checkpoints as qc
from helpers import build_tiny_model

pytestmark = pytest.mark.heavy(150)  # cold: the side env and the checkpoints; warm: seconds

LAYER = "model.layers.0.mlp.down_proj"  # out 64, in 128: four groups of 32 per row
BF16, FP16, I32, I64, FP8 = torch.bfloat16, torch.float16, torch.int32, torch.int64, torch.float8_e4m3fn
# Each format's tensors for LAYER, as written: suffix -> (dtype, shape).
CT_W4 = {"weight_packed": (I32, [64, 16]), "weight_scale": (BF16, [64, 4]), "weight_shape": (I64, [2])}
GPTQ = {"qweight": (I32, [16, 64]), "qzeros": (I32, [4, 8]), "scales": (FP16, [4, 64]), "g_idx": (I32, [128])}
LAYOUTS = {
    "ct-w4a16": CT_W4,
    "ct-w4a16-actorder": {**CT_W4, "weight_g_idx": (I32, [128])},
    "ct-w4a16-asym": {**CT_W4, "weight_zero_point": (I32, [8, 4])},
    "ct-w8a16": {**CT_W4, "weight_packed": (I32, [64, 32])},
    "ct-w8a8": {"weight": (torch.int8, [64, 128]), "weight_scale": (BF16, [64, 1])},
    "ct-fp8": {"weight": (FP8, [64, 128]), "weight_scale": (BF16, [64, 1])},
    "ct-fp8-block": {"weight": (FP8, [64, 128]), "weight_scale": (BF16, [2, 4])},
    "gptq": GPTQ,
    "gptq-actorder": GPTQ,
    "awq": {"qweight": (I32, [128, 8]), "qzeros": (I32, [4, 8]), "scales": (FP16, [4, 64])},
    "fp8-block": {"weight": (FP8, [64, 128]), "weight_scale_inv": (torch.float32, [2, 4])},
}
# Relative Frobenius error of each quantized weight against the float one: 4-bit groups of 32
# random normal weights (GPTQ minimizes output error, not weight error); int8; e4m3's 3 mantissa bits.
BOUNDS = {"4": 0.16, "8": 0.015, "fp8": 0.03}
BITS = {"ct-w8a16": "8", "ct-w8a8": "8", "ct-fp8": "fp8", "ct-fp8-block": "fp8", "fp8-block": "fp8"}


@pytest.fixture(scope="module")
def base(tmp_path_factory, bundled_tokenizer):
    return build_tiny_model("llama", tmp_path_factory.mktemp("llama"), bundled_tokenizer)


@pytest.fixture(scope="module")
def checkpoints(base):
    return qc.make_checkpoints(list(qc.KINDS), base)


@pytest.fixture(scope="module")
def library_weights(checkpoints, tmp_path_factory):
    """Each checkpoint's linears as its format's own library dequantizes them (one side process)."""
    work = tmp_path_factory.mktemp("library")
    jobs = [{"kind": kind, "folder": str(folder), "out": str(work / f"{kind}.safetensors")}
            for kind, folder in checkpoints.items() if kind != "fp8-block"]
    qc.run_tool("library_dequantize.py", {"jobs": jobs})
    weights = {job["kind"]: load_file(job["out"]) for job in jobs}
    weights["fp8-block"] = _transformers_fp8_weights(checkpoints["fp8-block"])
    return weights


def _transformers_fp8_weights(folder) -> dict[str, torch.Tensor]:
    """transformers' own reading of `quant_method: fp8` (FineGrainedFP8, dequantized on CPU)."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    return {name: t for name, t in model.state_dict().items() if name.endswith("_proj.weight")}


@pytest.mark.parametrize("kind", qc.KINDS)
def test_tensors_as_the_format_names_them(kind, checkpoints):
    folder = checkpoints[kind]
    tensors = load_file(str(folder / "model.safetensors"))
    written = {name.removeprefix(f"{LAYER}."): (t.dtype, list(t.shape)) for name, t in tensors.items()
               if name.startswith(f"{LAYER}.")}
    assert written == LAYOUTS[kind]
    config = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == qc.quant_method(kind)
    assert (folder / "tokenizer.json").is_file()


@pytest.mark.parametrize("kind, permuted", [("ct-w4a16-actorder", True), ("gptq", False), ("gptq-actorder", True)])
def test_act_order_groups(kind, permuted, checkpoints):
    """g_idx[k] is input k's group: with act-order (desc_act, actorder "group") the groups are
    32 inputs each, no longer in runs; without, g_idx is k // 32."""
    tensors = load_file(str(checkpoints[kind] / "model.safetensors"))
    g_idx = tensors[f"{LAYER}.g_idx" if kind.startswith("gptq") else f"{LAYER}.weight_g_idx"].long()
    assert torch.bincount(g_idx).tolist() == [32] * 4
    assert torch.equal(g_idx, torch.arange(128) // 32) != permuted


@pytest.mark.parametrize("kind", qc.KINDS)
def test_reference_is_near_the_float_weights(kind, base, checkpoints):
    """Every `*_proj` linear is quantized, and its reference is the float weight within the
    format's rounding. W4A16_ASYM by AWQ is the exception: AWQ scales each input channel of a
    layer by s and the layer before it by 1 / s, so its weights are near the float ones only
    times s (the model-level test below covers it)."""
    float_weights = load_file(str(base / "model.safetensors"))
    reference = qc.dequantized_reference(kind, checkpoints[kind])
    assert set(reference) == {name for name in float_weights if name.endswith("_proj.weight")}
    assert all(t.dtype == torch.float32 and t.shape == float_weights[name].shape for name, t in reference.items())
    if kind == "ct-w4a16-asym":
        return
    for name, weight in reference.items():
        error = (weight - float_weights[name]).norm() / float_weights[name].norm()
        assert error < BOUNDS[BITS.get(kind, "4")], (name, error)


@pytest.mark.parametrize("kind", qc.KINDS)
def test_reference_model_is_near_the_float_model(kind, base, checkpoints):
    """The float32 model of the references (reference_folder), with the checkpoint's other
    tensors (norms AWQ rescaled, embeddings), gives nearly the float model's logits. The random
    model amplifies weight error (rounding its weights to bf16 moves its logits 1.3%; at 4 bits
    they move 37-43%, and about half the top tokens stay), while unrelated logits differ ~140%."""
    from transformers import AutoModelForCausalLM
    ids = torch.tensor(qc.calibration_ids(base)[:2])
    logits = [AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)(ids).logits
              for folder in (base, qc.reference_folder(kind, checkpoints[kind]))]
    error = (logits[1] - logits[0]).norm() / logits[0].norm()
    assert error < {"4": 0.5, "8": 0.05, "fp8": 0.25}[BITS.get(kind, "4")]


@pytest.mark.parametrize("kind", qc.KINDS)
def test_reference_is_what_the_library_dequantizes(kind, checkpoints, library_weights):
    """Bit for bit: every weight is an integer (or e4m3 value) times a 16- or 32-bit scale, one
    product, exact in float32 for the int formats."""
    reference = qc.dequantized_reference(kind, checkpoints[kind])
    library = library_weights[kind]
    assert set(library) == set(reference)
    for name, weight in reference.items():
        assert torch.equal(library[name], weight), name


def test_errors(checkpoints):
    with pytest.raises(ValueError, match="unknown kinds"):
        qc.make_checkpoint("gptq-3bit", checkpoints["gptq"])
    with pytest.raises(ValueError, match="not a 'gptq' checkpoint"):
        qc.dequantized_reference("gptq", checkpoints["awq"])
