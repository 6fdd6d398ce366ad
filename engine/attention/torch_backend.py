"""Plain-torch paged attention: the reference backend, on CPU and CUDA.

One layer's cache is a single tensor, heads outermost, so that gathering a
sequence's blocks yields a contiguous [Hkv, context, D] view with no transpose:

    kv_cache: [2, Hkv, num_blocks, block_size, D]
               ^ 0 = K, 1 = V

On CPU, shapes are padded to a few buckets (see engine.cpu_tuning): the runner may pass
padding rows after the real tokens (they have no slot; their output is zero), and the
decode batch and its block-table width are padded here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention import AttentionMetadata, PrefillChunk
from engine.cpu_tuning import bucket


class TorchAttentionBackend:
    name = "torch"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.group = num_heads // num_kv_heads
        self.scale = head_dim ** -0.5

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (2, self.num_kv_heads, num_blocks, block_size, self.head_dim)

    def prepare(self, meta: AttentionMetadata) -> None:
        if meta.num_decode_tokens:
            self._prepare_decode(meta)
        meta.backend_state["prefill_masks"] = self._prefill_masks(meta)

    def _prepare_decode(self, meta: AttentionMetadata) -> None:
        tables, lens = meta.decode_block_tables, meta.decode_context_lens
        if tables.device.type == "cpu":
            tables, lens = _pad_decode(tables, lens)
        block_size = meta.backend_state["block_size"]
        positions = torch.arange(tables.shape[1] * block_size, device=tables.device)
        # [1, B, 1, L]: True where the key position lies past the context.
        mask = positions[None, :] >= lens[:, None]
        meta.backend_state["decode_mask"] = mask[None, :, None, :]
        meta.backend_state["decode_blocks"] = tables.flatten()
        meta.backend_state["decode_shape"] = tables.shape

    @staticmethod
    def _prefill_masks(meta: AttentionMetadata) -> list[torch.Tensor | None]:
        masks = []
        for chunk in meta.prefills:
            start = chunk.context_len - chunk.num_tokens
            if start:  # attends to a cached prefix: causal mask offset by `start`
                q_pos = torch.arange(start, chunk.context_len, device=chunk.block_table.device)
                k_pos = torch.arange(chunk.context_len, device=chunk.block_table.device)
                masks.append(k_pos[None, :] <= q_pos[:, None])
            else:
                masks.append(None)  # plain causal attention
        return masks

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        num_blocks, block_size = kv_cache.shape[2], kv_cache.shape[3]
        flat = kv_cache.view(2, self.num_kv_heads, num_blocks * block_size, self.head_dim)
        num_tokens = meta.slot_mapping.numel()  # rows past it are padding
        flat[0].index_copy_(1, meta.slot_mapping, k[:num_tokens].transpose(0, 1))
        flat[1].index_copy_(1, meta.slot_mapping, v[:num_tokens].transpose(0, 1))
        return self._attend(q, kv_cache, meta)

    def _attend(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Attention of q's rows (decodes, then prefill chunks, then padding) to the cache."""
        num_tokens = meta.slot_mapping.numel()
        out = torch.empty_like(q)
        out[num_tokens:] = 0
        num_decode = meta.num_decode_tokens
        if num_decode:
            out[:num_decode] = self._decode(q[:num_decode], kv_cache, meta)
        for chunk, mask in zip(meta.prefills, meta.backend_state["prefill_masks"]):
            rows = slice(chunk.token_start, chunk.token_start + chunk.num_tokens)
            out[rows] = self._prefill(q[rows], kv_cache, chunk, mask)
        return out

    def _decode(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        num_decode = q.shape[0]
        batch = meta.backend_state["decode_shape"][0]
        if batch > num_decode:
            q = torch.cat([q, q.new_zeros(batch - num_decode, *q.shape[1:])])
        k, v = self._gather(kv_cache, meta.backend_state["decode_blocks"])
        k = k.view(self.num_kv_heads, batch, -1, self.head_dim)  # [Hkv, B, L, D]
        v = v.view(self.num_kv_heads, batch, -1, self.head_dim)
        q = q.view(batch, self.num_kv_heads, self.group, self.head_dim).transpose(0, 1)
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.scale  # [Hkv, B, G, L]
        scores.masked_fill_(meta.backend_state["decode_mask"], float("-inf"))
        probs = torch.softmax(scores.float(), dim=-1).to(v.dtype)
        out = torch.matmul(probs, v)  # [Hkv, B, G, D]
        return out.transpose(0, 1).reshape(batch, self.num_heads, self.head_dim)[:num_decode]

    def _gather(self, kv_cache: torch.Tensor, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of these blocks, in order: two [Hkv, len(blocks), block_size, D] tensors.
        One index_select over K and V together: much faster on CPU than advanced indexing."""
        two, heads, num_blocks, block_size, dim = kv_cache.shape
        both = kv_cache.view(two * heads, num_blocks, block_size, dim).index_select(1, blocks)
        return both[:heads], both[heads:]

    def _prefill(self, q: torch.Tensor, kv_cache: torch.Tensor, chunk: PrefillChunk,
                 mask: torch.Tensor | None) -> torch.Tensor:
        n = chunk.context_len
        k, v = self._gather(kv_cache, chunk.block_table)
        k, v = k.flatten(1, 2)[:, :n], v.flatten(1, 2)[:, :n]  # [Hkv, n, D]
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),
            attn_mask=mask, is_causal=mask is None, scale=self.scale, enable_gqa=True)
        return out.squeeze(0).transpose(0, 1)

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


def _pad_decode(tables: torch.Tensor, lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Block tables and context lengths padded to bucketed batch and width. Padding rows
    attend to one key (block 0's first slot) so that their softmax stays finite."""
    batch, width = tables.shape
    padded = tables.new_zeros(bucket(batch), bucket(width))
    padded[:batch, :width] = tables
    return padded, torch.cat([lens, lens.new_ones(padded.shape[0] - batch)])
