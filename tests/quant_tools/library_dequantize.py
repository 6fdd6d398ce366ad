"""The quantized linears of checkpoints, dequantized by the libraries that define their formats:
the check on tests/quant_checkpoints.py's `dequantized_reference`. Runs in the side env.

    python library_dequantize.py SPEC.json

SPEC: {"jobs": [{"kind", "folder", "out"}, ...]}; each `out` gets a safetensors file of float32
weights [out, in] under the float model's names ("model.layers.0.mlp.up_proj.weight").
- compressed-tensors: transformers' CompressedTensorsHfQuantizer with run_compressed=False, which
  decompresses every layer through compressed-tensors at load;
- gptq: GPTQModel's torch kernel (TorchLinear.dequantize_weight) after GPTQModel.load;
- awq: GPTQModel's AWQ GEMM unpacking (gptqmodel.quantization.awq.utils.packing_utils.dequantize_gemm).
"""

from __future__ import annotations

import json
import sys


def compressed_tensors(folder: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                 quantization_config=CompressedTensorsConfig(run_compressed=False))
    return {f"{name}.weight": module.weight.float() for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) and name.endswith("_proj")}


def gptq(folder: str) -> dict:
    import torch
    from gptqmodel import BACKEND, GPTQModel
    model = GPTQModel.load(folder, device="cpu", backend=BACKEND.TORCH, dtype=torch.float16)
    weights = {}
    for name, module in model.model.named_modules():
        if hasattr(module, "qweight") and hasattr(module, "dequantize_weight"):
            # the kernel runs in fp16 only, where (q - z) * scale rounds; its math on float32
            # scales (fp16 widens exactly) is exact, as the reference is
            module.scales = module.scales.float()
            weights[f"{name}.weight"] = module.dequantize_weight().float().t()
    return weights


def awq(folder: str) -> dict:
    from gptqmodel.quantization.awq.utils.packing_utils import dequantize_gemm
    from safetensors.torch import load_file
    config = json.loads(open(f"{folder}/config.json").read())["quantization_config"]
    tensors = load_file(f"{folder}/model.safetensors")
    weights = {}
    for prefix in [name.removesuffix(".qweight") for name in tensors if name.endswith(".qweight")]:
        weight = dequantize_gemm(tensors[f"{prefix}.qweight"], tensors[f"{prefix}.qzeros"], tensors[f"{prefix}.scales"].float(),
                                 config["bits"], config["group_size"])  # [in, out]
        weights[f"{prefix}.weight"] = weight.float().t()
    return weights


def main(spec_path: str) -> None:
    from safetensors.torch import save_file
    spec = json.loads(open(spec_path).read())
    for job in spec["jobs"]:
        kind = job["kind"]
        read = compressed_tensors if kind.startswith("ct-") else gptq if kind.startswith("gptq") else awq
        save_file({k: v.contiguous() for k, v in read(job["folder"]).items()}, job["out"])


if __name__ == "__main__":
    main(sys.argv[1])
