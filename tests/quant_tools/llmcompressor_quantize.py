"""Quantize a float HF folder with llm-compressor's `oneshot`, as its examples do, and save it
compressed (compressed-tensors). Runs in the side env of tests/quant_checkpoints.py, which holds
llm-compressor's own transformers.

    python llmcompressor_quantize.py SPEC.json

SPEC: {"base", "group_size", "block", "calibration": [[token ids], ...], "jobs": [{"kind", "out"}, ...]}.
"""

from __future__ import annotations

import copy
import json
import sys

PRESETS = {"ct-w4a16": "W4A16", "ct-w4a16-actorder": "W4A16", "ct-w4a16-asym": "W4A16_ASYM", "ct-w8a16": "W8A16",
           "ct-w8a8": "W8A8", "ct-fp8": "FP8_DYNAMIC", "ct-fp8-block": "FP8_BLOCK"}
# Left in float, as llm-compressor's examples leave them: the LM head and a MoE router.
IGNORE = ["lm_head", "re:.*mlp.gate$"]


def scheme(kind: str, group_size: int, block: int):
    """The preset's scheme, its groups (blocks) resized to what divides the model's sizes."""
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES
    args = copy.deepcopy(PRESET_SCHEMES[PRESETS[kind]])
    for part in args.values():
        if part.block_structure:
            part.block_structure = [block, block]
        if part.group_size:  # FP8_BLOCK's activations come in groups of one block's width
            part.group_size = block if kind == "ct-fp8-block" else group_size
    return QuantizationScheme(targets=["Linear"], **args)


def recipe(kind: str, group_size: int, block: int) -> list:
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
    from llmcompressor.modifiers.transform.awq import AWQModifier
    groups = {"group_0": scheme(kind, group_size, block)}
    if kind == "ct-w4a16-asym":  # AWQ scales the inputs, then the quantizer rounds (llm-compressor >= 0.12)
        return [AWQModifier(), QuantizationModifier(config_groups=groups, ignore=IGNORE)]
    if kind in ("ct-fp8", "ct-fp8-block"):  # no calibration: weights by min-max, activations dynamic
        return [QuantizationModifier(config_groups=groups, ignore=IGNORE)]
    if kind == "ct-w4a16-actorder":  # groups follow activation order, which writes weight_g_idx
        return [GPTQModifier(config_groups=groups, ignore=IGNORE, actorder="group")]
    return [GPTQModifier(config_groups=groups, ignore=IGNORE)]  # actorder "static": no g_idx


def allow_cpu_only() -> None:
    """AWQModifier pins its cached activations for faster copies to a GPU (llm-compressor 0.13
    and 0.14 do so unconditionally), and pinning fails where torch has no accelerator; unpinned,
    every value is the same."""
    import torch
    from llmcompressor.pipelines.cache import IntermediatesCache
    if not torch.accelerator.is_available():
        IntermediatesCache.pin_memory = lambda self, *args, **kwargs: None


def quantize(spec: dict, kind: str, out: str) -> None:
    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    # bfloat16, as users quantize: the scales come out in the model's dtype
    model = AutoModelForCausalLM.from_pretrained(spec["base"], dtype=torch.bfloat16)
    samples = spec["calibration"]
    calibration = Dataset.from_dict({"input_ids": samples, "attention_mask": [[1] * len(ids) for ids in samples]})
    oneshot(model=model, dataset=calibration, recipe=recipe(kind, spec["group_size"], spec["block"]),
            num_calibration_samples=len(samples), max_seq_length=max(map(len, samples)),
            shuffle_calibration_samples=False)
    model.save_pretrained(out, save_compressed=True)


def main(spec_path: str) -> None:
    spec = json.loads(open(spec_path).read())
    allow_cpu_only()
    for job in spec["jobs"]:
        quantize(spec, job["kind"], job["out"])


if __name__ == "__main__":
    main(sys.argv[1])
