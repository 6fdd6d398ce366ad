"""Quantize a float HF folder to the `gptq` format with GPTQModel on CPU, as its README does, and
save it (checkpoint_format "gptq", v1: qweight, qzeros, scales, g_idx). Runs in the side env of
tests/quant_checkpoints.py.

    python gptqmodel_quantize.py SPEC.json

SPEC: {"base", "group_size", "calibration": [[token ids], ...], "jobs": [{"kind": "gptq" | "gptq-actorder", "out"}]}.
"""

from __future__ import annotations

import json
import sys


def quantize(spec: dict, kind: str, out: str) -> None:
    import torch
    from gptqmodel import GPTQModel, QuantizeConfig
    torch.manual_seed(0)
    config = QuantizeConfig(bits=4, group_size=spec["group_size"], sym=True, desc_act=kind == "gptq-actorder")
    # float16, as GPTQ checkpoints on the Hub are (the scales are fp16 either way)
    model = GPTQModel.load(spec["base"], config, device="cpu", dtype=torch.float16)
    model.quantize([{"input_ids": ids, "attention_mask": [1] * len(ids)} for ids in spec["calibration"]],
                   batch_size=1)
    model.save(out)


def main(spec_path: str) -> None:
    spec = json.loads(open(spec_path).read())
    for job in spec["jobs"]:
        quantize(spec, job["kind"], job["out"])


if __name__ == "__main__":
    main(sys.argv[1])
