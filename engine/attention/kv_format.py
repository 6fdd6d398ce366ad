"""The KV cache's storage formats (--kv-cache-dtype): what one cached row of a head holds.

Every backend keeps one tensor per layer, heads outermost; only the row changes:

    kv_cache: [2, Hkv, num_blocks, block_size, row]
               ^ 0 = K, 1 = V

    auto  row = D values in the model's dtype (bf16 at D=64: 128 bytes)
    int8  row = D + 2 bytes (66 at D=64: 1.94x the blocks in the same memory)
              +-----------------------------+-------------+
              | q[0] q[1] ... q[D-1]  int8  | scale  bf16 |   x[c] ~= q[c] * scale
              +-----------------------------+-------------+
                                             bytes D, D+1 (little-endian)
          one scale per (token, head), K and V each their own: scale = amax(|x|) / 127 in
          float32, rounded UP to bfloat16 (so |x / scale| <= 127 and nothing clips), at least
          MIN_SCALE; q = round-half-to-even(x / scale) in float32, a true division, as the C++
          cache write (cpu_kernels/csrc/paged_attention_int8.cpp) computes it, bit for bit.
    fp8   row = D float8_e4m3fn values, per-tensor scale 1.0 (vLLM's default without
          calibrated scales): stored = x.float().clamp(-448, 448) rounded to e4m3; the CUDA
          kernels (cupy_kernels) write and read the same bits.

Reads dequantize to the query's dtype (int8: q * scale in float32, then rounded to it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

KV_CACHE_DTYPES = ("auto", "int8", "fp8")
INT8_SCALE_BYTES = 2  # a bfloat16 scale after the row's D values
MIN_SCALE = 2.0 ** -32  # an all-zero row's scale (any positive bf16 would do)
FP8_MAX = 448.0  # float8_e4m3fn's largest finite value


@dataclass(frozen=True)
class KvCacheFormat:
    """One layer's cache rows for `name` ("auto", "int8" or "fp8") with a model in `model_dtype`."""

    name: str
    model_dtype: torch.dtype

    def __post_init__(self) -> None:
        if self.name not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype: must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.name!r}")

    @property
    def quantized(self) -> bool:
        return self.name != "auto"

    @property
    def storage_dtype(self) -> torch.dtype:
        """The cache tensor's dtype."""
        return {"auto": self.model_dtype, "int8": torch.int8, "fp8": torch.float8_e4m3fn}[self.name]

    def row_width(self, head_dim: int) -> int:
        """Elements of the storage dtype per (token, head) row."""
        return head_dim + INT8_SCALE_BYTES if self.name == "int8" else head_dim

    def bytes_per_token_head(self, head_dim: int) -> int:
        """Bytes of K (or of V) for one token of one kv head."""
        return self.row_width(head_dim) * torch.empty((), dtype=self.storage_dtype).element_size()

    def quantize_rows(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., D] -> the rows to store [..., row] in the storage dtype."""
        if self.name == "auto":
            return x.to(self.model_dtype)
        if self.name == "fp8":
            return x.float().clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return quantize_int8(x)

    def dequantize(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Stored rows [..., row] -> values [..., D] in `dtype`."""
        if self.name == "int8":
            return dequantize_int8(rows).to(dtype)
        return rows.to(dtype)


def kv_cache_format(name: str, model_dtype: torch.dtype) -> KvCacheFormat:
    return KvCacheFormat(name, model_dtype)


def int8_scales(x: torch.Tensor) -> torch.Tensor:
    """[..., D] -> [..., 1] float32 scales: amax / 127 (at least MIN_SCALE) rounded up to the
    next bfloat16 (add the low 16 bits' carry, then drop them: positive floats only)."""
    amax = x.float().abs().amax(dim=-1, keepdim=True)
    scale = (amax / 127).clamp_min(MIN_SCALE)
    bits = scale.view(torch.int32)
    return ((bits + 0xFFFF) & ~0xFFFF).view(torch.float32)


def quantize_int8(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] -> int8 rows [..., D + 2]: D values, then the scale's bfloat16 bytes."""
    scale = int8_scales(x)
    q = torch.round(x.float() / scale).clamp_(-127, 127).to(torch.int8)
    scale_bytes = scale.to(torch.bfloat16).view(torch.int8)  # exact: the scale is a bf16 value
    return torch.cat([q, scale_bytes], dim=-1)


def int8_row_scales(rows: torch.Tensor) -> torch.Tensor:
    """int8 rows [..., D + 2] -> their float32 scales [..., 1]."""
    tail = rows[..., -INT8_SCALE_BYTES:].contiguous()
    return tail.view(torch.bfloat16).float()


def dequantize_int8(rows: torch.Tensor) -> torch.Tensor:
    """int8 rows [..., D + 2] -> float32 values [..., D]: q * scale."""
    return rows[..., :-INT8_SCALE_BYTES].float() * int8_row_scales(rows)
