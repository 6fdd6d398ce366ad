"""HF transformers' model of a checkpoint: the baseline the benchmarks and the tests compare with.

transformers converts a GGUF on every load, slowly (15 s for the bundled SmolLM2, 35 s for Gemma 3
270M on the 2-core VM: it parses the metadata, the vocabulary included, twice), into a plain
float32 model. `hf_folder` keeps that conversion, HF's own, as an HF folder (safetensors, config,
tokenizer) in the cache, keyed by the file and the transformers version; processes that want it
while another converts wait for that one.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import shutil
from pathlib import Path


def hf_folder(path: Path) -> Path:
    """An HF folder of `path`: the folder itself, or a GGUF's float32 export."""
    import transformers

    from common.paths import cache_dir
    from engine.models.loader import is_gguf
    if not is_gguf(path):
        return path
    stat = path.stat()
    folder = cache_dir() / "hf-export" / f"{path.stem}-{stat.st_size}-{stat.st_mtime_ns}-tf{transformers.__version__}"
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{folder}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (folder / "config.json").is_file():
            _export(path, folder)
    return folder


def load_hf_float32(path: Path):
    """HF's model of `path` (a GGUF: as transformers' GGUF loader reads it) in float32, eval mode."""
    import torch
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(str(hf_folder(path)), dtype=torch.float32).eval()


def _export(gguf: Path, folder: Path) -> None:
    with _quicker_gguf_py():
        _convert(gguf, folder)


@contextlib.contextmanager
def _quicker_gguf_py():
    """gguf-py as transformers drives it, minus most of its time and none of its values: each
    value it reads (each of the vocabulary's tokens and merges, three times over) is a slice of
    an np.memmap, whose slices run Python (memmap.__array_finalize__), and transformers builds
    gguf's TensorNameMap anew for every tensor. Here the reader's mapping is viewed as a plain
    ndarray (slices in C, the same bytes; its base keeps the file mapped) and the name map is
    built once per (architecture, layers): SmolLM2's conversion took 29 s, most of it there."""
    import gguf
    import numpy as np

    def keep_plain(reader, memmap) -> None:
        reader.__dict__["data"] = memmap.view(np.ndarray)

    name_map = gguf.get_tensor_name_map
    gguf.GGUFReader.data = property(lambda reader: reader.__dict__["data"], keep_plain)
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(name_map)
    try:
        yield
    finally:
        del gguf.GGUFReader.data  # readers made meanwhile keep their plain view in __dict__
        gguf.get_tensor_name_map = name_map


def _convert(gguf: Path, folder: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    staging = Path(f"{folder}.staging")
    shutil.rmtree(staging, ignore_errors=True)  # left by a process killed mid-export
    staging.mkdir()
    # save_pretrained refuses GGUF-loaded models: write the tensors and config ourselves.
    state = {k: v.contiguous() for k, v in model.state_dict().items()
             if not (model.config.tie_word_embeddings and k == "lm_head.weight")}
    save_file(state, str(staging / "model.safetensors"))
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(str(staging))
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    (staging / "config.json").write_text(json.dumps(config, indent=2))
    staging.rename(folder)
