"""The attention backends' interface: a step's metadata and the backend protocol.

The model calls `AttentionBackend.forward` and nothing else, so a backend (the
torch reference here, C++ kernels on CPU, CuPy kernels on GPU) plugs in without
touching models.

A step's tokens are laid out flat, decodes first, then prefill chunks:

    tokens:  [d0 d1 d2 | p0 p0 p0 p0 | p1 p1 ]     T = num_decode + sum(chunk lengths)
              decodes    prefill #0    prefill #1
    slot_mapping[t] = block_table[pos // block_size] * block_size + pos % block_size

A block table row lists the physical blocks of one sequence, in order:

    block_tables[b] = [ 7, 2, 9, 0, 0 ]   (padded with 0; context_lens masks the tail)
                        ^ tokens 0..15, then 16..31 in block 2, ...

When every layer has a sliding window, entries wholly before a row's window may be
FREED_BLOCK (-1, released by the block manager): windowed attention never reads them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch


@dataclass
class PrefillChunk:
    """One sequence's chunk of new tokens, with the context it attends to."""

    token_start: int  # first row of this chunk in the flat token batch
    num_tokens: int  # new tokens in this chunk
    context_len: int  # cached + new tokens: what the last new token attends to
    block_table: torch.Tensor  # [ceil(context_len / block_size)] int64 (the runner's: a view of
    # AttentionMetadata.prefill_block_tables' row)
    # Positions [a, b) whose tokens also see each other's later keys (a Gemma 3 image's tokens;
    # the chunk holds the rest of each span: b <= context_len). Empty: causal.
    bidirectional: tuple[tuple[int, int], ...] = ()


@dataclass
class AttentionMetadata:
    """Everything a backend needs for one step; built once per step by the runner."""

    slot_mapping: torch.Tensor  # [T] int64: where each new token's K/V goes
    num_decode_tokens: int  # the first rows are single-token decodes
    decode_block_tables: torch.Tensor | None  # [num_decode, max_blocks] int64
    decode_context_lens: torch.Tensor | None  # [num_decode] int64
    prefills: list[PrefillChunk] = field(default_factory=list)
    backend_state: dict = field(default_factory=dict)  # a backend's per-step precomputation
    # [num_chunks, max_blocks] int64, 0-padded: the chunks' tables in one tensor (one copy to
    # the device) for backends that read them all at once; None where the chunks were built
    # one by one (see padded_prefill_tables).
    prefill_block_tables: torch.Tensor | None = None

    def padded_prefill_tables(self) -> torch.Tensor:
        """The chunks' tables as [num_chunks, max_blocks], 0-padded: the runner's tensor, or
        the chunks' own tables padded (metadata built by hand)."""
        if self.prefill_block_tables is None:
            self.prefill_block_tables = torch.nn.utils.rnn.pad_sequence(
                [c.block_table for c in self.prefills], batch_first=True)
        return self.prefill_block_tables


class AttentionBackend(Protocol):
    """The interface every attention implementation provides."""

    name: str

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """Shape of one layer's K+V cache tensor; the layout is the backend's choice."""
        ...

    def prepare(self, meta: AttentionMetadata) -> None:
        """Per-step precomputation shared by all layers (masks, index tensors)."""
        ...

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, sliding_window: int | None = None,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Write k/v ([T, Hkv, D]) into the cache, then attend q ([T, Hq, D]) -> [T, Hq, D].
        `sliding_window` W (None: full attention): a query at position i sees keys j with
        i - W < j <= i, and table entries for blocks wholly before i - W + 1 are never read."""
        ...

    def copy_blocks(self, kv_caches: list[torch.Tensor], pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks src -> dst in every layer (copy-on-write after a fork)."""
        ...
