"""The prefix cache's second tier, block-manager side (engine/kv_offload/index.py): pure ints,
exact slots, LRU order, verification, and the block manager's saves and restores through it."""

from __future__ import annotations

import pytest

from common.prefix_hash import ROOT_HASH, hash_block
from engine.block_manager import BlockManager
from engine.kv_offload.index import OffloadIndex


def key(n: int) -> tuple[int, int, tuple[int, ...], tuple]:
    """(hash, parent, tokens, extra keys) of a one-block prompt of tokens n, n+1."""
    tokens = (n, n + 1)
    return hash_block(ROOT_HASH, tokens, ()), ROOT_HASH, tokens, ()


def test_slots_lowest_first_then_least_recently_used():
    index = OffloadIndex(2)
    a, b, c = key(10), key(20), key(30)
    assert index.save(*a, block_id=7) == 0
    assert index.save(*b, block_id=8) == 1
    assert index.save(*a, block_id=9) is None  # held already: a use, nothing copied
    assert index.take_copies() == ([(7, 0), (8, 1)], [])
    assert index.save(*c, block_id=3) == 1  # b is the least recently used
    assert index.lookup(*b) is None and index.lookup(*a) == 0 and index.lookup(*c) == 1
    index.check_invariants()


def test_lookup_verifies_the_key_parts_not_the_hash():
    index = OffloadIndex(4)
    block_hash, parent, tokens, keys = key(10)
    index.save(block_hash, parent, tokens, keys, block_id=1)
    assert index.lookup(block_hash, parent, (10, 99), keys) is None  # same hash, other tokens: a collision
    assert index.lookup(block_hash, parent, tokens, ("lora", "x")) is None
    assert index.lookup(block_hash, 12345, tokens, keys) is None
    assert index.save(block_hash, parent, (10, 99), keys, block_id=2) is None  # the first one stays
    assert index.lookup(block_hash, parent, tokens, keys) == 0


def test_a_slot_held_for_a_restore_is_never_reused_in_that_step():
    index = OffloadIndex(1)
    a, b = key(10), key(20)
    index.save(*a, block_id=1)
    index.take_copies()
    assert index.restore(a[0], block_id=5) == 0
    assert index.save(*b, block_id=2) is None  # the only slot is pinned: b is not kept
    assert index.take_copies() == ([], [(0, 5)])
    assert index.save(*b, block_id=2) == 0  # unpinned once the step's copies are taken
    assert index.lookup(*a) is None


def test_reset_and_forget():
    index = OffloadIndex(3)
    for n in (10, 20, 30):
        index.save(*key(n), block_id=n)
    index.forget({1})
    assert index.lookup(*key(20)) is None and len(index) == 2
    index.reset()
    assert len(index) == 0 and index.take_copies() == ([], [])
    index.check_invariants()


def tokens(first: int, n: int) -> list[int]:
    return list(range(first, first + n))


def test_block_manager_saves_evicted_blocks_and_restores_a_prefix():
    bm = BlockManager(num_blocks=4, block_size=4, offload=OffloadIndex(8))
    a = tokens(100, 9)  # two full blocks and one token
    assert bm.allocate("a", a, 9)
    table_a = bm.block_table("a")
    bm.free("a")
    assert bm.take_offload_copies() == ([], [])
    assert bm.allocate("b", tokens(500, 16), 16)  # takes every block: a's cached ones are popped
    saves, restores = bm.take_offload_copies()
    # Popped least recently freed first: the never-used block, then a's in reverse table order.
    assert saves == [(table_a[1], 0), (table_a[0], 1)] and restores == []
    bm.free("b")
    computed, num_cached = bm.get_computed_blocks(a)
    assert (computed, num_cached) == ([], 8)  # the first tier lost it, the second holds both blocks
    assert bm.num_cache_hits == 0
    assert bm.allocate("a2", a, 9, computed, (), num_cached)
    table = bm.block_table("a2")
    saves, restores = bm.take_offload_copies()
    assert restores == [(1, table[0]), (0, table[1])]
    assert bm.num_offload_hits == 8
    assert bm.get_computed_blocks(a) == (table[:2], 8)  # restored blocks are first-tier hits again
    bm.free("a2")
    bm.check_invariants()


def test_allocate_refuses_a_second_tier_count_it_cannot_restore():
    bm = BlockManager(num_blocks=4, block_size=4, offload=OffloadIndex(8))
    with pytest.raises(ValueError, match="second tier holds 0 blocks"):
        bm.allocate("a", tokens(100, 9), 9, (), (), 8)
    assert not bm.has_seq("a") and bm.num_free_blocks == 4


def test_reset_prefix_cache_forgets_the_second_tier_too():
    bm = BlockManager(num_blocks=2, block_size=4, offload=OffloadIndex(4))
    bm.allocate("a", tokens(100, 5), 5)
    bm.free("a")
    bm.allocate("b", tokens(500, 8), 8)
    bm.free("b")
    assert len(bm.offload) == 1
    assert bm.reset_prefix_cache()
    assert len(bm.offload) == 0 and bm.get_computed_blocks(tokens(100, 5)) == ([], 0)
    bm.drop_offload(turn_off=True)
    assert bm.offload is None and bm.take_offload_copies() == ([], [])


def test_no_second_tier_with_a_sliding_window_or_without_prefix_caching():
    assert BlockManager(4, 4, sliding_window=8, offload=OffloadIndex(2)).offload is None
    assert BlockManager(4, 4, enable_prefix_caching=False, offload=OffloadIndex(2)).offload is None
