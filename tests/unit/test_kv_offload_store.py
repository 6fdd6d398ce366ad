"""The second tier's bytes (engine/kv_offload/store.py) on CPU: blocks of caches in any dtype
(bf16, int8 rows of D+2, fp8) go to file-backed slots and come back bit for bit."""

from __future__ import annotations

import pytest
import torch

from engine.kv_offload.store import open_store

NUM_BLOCKS, BLOCK, HKV = 6, 4, 2


def caches(dtype: torch.dtype, row: int, layers: int = 3) -> list[torch.Tensor]:
    """[2, Hkv, num_blocks, block_size, row] per layer, every byte different."""
    g = torch.Generator().manual_seed(0)
    shape = (2, HKV, NUM_BLOCKS, BLOCK, row)
    size = torch.empty((), dtype=dtype).element_size()
    return [torch.randint(0, 256, (*shape[:-1], row * size), dtype=torch.uint8, generator=g).view(dtype)
            for _ in range(layers)]


@pytest.mark.parametrize("dtype,row", [(torch.bfloat16, 8), (torch.int8, 10), (torch.float8_e4m3fn, 8),
                                       (torch.float32, 4)])
def test_blocks_round_trip_through_the_file(tmp_path, dtype, row):
    kv = caches(dtype, row)
    slot_bytes = 3 * 2 * HKV * BLOCK * row * kv[0].element_size()
    store = open_store(kv, 4.5 * slot_bytes / 2**30, str(tmp_path))
    assert store.num_slots == 4 and store.slot_bytes == slot_bytes
    assert list(tmp_path.iterdir()) == []  # the file is unlinked once mapped
    want = [c.clone() for c in kv]
    store.copy(kv, [(3, 0), (1, 2)], [])
    for c in kv:
        c.view(torch.uint8).zero_()
    store.copy(kv, [], [(2, 5), (0, 4)])  # slot 2 held block 1, slot 0 block 3
    for c, w in zip(kv, want):
        assert torch.equal(c[:, :, 5].view(torch.uint8), w[:, :, 1].view(torch.uint8))
        assert torch.equal(c[:, :, 4].view(torch.uint8), w[:, :, 3].view(torch.uint8))
        assert not c[:, :, :4].view(torch.uint8).any()
    assert store.saved_bytes == store.restored_bytes == 2 * slot_bytes
    store.close()


def test_a_slot_saved_and_restored_in_one_step_is_copied_from_its_block(tmp_path):
    kv = caches(torch.bfloat16, 8)
    want = [c.clone() for c in kv]
    store = open_store(kv, 0.01, str(tmp_path))
    # Block 2 goes to slot 0 and block 2 is then reused as the destination of slot 0's restore
    # into block 5: block 5 gets block 2's KV as it was before the step.
    store.copy(kv, [(2, 0)], [(0, 5)])
    for c, w in zip(kv, want):
        assert torch.equal(c[:, :, 5].view(torch.uint8), w[:, :, 2].view(torch.uint8))
    store.copy(kv, [], [(0, 1)])  # and from the file in a later step
    for c, w in zip(kv, want):
        assert torch.equal(c[:, :, 1].view(torch.uint8), w[:, :, 2].view(torch.uint8))


def test_a_size_under_one_block_is_no_store(tmp_path, caplog):
    assert open_store(caches(torch.float32, 4), 1e-9, str(tmp_path)) is None
    assert "holds no block" in caplog.text


def _rss_file_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssFile:"))


def test_release_pages_gives_the_saved_blocks_memory_back(tmp_path):
    kv = [torch.ones(2, HKV, NUM_BLOCKS, 1024, 1024, dtype=torch.uint8)]  # 4 MiB a block
    store = open_store(kv, 64 / 1024, str(tmp_path))  # 16 slots: 64 MiB of file
    store.copy(kv, [(b % NUM_BLOCKS, b) for b in range(store.num_slots)], [])
    full = _rss_file_kib()
    store.release_pages()  # what a sleep does
    assert full - _rss_file_kib() > 48 * 1024
    store.copy(kv, [], [(3, 0)])  # still usable after the wake: the dropped pages read back
    assert torch.equal(kv[0][:, :, 0], torch.ones_like(kv[0][:, :, 0]))
    store.close()
