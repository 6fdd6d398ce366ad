"""Model folders built from a config with random weights: the engine measured on any machine
with nothing to download (`--random-weights SHAPE`).

Each shape is an HF config (the real model's sizes) plus a tokenizer:
- the big shapes get a word-level tokenizer as large as their vocabulary ("t0 t1 ..."), since
  no real tokenizer of theirs is installed;
- "tiny" gets the bundled SmolLM2 tokenizer (byte-level BPE, the real cost of
  detokenization) over a 1,024-token LM head: its forward costs almost nothing, so a step's
  time is the host's (bench/host_step.py).

Folders are cached under the pagedserve cache dir, one per (shape, dtype). `bench offline` and
`bench serve` take `--random-weights SHAPE` (add_random_weights_arg, use_random_weights).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

SHAPES = {
    # name: (model_type, config kwargs)
    "qwen2.5-0.5b": ("qwen2", dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                   num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                                   max_position_embeddings=32768, tie_word_embeddings=True,
                                   rope_theta=1e6, rms_norm_eps=1e-6)),
    "llama-3.2-1b": ("llama", dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                   num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                                   vocab_size=128256, max_position_embeddings=131072, tie_word_embeddings=True,
                                   rope_theta=5e5, rms_norm_eps=1e-5)),
    "llama-3-8b": ("llama", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                 num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                                 vocab_size=128256, max_position_embeddings=8192, tie_word_embeddings=False,
                                 rope_theta=5e5, rms_norm_eps=1e-5)),
    "tiny": ("llama", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=1024,
                           max_position_embeddings=4096, tie_word_embeddings=True)),
}
BUNDLED_TOKENIZER_SHAPES = {"tiny"}


def add_random_weights_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--random-weights", default=None, choices=list(SHAPES), metavar="SHAPE",
                   help=f"instead of --model: a model of this shape ({', '.join(SHAPES)}) with random weights "
                        "(seed 0), built on first use under $PAGEDSERVE_CACHE_DIR/random-models (default "
                        "~/.cache/pagedserve/random-models), nothing downloaded; its tokenizer is word-level, "
                        "one word per token id (tiny: the bundled SmolLM2's); --dtype auto means bfloat16 "
                        "on CUDA and float32 on any CPU")


def use_random_weights(args: argparse.Namespace, command: str) -> None:
    """With --random-weights SHAPE: point args.model at the shape's folder, built on first use,
    in a concrete args.dtype (the folder is stored in it). SystemExit if --model names one too."""
    shape = getattr(args, "random_weights", None)
    if shape is None:
        return
    if args.model is not None:
        raise SystemExit(f"{command}: error: --random-weights {shape} is the model: drop --model {args.model} "
                         f"(or --random-weights)")
    args.dtype = random_weights_dtype(args.dtype, args.device)
    args.model = str(random_model_dir(shape, args.dtype))


def random_weights_dtype(dtype: str, device: str) -> str:
    """`dtype`, with auto made bfloat16 on CUDA and float32 on any CPU: unlike the engine's auto,
    not bfloat16 on CPUs with bf16 instructions, so CPU runs compare across machines. `device`
    may be auto, the engine's default."""
    if dtype != "auto":
        return dtype
    from engine.config import resolve_device
    return "bfloat16" if resolve_device(device).startswith("cuda") else "float32"


def random_model_dir(shape: str, dtype: str = "bfloat16", root: Path | None = None, device: str = "cpu") -> Path:
    """The folder of `shape`'s random model in `dtype`, built on first use (seconds for the
    small shapes; an 8B takes minutes on a CPU, so build it on `device` where that is a GPU:
    other random values, the same sizes)."""
    if shape not in SHAPES:
        raise ValueError(f"--random-weights: unknown shape {shape!r} (known: {', '.join(SHAPES)})")
    folder = (root or random_models_root()) / f"{shape}-{dtype}"
    if not (folder / "config.json").is_file():
        build_random_model(shape, folder, dtype, device)
    return folder


def random_models_root() -> Path:
    from common.paths import cache_dir
    return cache_dir() / "random-models"


def build_random_model(shape: str, folder: Path, dtype: str = "bfloat16", device: str = "cpu") -> Path:
    """Write `shape`'s config, random weights (seed 0) and tokenizer into `folder`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    model_type, sizes = SHAPES[shape]
    config = AutoConfig.for_model(model_type, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                                  initializer_range=0.02, **sizes)
    start = time.perf_counter()
    torch.manual_seed(0)
    staging = folder.with_name(folder.name + ".partial")  # a killed build leaves no half folder
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.save_pretrained(str(staging), safe_serialization=True)
    del model
    _tokenizer(shape, sizes["vocab_size"]).save_pretrained(str(staging))
    staging.rename(folder)
    print(f"built random-weight {shape} ({dtype}) in {time.perf_counter() - start:.1f} s: {folder}")
    return folder


def _tokenizer(shape: str, vocab_size: int):
    from transformers import PreTrainedTokenizerFast
    if shape in BUNDLED_TOKENIZER_SHAPES:
        from engine.models.loader import load_tokenizer
        from engine.models.source import bundled_model_path
        return load_tokenizer(bundled_model_path())
    from tokenizers import Tokenizer, models, pre_tokenizers
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t3"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="t1", eos_token="t2", pad_token="t0",
                                   unk_token="t3")
