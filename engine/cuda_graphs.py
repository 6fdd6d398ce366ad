"""CUDA graphs for pure-decode steps: the model forward, the LM head and each row's argmax,
captured once per batch-size bucket, replayed with new inputs copied into static buffers.

A decode step then costs a handful of small copies and one replay instead of a few
launches per layer from Python; a step whose rows all decode greedily reads its tokens
from the graph's argmax, and other rows sample from the graph's logits. (Graphs run on one
rank with no adapters: EngineConfig turns them off with tensor parallelism or LoRA, so
the LM head needs no collective.) Static buffers, sized for the largest bucket:

    input_ids, positions  [max_bs] int64
    slot_mapping          [max_bs] int32     -1 on padding rows: nothing is written
    block_tables          [max_bs, W] int32  W = ceil(max_model_len / block_size)
    context_lens          [max_bs] int32     0 on padding rows: attention writes zeros
    logits, greedy        [max_bs, vocab], [max_bs] int64: the outputs; every bucket writes
                          its rows there (the largest bucket's own outputs)

A batch of n runs in the smallest bucket >= n; rows n.. are padding. Each bucket's
attention plan is fixed at capture from the table width (max_model_len), so small
buckets use split-K over max_model_len and partitions past a sequence's end exit early.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import numpy as np
import torch

from engine.attention import AttentionMetadata
from engine.models.llama import ForwardContext


class GraphOutputs(NamedTuple):
    """A replay's outputs: views of the graph's static buffers, valid until the next replay."""

    hidden: torch.Tensor  # [n, H] final hidden states
    logits: torch.Tensor  # [n, vocab_size]
    greedy: torch.Tensor  # [n] int64: each row's argmax over the tokenizer's tokens (Sampler.argmax_tensor)

    def first(self, n: int) -> GraphOutputs:
        return GraphOutputs(self.hidden[:n], self.logits[:n], self.greedy[:n])


def bucket_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, 16, then steps of 16 up to max_num_seqs (which is always a bucket)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs]
    sizes += range(16, max_num_seqs, 16)
    return sorted(set(sizes) | {max_num_seqs})


class DecodeGraphs:
    """Captured decode forwards, one per bucket; `run` replays the right one."""

    def __init__(self, model, argmax: Callable[[torch.Tensor], torch.Tensor], backend, kv_caches: list[torch.Tensor],
                 block_size: int, max_num_seqs: int, max_model_len: int, device: torch.device) -> None:
        """`argmax`: the sampler's greedy choice over logits (Sampler.argmax_tensor), captured too."""
        self.model, self.argmax, self.backend, self.kv_caches = model, argmax, backend, kv_caches
        self.block_size = block_size
        self.buckets = bucket_sizes(max_num_seqs)
        width = -(-max_model_len // block_size)
        n = self.buckets[-1]
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros((n, width), dtype=torch.int32, device=device)
        self.context_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, GraphOutputs]] = {}
        pin = device.type == "cuda"
        self._staging = [(torch.zeros(4 * n, dtype=torch.long, pin_memory=pin),
                          torch.zeros(n * width, dtype=torch.int32, pin_memory=pin)) for _ in range(2)]
        self._copied: list[torch.cuda.Event | None] = [None, None]  # after each set's latest copies
        self._turn = 0
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
        logits = greedy = None  # the largest bucket's outputs: every bucket's static buffers
        for batch in reversed(self.buckets):
            ctx = ForwardContext(self.backend, self._meta(batch), self.kv_caches)
            # Warm-up outside capture: compiles kernels and creates library handles.
            self._forward(batch, ctx)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden, batch_logits, batch_greedy = self._forward(batch, ctx)
                if logits is None:  # the largest, captured first: its outputs are the buffers
                    logits, greedy = batch_logits, batch_greedy
                else:  # the others write into them, so that one bucket's logits are kept, not all
                    logits[:batch].copy_(batch_logits)  # (a [256, 151,936] bf16 buffer is 78 MB)
                    greedy[:batch].copy_(batch_greedy)
            pool = graph.pool()
            self.graphs[batch] = (graph, GraphOutputs(hidden, logits[:batch], greedy[:batch]))
        torch.cuda.synchronize()

    def _forward(self, batch: int, ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(hidden, logits, each row's argmax) of the first `batch` rows of the static inputs."""
        hidden = self.model(self.input_ids[:batch], self.positions[:batch], ctx)
        logits = self.model.compute_logits(hidden)
        return hidden, logits, self.argmax(logits)

    def run(self, input_ids: np.ndarray, positions: np.ndarray, slots: np.ndarray,
            block_tables: np.ndarray, device_input_ids: torch.Tensor | None = None) -> GraphOutputs:
        """Replay for these n decode rows (int64 arrays; n <= max_batch, `block_tables`
        [n, w] with w <= the captured width); returns the first n rows of the graph's
        outputs, valid until the next replay. Columns past w keep older entries: no row's
        context reaches them, so attention never reads them. `device_input_ids` ([n], on the
        device) replace `input_ids`: the tokens of a step still running (async scheduling).

        The inputs go up through pinned staging buffers with asynchronous copies, so the host
        never waits here for a step already on the device. There are two sets, used in turn;
        before a set is written again, the event recorded after its last copies must have
        fired (with async scheduling it has: the caller waited for that step in between)."""
        n, width = block_tables.shape
        batch = next(b for b in self.buckets if b >= n)
        turn = self._turn
        self._turn ^= 1
        ints, tables = self._staging[turn]
        if self._copied[turn] is not None:
            self._copied[turn].synchronize()
        ints, tables = ints[:4 * batch].view(4, batch), tables[:batch * width].view(batch, width)  # contiguous
        ints_np, tables_np = ints.numpy(), tables.numpy()
        ints_np[2, n:] = -1  # padding rows: no slot, context 0
        ints_np[(0, 1, 3), n:] = 0
        ints_np[0, :n], ints_np[1, :n], ints_np[2, :n], ints_np[3, :n] = input_ids, positions, slots, positions + 1
        tables_np[:n] = block_tables
        tables_np[n:] = 0
        self.input_ids[:batch].copy_(ints[0], non_blocking=True)
        self.positions[:batch].copy_(ints[1], non_blocking=True)
        self.slot_mapping[:batch].copy_(ints[2], non_blocking=True)
        self.context_lens[:batch].copy_(ints[3], non_blocking=True)
        self.block_tables[:batch, :width].copy_(tables, non_blocking=True)
        self._copied[turn] = torch.cuda.Event()
        self._copied[turn].record()
        if device_input_ids is not None:
            self.input_ids[:n].copy_(device_input_ids)
        graph, outputs = self.graphs[batch]
        graph.replay()
        return outputs.first(n)
