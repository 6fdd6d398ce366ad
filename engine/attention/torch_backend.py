"""Plain-torch paged attention: the reference backend, on CPU and CUDA.

One layer's cache is a single tensor, heads outermost, so that gathering a
sequence's blocks yields a contiguous [Hkv, context, D] view with no transpose:

    kv_cache: [2, Hkv, num_blocks, block_size, row]
               ^ 0 = K, 1 = V    row = D values, or a quantized row (--kv-cache-dtype int8/fp8)

A quantized cache (engine/attention/kv_format.py) is quantized on write, and every read (the
gathered blocks of decode, prefill, windows, sinks) is dequantized to the query's dtype first:
this is the reference the kernels' quantized caches are checked against.

On CPU, shapes are padded to a few buckets (see engine.cpu_tuning): the runner may pass
padding rows after the real tokens (they have no slot; their output is zero), and the
decode batch and its block-table width are padded here.

A windowed layer (`sliding_window=W`) reads only the blocks its queries' windows touch:
each row's table is sliced from the block holding its first visible key (position
i - W + 1 for a query at i), so entries before it, which the block manager may have
released (FREED_BLOCK), are never read, and a long context costs O(W), not O(context).

Attention sinks (gpt-oss: `sinks`, a logit per query head): each softmax's denominator
gains exp(sink), which carries no value. Decode adds it as one more column of the scores.
SDPA has no sink, but on CPU its flash kernel gives each row's log-sum-exp (lse) too, and the
sink only rescales a row: sum e^s v / (sum e^s + e^sink) = SDPA's row * sigmoid(lse - sink).
Elsewhere prefill writes attention out, SINK_QUERY_ROWS rows at a time (8x slower on CPU).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionMetadata, PrefillChunk
from engine.attention.kv_format import KvCacheFormat
from engine.cpu_tuning import bucket

SINK_QUERY_ROWS = 128  # prefill with sinks and a mask: query rows per call (and per scores tensor off CPU)


def softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last dimension; `sinks` (broadcast to scores[..., :1]) join each
    denominator as one more logit, whose probability is dropped."""
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    sink = sinks.to(scores.dtype).expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]


class TorchAttentionBackend:
    name = "torch"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int,
                 kv_format: KvCacheFormat | None = None) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.group = num_heads // num_kv_heads
        self.scale = head_dim ** -0.5
        # None or auto: rows are the model's values, stored and read as they are.
        self.kv_format = kv_format if kv_format is not None and kv_format.quantized else None
        self.row_width = head_dim if self.kv_format is None else self.kv_format.row_width(head_dim)

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (2, self.num_kv_heads, num_blocks, block_size, self.row_width)

    def prepare(self, meta: AttentionMetadata) -> None:
        if meta.num_decode_tokens:
            self._prepare_decode(meta)
        meta.backend_state["prefill_masks"] = self._prefill_masks(meta)

    def _prepare_decode(self, meta: AttentionMetadata) -> None:
        meta.backend_state["decode_plan"] = self._decode_plan(meta, None)

    @staticmethod
    def _decode_plan(meta: AttentionMetadata, window: int | None) -> tuple:
        """(blocks to gather, [B, width] table shape, [1, B, 1, L] mask: True where a key is
        past the context or before the window)."""
        tables, lens = meta.decode_block_tables, meta.decode_context_lens
        if tables.device.type == "cpu":
            tables, lens = _pad_decode(tables, lens)
        block_size = meta.backend_state["block_size"]
        first = torch.zeros_like(lens)
        if window is not None:  # keep the blocks from the one holding position len - W on
            first = (lens - window).clamp(min=0) // block_size
            width = min(tables.shape[1], (window + block_size - 2) // block_size + 1)
            if tables.device.type == "cpu":
                width = bucket(width)
            cols = first[:, None] + torch.arange(width, device=tables.device)[None, :]
            # Columns past a row's table only ever hold masked positions.
            tables = tables.gather(1, cols.clamp(max=tables.shape[1] - 1))
        positions = first[:, None] * block_size + torch.arange(tables.shape[1] * block_size,
                                                               device=tables.device)[None, :]
        mask = positions >= lens[:, None]
        if window is not None:
            mask |= positions < (lens - window)[:, None]
        return tables.flatten(), tables.shape, mask[None, :, None, :]

    def _window_state(self, meta: AttentionMetadata, window: int) -> tuple:
        """Per step and window, shared by the layers of that window: (decode plan,
        [(first block, mask)] per prefill chunk)."""
        key = ("window", window)
        if key not in meta.backend_state:
            plan = self._decode_plan(meta, window) if meta.num_decode_tokens else None
            bs = meta.backend_state["block_size"]
            meta.backend_state[key] = (plan, [_window_mask(c, window, bs) for c in meta.prefills])
        return meta.backend_state[key]

    @staticmethod
    def _prefill_masks(meta: AttentionMetadata) -> list[tuple[int, torch.Tensor | None]]:
        masks = []
        for chunk in meta.prefills:
            start = chunk.context_len - chunk.num_tokens
            if start or chunk.bidirectional:  # a cached prefix: causal mask offset by `start`
                q_pos = torch.arange(start, chunk.context_len, device=chunk.block_table.device)
                k_pos = torch.arange(chunk.context_len, device=chunk.block_table.device)
                masks.append((0, _both_ways(k_pos[None, :] <= q_pos[:, None], chunk.bidirectional, q_pos, k_pos)))
            else:
                masks.append((0, None))  # plain causal attention
        return masks

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata, sliding_window: int | None = None,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        num_blocks, block_size = kv_cache.shape[2], kv_cache.shape[3]
        flat = kv_cache.view(2, self.num_kv_heads, num_blocks * block_size, self.row_width)
        num_tokens = meta.slot_mapping.numel()  # rows past it are padding
        k, v = self._rows(k[:num_tokens]), self._rows(v[:num_tokens])
        if flat.dtype == torch.float8_e4m3fn:  # index_copy_ has no float8 kernel (CPU): copy the bytes
            flat, k, v = flat.view(torch.uint8), k.view(torch.uint8), v.view(torch.uint8)
        flat[0].index_copy_(1, meta.slot_mapping, k.transpose(0, 1))
        flat[1].index_copy_(1, meta.slot_mapping, v.transpose(0, 1))
        return self._attend(q, kv_cache, meta, sliding_window, sinks)

    def _attend(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of q's rows (decodes, then prefill chunks, then padding) to the cache."""
        num_tokens = meta.slot_mapping.numel()
        out = torch.empty_like(q)
        out[num_tokens:] = 0
        num_decode = meta.num_decode_tokens
        masks = meta.backend_state["prefill_masks"]
        if window is not None:
            plan, masks = self._window_state(meta, window)
            if num_decode:
                out[:num_decode] = self._decode_with(q[:num_decode], kv_cache, plan, sinks)
        elif num_decode:
            out[:num_decode] = self._decode(q[:num_decode], kv_cache, meta, sinks)
        for chunk, (first_block, mask) in zip(meta.prefills, masks):
            rows = slice(chunk.token_start, chunk.token_start + chunk.num_tokens)
            out[rows] = self._prefill(q[rows], kv_cache, chunk, mask, first_block, sinks)
        return out

    def _decode(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        return self._decode_with(q, kv_cache, meta.backend_state["decode_plan"], sinks)

    def _decode_with(self, q: torch.Tensor, kv_cache: torch.Tensor, plan: tuple,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
        blocks, shape, mask = plan
        num_decode = q.shape[0]
        batch = shape[0]
        if batch > num_decode:
            q = torch.cat([q, q.new_zeros(batch - num_decode, *q.shape[1:])])
        k, v = self._gather(kv_cache, blocks, q.dtype)
        k = k.view(self.num_kv_heads, batch, -1, self.head_dim)  # [Hkv, B, L, D]
        v = v.view(self.num_kv_heads, batch, -1, self.head_dim)
        q = q.view(batch, self.num_kv_heads, self.group, self.head_dim).transpose(0, 1)
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.scale  # [Hkv, B, G, L]
        scores.masked_fill_(mask, float("-inf"))
        heads = None if sinks is None else sinks.view(self.num_kv_heads, 1, self.group, 1)
        probs = softmax_with_sinks(scores.float(), heads).to(v.dtype)
        out = torch.matmul(probs, v)  # [Hkv, B, G, D]
        return out.transpose(0, 1).reshape(batch, self.num_heads, self.head_dim)[:num_decode]

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        """New K or V [T, Hkv, D] as the cache stores them."""
        return x if self.kv_format is None else self.kv_format.quantize_rows(x)

    def _gather(self, kv_cache: torch.Tensor, blocks: torch.Tensor, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of these blocks, in order, in `dtype`: two [Hkv, len(blocks), block_size, D]
        tensors. One index_select over K and V together: much faster on CPU than advanced indexing."""
        two, heads, num_blocks, block_size, row = kv_cache.shape
        both = kv_cache.view(two * heads, num_blocks, block_size, row).index_select(1, blocks)
        if self.kv_format is not None:
            both = self.kv_format.dequantize(both, dtype)
        return both[:heads], both[heads:]

    def _prefill(self, q: torch.Tensor, kv_cache: torch.Tensor, chunk: PrefillChunk,
                 mask: torch.Tensor | None, first_block: int = 0, sinks: torch.Tensor | None = None
                 ) -> torch.Tensor:
        """`mask` [num_tokens, keys], None for plain causal; keys start at `first_block`."""
        n = chunk.context_len - first_block * kv_cache.shape[3]
        k, v = self._gather(kv_cache, chunk.block_table[first_block:], q.dtype)
        k, v = k.flatten(1, 2)[:, :n], v.flatten(1, 2)[:, :n]  # [Hkv, n, D]
        if sinks is not None:
            return self._prefill_with_sinks(q, k, v, mask, sinks)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),
            attn_mask=mask, is_causal=mask is None, scale=self.scale, enable_gqa=True)
        return out.squeeze(0).transpose(0, 1)

    def _prefill_with_sinks(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                            sinks: torch.Tensor) -> torch.Tensor:
        """q [nq, Hq, D] attends to k, v [Hkv, n, D] (`mask` as in `_prefill`; None: causal,
        the queries being the last nq keys), each softmax with its head's sink."""
        if q.device.type != "cpu":
            return self._prefill_with_sinks_written_out(q, k, v, mask, sinks)
        nq, n = q.shape[0], k.shape[1]
        k, v = k.repeat_interleave(self.group, 0), v.repeat_interleave(self.group, 0)  # [Hq, n, D]
        if mask is None and nq == n:  # a whole prompt: the kernel skips the masked blocks itself
            return self._sdpa_with_sinks(q, k, v, None, sinks)
        if mask is None:
            mask = torch.ones(nq, n, dtype=torch.bool).tril(n - nq)
        # A mask of SDPA's is applied, not skipped: so each SINK_QUERY_ROWS rows read only the
        # keys they see (a window's: O(window) a row, not O(context)).
        out = torch.empty_like(q)
        for start in range(0, nq, SINK_QUERY_ROWS):
            rows = slice(start, min(nq, start + SINK_QUERY_ROWS))
            seen = mask[rows].any(0).nonzero()
            keys = slice(int(seen[0]), int(seen[-1]) + 1)
            out[rows] = self._sdpa_with_sinks(q[rows], k[:, keys], v[:, keys], mask[rows, keys], sinks)
        return out

    def _sdpa_with_sinks(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                         sinks: torch.Tensor) -> torch.Tensor:
        """q [nq, Hq, D], k and v [Hq, n, D]; `mask` [nq, n] (None: causal, nq == n)."""
        bias = None if mask is None else torch.zeros(mask.shape, dtype=q.dtype).masked_fill_(~mask, float("-inf"))
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q.transpose(0, 1).unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), 0.0, mask is None,
            attn_mask=bias, scale=self.scale)
        keep = torch.sigmoid(lse.squeeze(0) - sinks.float()[:, None])  # [Hq, nq]: the module docstring
        return (out.squeeze(0).float() * keep[..., None]).to(q.dtype).transpose(0, 1)

    def _prefill_with_sinks_written_out(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                        mask: torch.Tensor | None, sinks: torch.Tensor) -> torch.Tensor:
        nq, n = q.shape[0], k.shape[1]
        heads = q.reshape(nq, self.num_kv_heads, self.group, self.head_dim).permute(1, 2, 0, 3)  # [Hkv, G, nq, D]
        keys, values = k.unsqueeze(1).transpose(-1, -2), v.unsqueeze(1)  # [Hkv, 1, D, n], [Hkv, 1, n, D]
        if mask is None:
            mask = torch.ones(nq, n, dtype=torch.bool, device=q.device).tril(n - nq)
        sink = sinks.view(self.num_kv_heads, self.group, 1, 1)
        out = torch.empty_like(q)
        for start in range(0, nq, SINK_QUERY_ROWS):
            rows = slice(start, min(nq, start + SINK_QUERY_ROWS))
            scores = torch.matmul(heads[:, :, rows], keys).float() * self.scale  # [Hkv, G, rows, n]
            scores.masked_fill_(~mask[rows], float("-inf"))
            probs = softmax_with_sinks(scores, sink).to(v.dtype)
            out[rows] = torch.matmul(probs, values).permute(2, 0, 1, 3).flatten(1, 2)
        return out

    def copy_blocks(self, kv_caches: list[torch.Tensor], pairs: list[tuple[int, int]]) -> None:
        copy_kv_blocks(kv_caches, pairs)


def copy_kv_blocks(kv_caches: list[torch.Tensor], pairs: list[tuple[int, int]]) -> None:
    """Copy whole blocks src -> dst in every layer of a [2, Hkv, num_blocks, ...] cache."""
    if not pairs:
        return
    src = torch.tensor([s for s, _ in pairs], device=kv_caches[0].device)
    dst = torch.tensor([d for _, d in pairs], device=kv_caches[0].device)
    for cache in kv_caches:
        cache[:, :, dst] = cache[:, :, src]


def _window_mask(chunk: PrefillChunk, window: int, block_size: int) -> tuple[int, torch.Tensor]:
    """(first block, [num_tokens, keys] mask) of a chunk whose queries see keys j with
    i - window < j <= i; the keys start at the first block any of its queries sees."""
    start = chunk.context_len - chunk.num_tokens
    first_block = max(0, start - window + 1) // block_size
    device = chunk.block_table.device
    q_pos = torch.arange(start, chunk.context_len, device=device)
    k_pos = torch.arange(first_block * block_size, chunk.context_len, device=device)
    distance = q_pos[:, None] - k_pos[None, :]
    return first_block, _both_ways(distance >= 0, chunk.bidirectional, q_pos, k_pos) & (distance < window)


def _both_ways(allowed: torch.Tensor, spans: tuple[tuple[int, int], ...], q_pos: torch.Tensor,
               k_pos: torch.Tensor) -> torch.Tensor:
    """`allowed` [queries, keys], and a query in a span [a, b) sees every key of its span
    (HF Gemma 3's mask for an image's tokens; a window still bounds it)."""
    for a, b in spans:
        allowed |= ((q_pos >= a) & (q_pos < b))[:, None] & ((k_pos >= a) & (k_pos < b))[None, :]
    return allowed


def _pad_decode(tables: torch.Tensor, lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Block tables and context lengths padded to bucketed batch and width. Padding rows
    attend to one key (block 0's first slot) so that their softmax stays finite."""
    batch, width = tables.shape
    padded = tables.new_zeros(bucket(batch), bucket(width))
    padded[:batch, :width] = tables
    return padded, torch.cat([lens, lens.new_ones(padded.shape[0] - batch)])
