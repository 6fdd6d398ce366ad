"""Random paged-attention inputs for the kernel tests, built to expose indexing bugs.

- Block tables are random permutations: no sequence's blocks are contiguous or in order.
- Every cache position a sequence must not read is NaN: the tail of its last block, and
  a poison block that pads every table row. A kernel that reads past a context (and
  lets a zero probability multiply it) returns NaN.
- Outputs are NaN before each launch, so an element left unwritten fails too.
"""

from __future__ import annotations

import torch

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
FP8_IDS = ["fp32", "fp16", "bf16"]  # DTYPES' ids in the fp8-cache tests (not "dtypeN": see gpu_session.sh)
# ||out - ref|| / ||ref|| against a float32 reference (see the device METHOD notes).
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
GQA = ((4, 4), (8, 2), (16, 2), (6, 2), (12, 1))  # (Hq, Hkv): group 1, 4, 8, 3, 12


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm().clamp_min(1e-12)).item()


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    bad = (~torch.isfinite(out)).sum().item()
    assert bad == 0, f"{what}: {bad} of {out.numel()} elements not finite (unwritten, or read poison)"
    error = relative_error(out, ref)
    assert error <= TOLERANCE[dtype], f"{what}: relative error {error:.2e} > {TOLERANCE[dtype]:.0e}"


class PagedContexts:
    """A KV cache holding `context_lens` sequences in shuffled blocks, poison elsewhere; in
    `kv_dtype` (float8_e4m3fn: an fp8 cache, NaN poison included) or else `dtype`."""

    def __init__(self, context_lens: list[int], num_kv_heads: int, head_size: int, block_size: int,
                 dtype: torch.dtype, seed: int = 0, spare_blocks: int = 5, kv_dtype: torch.dtype | None = None
                 ) -> None:
        self.gen = torch.Generator("cuda").manual_seed(seed)
        self.block_size = block_size
        needed = [-(-n // block_size) for n in context_lens]
        num_blocks = sum(needed) + spare_blocks + 1
        self.poison_block = num_blocks - 1
        self.kv_cache = torch.randn((2, num_kv_heads, num_blocks, block_size, head_size), device="cuda",
                                    generator=self.gen).to(dtype)
        self.kv_cache[:, :, self.poison_block] = float("nan")
        perm = torch.randperm(num_blocks - 1, device="cuda", generator=self.gen).tolist()
        width = max(needed + [1]) + 2  # rows padded past their last block, as the runner pads
        self.tables: list[list[int]] = []
        for n, count in zip(context_lens, needed):
            table, perm = perm[:count], perm[count:]
            if n % block_size:  # the unused tail of the last block
                self.kv_cache[:, :, table[-1], n % block_size:] = float("nan")
            self.tables.append(table)
        rows = [t + [self.poison_block] * (width - len(t)) for t in self.tables]
        self.block_tables = torch.tensor(rows, dtype=torch.int32, device="cuda")
        self.context_lens = torch.tensor(context_lens, dtype=torch.int32, device="cuda")
        if kv_dtype is not None:  # randn values fit e4m3's range; NaN stays NaN
            self.kv_cache = self.kv_cache.to(kv_dtype)

    def randn(self, *shape: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.randn(shape, device="cuda", generator=self.gen).to(dtype)


def strided_qkv(num_tokens: int, num_q_heads: int, num_kv_heads: int, head_size: int, dtype: torch.dtype,
                gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v as the model makes them: views into one fused [T, Hq + 2 Hkv, D] tensor."""
    fused = torch.randn((num_tokens, num_q_heads + 2 * num_kv_heads, head_size), device="cuda",
                        generator=gen).to(dtype)
    return tuple(fused.split([num_q_heads, num_kv_heads, num_kv_heads], dim=1))


def mixed_step(block_size: int, num_blocks: int, gen: torch.Generator, device: str,
               chunks: tuple[tuple[int, int], ...] = ((20, 50), (9, 9))):
    """One engine step's AttentionMetadata, as the runner builds it (int64, on `device`):
    three decodes (contexts 1, 40, 700) then prefill chunks of (new tokens, context) each,
    by default 20 new tokens over 30 cached and 9 fresh, over randomly permuted blocks."""
    from engine.attention import AttentionMetadata, PrefillChunk
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    decode_lens = [1, 40, 700]
    tables = []
    for n in decode_lens + [c for _, c in chunks]:
        count = -(-n // block_size)
        tables.append(perm[:count])
        perm = perm[count:]
    slots, prefills, row = [], [], len(decode_lens)
    for n, table in zip(decode_lens, tables):
        slots.append(table[(n - 1) // block_size] * block_size + (n - 1) % block_size)
    # The chunks' tables in one padded tensor, each chunk's a view of its row (as the runner has them).
    chunk_tables = tables[len(decode_lens):]
    padded = torch.tensor([t + [0] * (max(map(len, chunk_tables)) - len(t)) for t in chunk_tables], device=device)
    for i, ((new, context), table) in enumerate(zip(chunks, chunk_tables)):
        slots += [table[p // block_size] * block_size + p % block_size for p in range(context - new, context)]
        prefills.append(PrefillChunk(row, new, context, padded[i, :len(table)]))
        row += new
    width = max(len(t) for t in tables[:3])
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, device=device), num_decode_tokens=3,
        decode_block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables[:3]], device=device),
        decode_context_lens=torch.tensor(decode_lens, device=device), prefills=prefills,
        backend_state={"block_size": block_size}, prefill_block_tables=padded)


def release_before(ctx: PagedContexts, firsts: list[int]) -> None:
    """Point each sequence's table entries for blocks wholly before position firsts[i] at the
    poison block, as the engine may release a window's old blocks: a kernel that reads them
    returns NaN."""
    for i, first in enumerate(firsts):
        for b in range(max(0, first) // ctx.block_size):
            ctx.tables[i][b] = ctx.poison_block
            ctx.block_tables[i, b] = ctx.poison_block
