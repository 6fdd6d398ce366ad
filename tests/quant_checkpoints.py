"""Quantized checkpoints made here by the tools people use (issue 46), and each one's float32
weights by its format's published definition: what the loader's exactness tests compare with.

    folder = make_checkpoint("ct-w4a16", base)           # base: a float HF folder
    weights = dequantized_reference("ct-w4a16", folder)  # {"model.layers.0.mlp.up_proj.weight": fp32 [out, in]}
    float_folder = reference_folder("ct-w4a16", folder)  # those weights as a float32 HF model

Who makes each kind, and why:
- `ct-*` (compressed-tensors): llm-compressor's `oneshot`, the tool vLLM's docs recommend, with
  the presets users pick: W4A16 by GPTQModifier (`-actorder`: actorder "group", which writes
  `weight_g_idx`; llm-compressor 0.14 dropped it, hence the 0.13 pin), W4A16_ASYM by AWQModifier,
  W8A16 and W8A8 by GPTQModifier, FP8_DYNAMIC and FP8_BLOCK by QuantizationModifier.
- `gptq`, `gptq-actorder` (desc_act): GPTQModel, which runs on CPU.
- `awq`: an exporter (tests/quant_tools/exporters.py; AutoAWQ is archived, and GPTQModel's AWQ
  needs CUDA or output sizes that divide by 64, which the tiny models' kv heads do not): RTN
  with zero points in AutoAWQ's GEMM packing, checked against GPTQModel's `dequantize_gemm`.
- `fp8-block`: an exporter in DeepSeek-V3's layout (`quant_method: fp8`), checked against
  transformers' own FP8 dequantization.
On the tiny Qwen3-MoE (transformers fuses its experts in memory) GPTQModel 7.6 finds no expert
linears, and llm-compressor's AWQ mapping for it trips on the dense layer 0: `gptq*` and
`ct-w4a16-asym` fail there, with the tool's error; every kind works on tiny Llama and Qwen3.

The tools pin their own transformers, so they run in a side virtual env built once per machine
(`side_python`), on the scripts in tests/quant_tools/. Checkpoints are cached by kind, base
weights, calibration and the makers' code. Int groups and FP8 blocks are 32 on the tiny test
models (hidden 64); else 128, halved until it divides every size (64 for SmolLM2, whose hidden
size is 576). Each config.json's quantization_config records them.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from quant_tools.exporters import AWQ_ORDER, export

TOOLS = Path(__file__).parent / "quant_tools"
# The side env: llm-compressor 0.13.0 (the last with actorder "group"; it pins compressed-tensors
# 0.18.0 and transformers <= 5.14.1) and GPTQModel 7.6.0 (the last that allows torch 2.13).
SIDE_PACKAGES = ("torch==2.13.0", "llmcompressor==0.13.0", "gptqmodel==7.6.0")
SIDE_ENV = "-".join(package.replace("==", "-") for package in SIDE_PACKAGES[1:])
LLMCOMPRESSOR_KINDS = ("ct-w4a16", "ct-w4a16-actorder", "ct-w4a16-asym", "ct-w8a16", "ct-w8a8", "ct-fp8",
                       "ct-fp8-block")
GPTQMODEL_KINDS = ("gptq", "gptq-actorder")
EXPORTED_KINDS = ("awq", "fp8-block")
KINDS = (*LLMCOMPRESSOR_KINDS, *GPTQMODEL_KINDS, *EXPORTED_KINDS)
# Who makes each kind, in tests/quant_tools/ (its code is part of the kind's cache key).
MAKERS = {**dict.fromkeys(LLMCOMPRESSOR_KINDS, "llmcompressor_quantize.py"),
          **dict.fromkeys(GPTQMODEL_KINDS, "gptqmodel_quantize.py"), **dict.fromkeys(EXPORTED_KINDS, "exporters.py")}

# Calibration: our own words (no data set downloads), cut into samples of 64 tokens.
CALIBRATION_TEXT = """\
pagedserve is a small serving system for large language models. A request arrives over gRPC or
HTTP, the frontend turns its messages into tokens, and the engine schedules it beside the other
requests that are running. Each step the scheduler decides which sequences prefill and which
decode, the block manager hands out blocks of the key and value cache, and the model runner
builds the tensors for one forward pass. The sampler picks the next token of every row, the
output processor turns tokens back into text, checks the stop strings, and streams the pieces
to the client. Prefix caching lets two requests that share a system prompt share its blocks, so
the second one starts from the first token that differs. Chunked prefill splits a long prompt
into pieces, so that decoding rows are never stalled behind it. Speculative decoding proposes
several tokens at once, from n-grams of the prompt or from a small draft model, and the target
model checks them in one pass. Quantized weights take a quarter of the memory of bfloat16 ones,
and since decoding reads every weight once per step, they make each step faster on a machine
whose memory bandwidth is the limit. The tests compare every path against a reference: greedy
tokens must match, and log probabilities must agree to within the rounding of the arithmetic.
"""
SAMPLE_TOKENS = 64


def make_checkpoint(kind: str, base: Path) -> Path:
    """`base` quantized as `kind` (one of KINDS), in a cache folder: config.json with its
    quantization_config and the safetensors as the tool wrote them, plus base's tokenizer."""
    return make_checkpoints([kind], base)[kind]


def make_checkpoints(kinds: list[str], base: Path) -> dict[str, Path]:
    """make_checkpoint of each kind; those not cached yet are made together, one process per
    tool (each start costs about 6 s of imports)."""
    if unknown := set(kinds) - set(KINDS):
        raise ValueError(f"unknown kinds {sorted(unknown)}; known: {', '.join(KINDS)}")
    from common.paths import cache_dir
    recipe = {**_sizes(base), "calibration": calibration_ids(base)}
    root = cache_dir() / "quant-checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    folders = {kind: root / f"{kind}-{_cache_key(kind, base, recipe)}" for kind in kinds}
    with contextlib.ExitStack() as locks:
        for folder in sorted(folders.values()):  # one order for every process: none waits on another's
            locks.enter_context(_locked(folder))
        missing = {kind: Path(f"{folder}.staging") for kind, folder in folders.items()
                   if not (folder / "config.json").is_file()}
        for staging in missing.values():
            shutil.rmtree(staging, ignore_errors=True)  # left by a process killed mid-way
        _quantize(missing, base, recipe)
        for kind, staging in missing.items():
            _copy_tokenizer(base, staging)
            staging.rename(folders[kind])
    return folders


def side_python() -> Path:
    """The side env's python (built on first use, under a lock that parallel test workers share)."""
    from common.paths import cache_dir
    env = cache_dir() / "side-envs" / SIDE_ENV
    env.parent.mkdir(parents=True, exist_ok=True)
    with _locked(env):
        if not (env / ".complete").is_file():
            shutil.rmtree(env, ignore_errors=True)
            subprocess.run([sys.executable, "-m", "venv", str(env)], check=True)
            pip = [str(env / "bin" / "python"), "-m", "pip", "install", "--quiet"]
            # torch first, the CPU wheel (pip's find-links, as `make setup` installs it):
            # resolved by the tools' requirements, pip would fetch a CUDA build.
            subprocess.run([*pip, SIDE_PACKAGES[0]], check=True)
            subprocess.run([*pip, *SIDE_PACKAGES[1:]], check=True)
            (env / ".complete").touch()
    return env / "bin" / "python"


def run_tool(script: str, spec: dict, timeout_s: float = 1800) -> None:
    """tests/quant_tools/`script` in the side env, given `spec` as a JSON file's path."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           # GPTQModel sizes its CPU pools from the core count and refuses fewer than 2 workers
           "GPTQMODEL_CPU_WORKERS": "2", "TOKENIZERS_PARALLELISM": "false",
           "TORCH_COMPILE_DISABLE": "1"}  # GPTQModel's torch kernel would compile its dequantizer (inductor)
    with tempfile.TemporaryDirectory() as work:
        spec_path = Path(work) / "spec.json"
        spec_path.write_text(json.dumps(spec))
        done = subprocess.run([str(side_python()), str(TOOLS / script), str(spec_path)], env=env, cwd=work,
                              capture_output=True, text=True, timeout=timeout_s)
    if done.returncode:
        raise RuntimeError(f"{script} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}")


@contextlib.contextmanager
def _locked(path: Path):
    with open(f"{path}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _cache_key(kind: str, base: Path, recipe: dict) -> str:
    """Changes with the base's weights, the calibration, the sizes, the tools and the makers' code."""
    digest = hashlib.sha256(f"{kind} {SIDE_ENV} {json.dumps(recipe)}".encode())
    for path in [*sorted(base.glob("*.safetensors")), TOOLS / MAKERS[kind]]:
        with open(path, "rb") as f:
            digest.update(hashlib.file_digest(f, "sha256").digest())
    return digest.hexdigest()[:16]


_TOKENIZER_FILES = ("tokenizer", "special_tokens_map", "added_tokens", "vocab", "merges", "chat_template",
                    "generation_config")


def _copy_tokenizer(source: Path, out: Path) -> None:
    """The tokenizer's files (and the generation config) of `source` that `out` lacks."""
    for path in source.iterdir():
        if path.is_file() and path.name.startswith(_TOKENIZER_FILES) and not (out / path.name).exists():
            shutil.copy2(path, out / path.name)


# -- Making them ---------------------------------------------------------------------------

def _quantize(outs: dict[str, Path], base: Path, recipe: dict) -> None:
    """Write each kind's checkpoint of `base` into its folder in `outs`."""
    for script in ("llmcompressor_quantize.py", "gptqmodel_quantize.py"):
        if jobs := [{"kind": kind, "out": str(out)} for kind, out in outs.items() if MAKERS[kind] == script]:
            run_tool(script, {"base": str(base), **recipe, "jobs": jobs})
    for kind, out in outs.items():
        if kind in EXPORTED_KINDS:
            export(kind, base, out, list(_linear_shapes(base)), recipe["group_size"], recipe["block"])


def _sizes(base: Path) -> dict[str, int]:
    """Int groups and FP8 blocks: 32 on a tiny model (hidden 64); else 128, halved until it
    divides every input size (groups) or every size (blocks). The tools refuse int groups that do
    not divide, and transformers and compressed-tensors cannot dequantize partial FP8 blocks."""
    shapes = _linear_shapes(base).values()
    in_features = {shape[1] for shape in shapes}
    if max(in_features) <= 256:
        return {"group_size": 32, "block": 32}
    sizes = in_features | {shape[0] for shape in shapes}
    return {"group_size": next(g for g in (128, 64, 32) if all(k % g == 0 for k in in_features)),
            "block": next(b for b in (128, 64, 32) if all(k % b == 0 for k in sizes))}


def _linear_shapes(base: Path) -> dict[str, list[int]]:
    """The weights the tools quantize: every `*_proj` linear (not the embeddings, the LM head or
    a MoE router), name -> [out, in]."""
    from safetensors import safe_open
    shapes = {}
    for path in sorted(base.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            shapes.update({name: f.get_slice(name).get_shape() for name in f.keys()
                           if name.endswith("_proj.weight")})
    return shapes


def calibration_ids(base: Path) -> list[list[int]]:
    """CALIBRATION_TEXT in base's tokens (wrapped into its vocabulary: the tiny models have 512
    entries and SmolLM2's tokenizer), as samples of SAMPLE_TOKENS."""
    from transformers import AutoTokenizer
    vocab_size = json.loads((base / "config.json").read_text())["vocab_size"]
    ids = [i % vocab_size for i in AutoTokenizer.from_pretrained(str(base))(CALIBRATION_TEXT)["input_ids"]]
    return [ids[i:i + SAMPLE_TOKENS] for i in range(0, len(ids) - SAMPLE_TOKENS + 1, SAMPLE_TOKENS)]


# -- Reading them back: each format's published dequantization ----------------------------

def quant_method(kind: str) -> str:
    """The `quant_method` of `kind`'s config.json."""
    if kind.startswith("ct-"):
        return "compressed-tensors"
    return {"gptq-actorder": "gptq", "fp8-block": "fp8"}.get(kind, kind)


_MARKERS = {"compressed-tensors": "weight_scale", "gptq": "qweight", "awq": "qweight", "fp8": "weight_scale_inv"}


def dequantized_reference(kind: str, folder: Path) -> dict[str, torch.Tensor]:
    """Each quantized linear's effective weight, float32 [out, in], under the float model's name
    ("model.layers.0.self_attn.q_proj.weight"), from the checkpoint's tensors by the format's
    definition: integers less zero points times 16-bit scales, each product exact in float32."""
    from safetensors.torch import load_file
    config = json.loads((folder / "config.json").read_text())["quantization_config"]
    method = config["quant_method"]
    if method != quant_method(kind):
        raise ValueError(f"{folder} holds quant_method {method!r}, not a {kind!r} checkpoint")
    tensors = {}
    for path in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    read = {"compressed-tensors": _ct_weight, "gptq": _gptq_weight, "awq": _awq_weight, "fp8": _fp8_weight}[method]
    marker = "." + _MARKERS[method]
    return {f"{name.removesuffix(marker)}.weight": read(tensors, name.removesuffix(marker), config)
            for name in sorted(tensors) if name.endswith(marker)}


def reference_folder(kind: str, folder: Path) -> Path:
    """A float32 HF folder of the checkpoint's effective weights (the references, and its other
    tensors widened), beside it in the cache: the model HF transformers runs as the exact
    reference of a quantized run."""
    from safetensors.torch import load_file, save_file
    out = Path(f"{folder}-float32")
    with _locked(out):
        if not (out / "config.json").is_file():
            staging = Path(f"{out}.staging")
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir()
            weights = dequantized_reference(kind, folder)
            quantized = {name.removesuffix(".weight") for name in weights}
            for path in sorted(folder.glob("*.safetensors")):
                weights.update({name: t.float() for name, t in load_file(str(path)).items()
                                if name.rpartition(".")[0] not in quantized})
            save_file(weights, str(staging / "model.safetensors"), metadata={"format": "pt"})
            config = json.loads((folder / "config.json").read_text())
            config.pop("quantization_config")
            config["dtype"] = "float32"
            (staging / "config.json").write_text(json.dumps(config, indent=2))
            _copy_tokenizer(folder, staging)
            staging.rename(out)
    return out


def _ct_weight(t: dict, prefix: str, config: dict) -> torch.Tensor:
    """compressed-tensors: pack-quantized holds signed q + 2^(bits-1) in int32s along the input
    (weight_packed [out, in * bits / 32], value j of a word at bits j), zero points likewise along
    the output (weight_zero_point [out * bits / 32, groups]); int- and float-quantized hold q as
    int8 / float8_e4m3fn `weight`. w = (q - zero) * scale, the scale per the weights' strategy."""
    (group,) = config["config_groups"].values()  # these tools write one group (targets: Linear)
    args = group["weights"]
    if f"{prefix}.weight_packed" in t:
        n, k = t[f"{prefix}.weight_shape"].tolist()
        bits, offset = args["num_bits"], 1 << (args["num_bits"] - 1)
        q = _unpack(t[f"{prefix}.weight_packed"], bits, dim=1)[:, :k] - offset
        packed_zero = t.get(f"{prefix}.weight_zero_point")
        zero = None if packed_zero is None else _unpack(packed_zero, bits, dim=0)[:n] - offset
    else:
        q, zero = t[f"{prefix}.weight"].float(), t.get(f"{prefix}.weight_zero_point")
        n, k = q.shape
    rows, columns = _scale_index(args, n, k, t.get(f"{prefix}.weight_g_idx"))
    scale = torch.atleast_2d(t[f"{prefix}.weight_scale"].float())
    shifted = q.float() if zero is None else q.float() - zero.float()[rows][:, columns]
    return shifted * scale[rows][:, columns]


def _scale_index(args: dict, n: int, k: int, g_idx: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Which scale row each output and which scale column each input uses. g_idx (act-order):
    input k's group is g_idx[k], groups then no longer being runs of group_size inputs."""
    all_n, all_k = torch.arange(n), torch.arange(k)
    zeros_n, zeros_k = all_n * 0, all_k * 0
    strategy = args["strategy"]
    if strategy == "tensor":
        return zeros_n, zeros_k
    if strategy == "channel":
        return all_n, zeros_k
    if strategy == "block":
        block_n, block_k = args["block_structure"]
        return all_n // block_n, all_k // block_k
    if strategy == "group":
        return all_n, all_k // args["group_size"] if g_idx is None else g_idx.long()
    raise ValueError(f"weight strategy {strategy!r}")


def _gptq_weight(t: dict, prefix: str, config: dict) -> torch.Tensor:
    """GPTQ (AutoGPTQ / GPTQModel): qweight int32 [in * bits / 32, out] packed along the input,
    qzeros int32 [groups, out * bits / 32] along the output, scales fp16 [groups, out], g_idx [in];
    checkpoint_format "gptq" (v1) stores each zero point less one, "gptq_v2" as it is.
    w[o, i] = scales[g_idx[i], o] * (q[i, o] - zero[g_idx[i], o])."""
    bits = config["bits"]
    q = _unpack(t[f"{prefix}.qweight"], bits, dim=0)
    zero = _unpack(t[f"{prefix}.qzeros"], bits, dim=1)[:, :q.shape[1]]
    zero = zero + (config.get("checkpoint_format", "gptq") == "gptq")
    g_idx = t.get(f"{prefix}.g_idx")
    groups = torch.arange(q.shape[0]) // config["group_size"] if g_idx is None else g_idx.long()
    return ((q - zero[groups]).float() * t[f"{prefix}.scales"].float()[groups]).t().contiguous()


def _awq_weight(t: dict, prefix: str, config: dict) -> torch.Tensor:
    """AWQ GEMM: qweight int32 [in, out / 8] and qzeros int32 [groups, out / 8], nibble i of a
    word holding output 8c + AWQ_ORDER[i]; scales fp16 [groups, out]; groups are runs of
    group_size inputs. w[o, i] = scales[i // g, o] * (q[i, o] - zero[i // g, o])."""
    undo = torch.tensor(AWQ_ORDER).argsort()  # (0, 4, 1, 5, 2, 6, 3, 7): AWQ_REVERSE_ORDER

    def unpack(words):
        values = _unpack(words, 4, dim=1)
        return values.view(values.shape[0], -1, 8)[..., undo].flatten(1)
    q, zero = unpack(t[f"{prefix}.qweight"]), unpack(t[f"{prefix}.qzeros"])
    groups = torch.arange(q.shape[0]) // config["group_size"]
    return ((q - zero[groups]).float() * t[f"{prefix}.scales"].float()[groups]).t().contiguous()


def _fp8_weight(t: dict, prefix: str, config: dict) -> torch.Tensor:
    """Block FP8 (DeepSeek-V3): w = weight (e4m3) * weight_scale_inv[o // block_o, i // block_i]."""
    weight = t[f"{prefix}.weight"].float()
    block_n, block_k = config["weight_block_size"]
    rows, columns = torch.arange(weight.shape[0]) // block_n, torch.arange(weight.shape[1]) // block_k
    return weight * t[f"{prefix}.weight_scale_inv"].float()[rows][:, columns]


def _unpack(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words holding 32 / bits unsigned values along `dim`, value j of word w at bits
    bits * j being element (32 / bits) * w + j -> int64 values."""
    per, mask = 32 // bits, (1 << bits) - 1
    w = (words.to(torch.int64) & 0xFFFFFFFF).movedim(dim, -1)
    values = torch.stack([(w >> (bits * j)) & mask for j in range(per)], dim=-1).flatten(-2)
    return values.movedim(-1, dim)
