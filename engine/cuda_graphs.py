"""CUDA graphs for pure-decode steps: the model forward (not sampling) captured once per
batch-size bucket, replayed with new inputs copied into static buffers.

A decode step then costs a handful of small copies and one replay instead of a few
launches per layer from Python. Static buffers, sized for the largest bucket:

    input_ids, positions  [max_bs] int64
    slot_mapping          [max_bs] int32     -1 on padding rows: nothing is written
    block_tables          [max_bs, W] int32  W = ceil(max_model_len / block_size)
    context_lens          [max_bs] int32     0 on padding rows: attention writes zeros

A batch of n runs in the smallest bucket >= n; rows n.. are padding. Each bucket's
attention plan is fixed at capture from the table width (max_model_len), so small
buckets use split-K over max_model_len and partitions past a sequence's end exit early.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.attention import AttentionMetadata
from engine.models.llama import ForwardContext


def bucket_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, 16, then steps of 16 up to max_num_seqs (which is always a bucket)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs]
    sizes += range(16, max_num_seqs, 16)
    return sorted(set(sizes) | {max_num_seqs})


class DecodeGraphs:
    """Captured decode forwards, one per bucket; `run` replays the right one."""

    def __init__(self, model, backend, kv_caches: list[torch.Tensor], block_size: int, max_num_seqs: int,
                 max_model_len: int, device: torch.device) -> None:
        self.model, self.backend, self.kv_caches = model, backend, kv_caches
        self.block_size = block_size
        self.buckets = bucket_sizes(max_num_seqs)
        width = -(-max_model_len // block_size)
        n = self.buckets[-1]
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros((n, width), dtype=torch.int32, device=device)
        self.context_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.workspace: torch.Tensor | None = None  # the split-K scratch the graphs captured

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def _meta(self, batch: int) -> AttentionMetadata:
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:batch], num_decode_tokens=batch,
            decode_block_tables=self.block_tables[:batch], decode_context_lens=self.context_lens[:batch],
            backend_state={"block_size": self.block_size})
        self.backend.prepare(meta)  # int32 inputs pass through as the static buffers themselves
        return meta

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first so that the smaller ones reuse its memory."""
        for batch in reversed(self.buckets):  # prepare all plans first: the largest workspace
            self._meta(batch)
        self.workspace = self.backend.workspace
        pool = None
        for batch in reversed(self.buckets):
            ctx = ForwardContext(self.backend, self._meta(batch), self.kv_caches)
            # Warm-up outside capture: compiles kernels and creates library handles.
            self.model(self.input_ids[:batch], self.positions[:batch], ctx)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden = self.model(self.input_ids[:batch], self.positions[:batch], ctx)
            pool = graph.pool()
            self.graphs[batch] = (graph, hidden)
        torch.cuda.synchronize()

    def run(self, input_ids: np.ndarray, positions: np.ndarray, slots: np.ndarray,
            block_tables: np.ndarray) -> torch.Tensor:
        """Replay for these n decode rows (int64 arrays; n <= max_batch, `block_tables`
        [n, w] with w <= the captured width); returns hidden [n, H], a view of the graph's
        output, valid until the next replay. Columns past w keep older entries: no row's
        context reaches them, so attention never reads them."""
        n, width = block_tables.shape
        batch = next(b for b in self.buckets if b >= n)
        ints = np.zeros((4, batch), dtype=np.int64)
        ints[2, n:] = -1  # padding rows: no slot, context 0
        ints[0, :n], ints[1, :n], ints[2, :n], ints[3, :n] = input_ids, positions, slots, positions + 1
        tables = np.zeros((batch, width), dtype=np.int32)
        tables[:n] = block_tables
        ints = torch.from_numpy(ints).to(self.input_ids.device)
        self.input_ids[:batch].copy_(ints[0])
        self.positions[:batch].copy_(ints[1])
        self.slot_mapping[:batch].copy_(ints[2])
        self.context_lens[:batch].copy_(ints[3])
        self.block_tables[:batch, :width].copy_(torch.from_numpy(tables).to(self.input_ids.device))
        graph, hidden = self.graphs[batch]
        graph.replay()
        return hidden[:n]
