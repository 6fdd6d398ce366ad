"""The cupy backend's FlashAttention prefill layout (engine/attention/flash_prefill.py), on CPU:
the packed contexts it gathers, attended with flash's bottom-right causal mask chunk by
chunk, equal the torch reference backend's prefill rows. The flash call itself runs in
tests/kernels/test_cupy_backend.py on a GPU."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention import get_attention_backend
from engine.attention.flash_prefill import FlashPrefillPlan, gather_contexts, plan_flash_prefill, with_sinks
from kernel_inputs import mixed_step

HEADS, KV_HEADS, DIM, BLOCKS = 8, 2, 64, 200
# (new tokens, context): cached prefixes, fresh prompts, one token over a long prefix.
CHUNKS = ((20, 50), (9, 9), (100, 100), (1, 300), (33, 33))


def bottom_right_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: FlashPrefillPlan,
                        scale: float, window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """What flash computes for the plan: chunk i's new token j sees keys 0 .. c - n + j (with
    window_size_left = window - 1, only the last `window` of them); and each row's log-sum-exp
    in flash's varlen layout [H, total_q]."""
    out, lse = [], []
    cq, ck = plan.cu_seq_q.tolist(), plan.cu_seq_k.tolist()
    group = q.shape[1] // k.shape[1]
    for a, b, c, d in zip(cq, cq[1:], ck, ck[1:]):
        n, context = b - a, d - c
        last = (context - n + torch.arange(n))[:, None]
        mask = torch.arange(context)[None, :] <= last
        if window:
            mask &= torch.arange(context)[None, :] > last - window
        out.append(F.scaled_dot_product_attention(
            q[a:b].transpose(0, 1), k[c:d].transpose(0, 1), v[c:d].transpose(0, 1), attn_mask=mask,
            scale=scale, enable_gqa=True).transpose(0, 1))
        scores = torch.einsum("nhd,khd->hnk", q[a:b], k[c:d].repeat_interleave(group, dim=1)) * scale
        lse.append(torch.logsumexp(scores.masked_fill(~mask, float("-inf")), dim=-1))
    return torch.cat(out), torch.cat(lse, dim=1)


def test_gathered_contexts_attended_bottom_right_equal_the_reference():
    backend = get_attention_backend("torch", HEADS, KV_HEADS, DIM, "cpu")
    block_size = 16
    torch.manual_seed(0)
    cache = torch.randn(backend.kv_cache_shape(BLOCKS, block_size))
    meta = mixed_step(block_size, BLOCKS, torch.Generator().manual_seed(1), "cpu", CHUNKS)
    num_tokens = meta.slot_mapping.numel()
    q, k, v = torch.randn(num_tokens, HEADS + 2 * KV_HEADS, DIM).split([HEADS, KV_HEADS, KV_HEADS], dim=1)
    backend.prepare(meta)
    reference = backend.forward(q, k, v, cache, meta)  # writes the new K/V into the cache too

    plan = plan_flash_prefill(meta)
    assert plan.first_row == meta.num_decode_tokens and plan.num_rows == num_tokens - plan.first_row
    assert plan.cu_seq_q.dtype == plan.cu_seq_k.dtype == torch.int32
    assert (plan.max_q, plan.max_k) == (100, 300)
    packed_k, packed_v = gather_contexts(cache, plan)
    assert packed_k.shape == (sum(c for _, c in CHUNKS), KV_HEADS, DIM) and packed_k.is_contiguous()
    rows = slice(plan.first_row, plan.first_row + plan.num_rows)
    # The packed keys of a chunk's new tokens are the k that was just written.
    new_keys = torch.cat([packed_k[end - n:end] for (n, _), end in zip(CHUNKS, plan.cu_seq_k[1:].tolist())])
    assert torch.equal(new_keys, k[rows])
    ours, _ = bottom_right_causal(q[rows], packed_k, packed_v, plan, backend.scale)
    torch.testing.assert_close(ours, reference[rows], rtol=1e-5, atol=1e-5)


def test_windowed_plans_and_sinks_equal_the_reference():
    """gpt-oss's attention: a window's plan gathers each chunk's context from its first query's
    window (the poisoned blocks before it never), and the sinks applied to flash's log-sum-exp
    (`with_sinks`) give the torch backend's rows."""
    backend = get_attention_backend("torch", HEADS, KV_HEADS, DIM, "cpu")
    block_size, window = 16, 24
    torch.manual_seed(0)
    cache = torch.randn(backend.kv_cache_shape(BLOCKS, block_size))
    meta = mixed_step(block_size, BLOCKS, torch.Generator().manual_seed(1), "cpu", CHUNKS)
    num_tokens = meta.slot_mapping.numel()
    q, k, v = torch.randn(num_tokens, HEADS + 2 * KV_HEADS, DIM).split([HEADS, KV_HEADS, KV_HEADS], dim=1)
    sinks = torch.randn(HEADS)
    backend.prepare(meta)
    reference = backend.forward(q, k, v, cache, meta, sliding_window=window, sinks=sinks)
    for chunk in meta.prefills:  # poison what no query of the chunk sees: it must not be gathered
        first = max(0, chunk.context_len - chunk.num_tokens - window + 1)
        for block in chunk.block_table[:first // block_size].tolist():
            cache[:, :, block] = float("nan")
    plan = plan_flash_prefill(meta, window)
    assert plan.cu_seq_k[-1] == sum(c - max(0, c - n - window + 1) for n, c in CHUNKS)
    packed_k, packed_v = gather_contexts(cache, plan)
    rows = slice(plan.first_row, plan.first_row + plan.num_rows)
    out, lse = bottom_right_causal(q[rows], packed_k, packed_v, plan, backend.scale, window)
    assert not out.isnan().any()
    torch.testing.assert_close(with_sinks(out, lse, sinks), reference[rows], rtol=1e-5, atol=1e-5)


def test_chunks_that_are_not_one_run_of_rows_get_no_plan():
    meta = mixed_step(16, BLOCKS, torch.Generator().manual_seed(1), "cpu", CHUNKS[:2])
    meta.prefills[1].token_start += 1  # a gap between the two chunks' rows
    assert plan_flash_prefill(meta) is None


def test_chunks_built_one_by_one_get_the_plan_of_the_runners_padded_tables():
    meta = mixed_step(16, BLOCKS, torch.Generator().manual_seed(1), "cpu", CHUNKS)
    runners = plan_flash_prefill(meta)
    meta.prefills = [type(c)(c.token_start, c.num_tokens, c.context_len, c.block_table.clone()) for c in meta.prefills]
    meta.prefill_block_tables = None  # as a caller that builds each chunk's table on its own
    assert torch.equal(plan_flash_prefill(meta).key_slots, runners.key_slots)


def test_an_fp8_cache_is_gathered_widened_to_the_query_dtype():
    """--kv-cache-dtype fp8: the gather reads the e4m3 cache the torch backend wrote and widens
    it as it packs (exactly: the new keys come back as the backend's dequantized values), and
    attending the packed rows gives the torch backend's prefill over the same fp8 cache."""
    from engine.attention.kv_format import KvCacheFormat
    fmt = KvCacheFormat("fp8", torch.float32)
    backend = get_attention_backend("torch", HEADS, KV_HEADS, DIM, "cpu", dtype=torch.float32, kv_format=fmt)
    block_size = 16
    torch.manual_seed(0)
    cache = torch.randn(backend.kv_cache_shape(BLOCKS, block_size)).to(torch.float8_e4m3fn)
    meta = mixed_step(block_size, BLOCKS, torch.Generator().manual_seed(1), "cpu", CHUNKS)
    num_tokens = meta.slot_mapping.numel()
    q, k, v = torch.randn(num_tokens, HEADS + 2 * KV_HEADS, DIM).split([HEADS, KV_HEADS, KV_HEADS], dim=1)
    backend.prepare(meta)
    reference = backend.forward(q, k, v, cache, meta)
    plan = plan_flash_prefill(meta)
    packed_k, packed_v = gather_contexts(cache, plan, torch.float32)
    assert packed_k.dtype == torch.float32 and packed_k.is_contiguous()
    rows = slice(plan.first_row, plan.first_row + plan.num_rows)
    new_keys = torch.cat([packed_k[end - n:end] for (n, _), end in zip(CHUNKS, plan.cu_seq_k[1:].tolist())])
    assert torch.equal(new_keys, fmt.dequantize(fmt.quantize_rows(k[rows]), torch.float32))
    assert not torch.equal(new_keys, k[rows])  # rounded to e4m3 on the way in
    ours, _ = bottom_right_causal(q[rows], packed_k, packed_v, plan, backend.scale)
    torch.testing.assert_close(ours, reference[rows], rtol=1e-5, atol=1e-5)
