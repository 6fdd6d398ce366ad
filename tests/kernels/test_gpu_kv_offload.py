"""The second tier's CUDA store (engine/kv_offload/store.py, CudaOffloadStore): pinned host
slots, saves copied to the host on a side stream, restores back before the forward. Blocks of
bf16, int8 (rows of D+2) and fp8 caches round-trip bit for bit, also a slot saved and restored
in one step, and the device blocks a step overwrites after its saves do not reach the host."""

from __future__ import annotations

import pytest
import torch

from gpu_skip import pytestmark  # noqa: F401  (skips this module without a GPU)
from engine.kv_offload.store import CudaOffloadStore, open_store

NUM_BLOCKS, BLOCK, HKV, LAYERS = 8, 16, 2, 3


def caches(dtype: torch.dtype, row: int) -> list[torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(0)
    size = torch.empty((), dtype=dtype).element_size()
    return [torch.randint(0, 256, (2, HKV, NUM_BLOCKS, BLOCK, row * size), dtype=torch.uint8, device="cuda",
                          generator=g).view(dtype) for _ in range(LAYERS)]


@pytest.mark.parametrize("dtype,row", [(torch.bfloat16, 64), (torch.int8, 66), (torch.float8_e4m3fn, 64)])
def test_blocks_round_trip_through_pinned_memory(dtype, row):
    kv = caches(dtype, row)
    store = open_store(kv, 0.01, None)
    assert isinstance(store, CudaOffloadStore) and store.host.is_pinned()
    want = [c.clone() for c in kv]
    store.copy(kv, [(3, 0), (1, 2)], [])
    for c in kv:  # the next forward overwrites the saved blocks: the host copies must not see it
        c.view(torch.uint8).zero_()
    store.copy(kv, [(6, 1)], [(2, 5), (0, 4), (1, 7)])  # slot 1 saved and restored in the same step
    torch.cuda.synchronize()
    for c, w in zip(kv, want):
        assert torch.equal(c[:, :, 5].view(torch.uint8), w[:, :, 1].view(torch.uint8))
        assert torch.equal(c[:, :, 4].view(torch.uint8), w[:, :, 3].view(torch.uint8))
        assert not c[:, :, 7].view(torch.uint8).any()  # block 6 was zero when slot 1 took it
    assert store.restored_bytes == 3 * store.slot_bytes and store.restore_s > 0
    store.close()
