"""The model files `pagedserve bench formats` compares, all from the same float weights (the
bundled SmolLM2's, or --model's), made once and cached under ~/.cache/pagedserve:

  gguf_requantized(Q4_0 | Q8_0)  the GGUF's layers requantized by gguf-py (llama.cpp's own
                                 reference quantizers, in numpy), the embedding kept in F16:
                                 a 16-bit head like the HF checkpoints', so that the body's
                                 format is all that differs
  hf_checkpoint(KIND)            the float HF export quantized by the tools users run
                                 (tests/quant_checkpoints.py: llm-compressor and GPTQModel in a
                                 side environment, exporters for AWQ's GEMM layout and block FP8)
"""

from __future__ import annotations

import fcntl
import sys
from pathlib import Path
from types import SimpleNamespace

# Transformer-block weights by GGUF name (blk.N.<part>.weight); norms and biases stay as stored.
BODY = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
HEAD = ("token_embd", "output")
FILE_TYPES = {"Q4_0": 2, "Q8_0": 7}  # llama_ftype: MOSTLY_Q4_0, MOSTLY_Q8_0


def gguf_requantized(source: Path, body: str, head: str = "F16") -> Path:
    """`source` with its transformer layers in `body` (Q4_0 | Q8_0) and its embedding / output
    in `head`, every other key and tensor as stored; cached by source size and time."""
    from common.paths import cache_dir
    stat = source.stat()
    target = cache_dir() / "bench-gguf" / f"{source.stem}-{stat.st_size}-{stat.st_mtime_ns}-{body}-{head}.gguf"
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{target}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not target.is_file():
            staging = target.with_suffix(".staging")
            _requantize(source, staging, body, head)
            staging.rename(target)
    return target


def _requantize(source: Path, target: Path, body: str, head: str) -> None:
    import gguf
    from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata
    from tqdm import tqdm
    reader = gguf.GGUFReader(str(source))
    tensors = []
    for tensor in tqdm(reader.tensors, desc=f"requantizing to {body}", unit="tensor"):
        part = tensor.name.split(".")[-2]
        kind = body if tensor.name.startswith("blk.") and part in BODY else head if part in HEAD else None
        if kind is None:
            tensors.append(tensor)
            continue
        qtype = gguf.GGMLQuantizationType[kind]
        data = gguf.quants.quantize(gguf.quants.dequantize(tensor.data, tensor.tensor_type), qtype)
        tensors.append(SimpleNamespace(name=tensor.name, data=data, tensor_type=qtype, n_bytes=data.nbytes))
    writer = gguf.GGUFWriter(target, reader.fields["general.architecture"].contents())
    file_type = {gguf.Keys.General.FILE_TYPE: MetadataDetails(gguf.GGUFValueType.UINT32, FILE_TYPES[body])}
    # gguf_new_metadata.py's own copy (every key as stored), over the new tensors.
    copy_with_new_metadata(SimpleNamespace(fields=reader.fields, tensors=tensors, endianess=reader.endianess),
                           writer, file_type, [])


def hf_checkpoint(kind: str, float_folder: Path) -> Path:
    """`float_folder` quantized as `kind` (tests/quant_checkpoints.KINDS) by its real tool."""
    tests = Path(__file__).resolve().parent.parent / "tests"
    if str(tests) not in sys.path:
        sys.path.insert(0, str(tests))  # the test suite's makers: one place for each tool's recipe
    from quant_checkpoints import make_checkpoint
    return make_checkpoint(kind, float_folder)
