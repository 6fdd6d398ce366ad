"""BlockManager: exact block ids, ref counts, free order, prefix-cache hits and copy-on-write.

Modelled on vLLM's tests/v1/core/test_prefix_caching.py. Free-queue order is observed through
which block ids later allocations receive, never by reading the queue itself.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from engine import block_manager
from engine.block_manager import BlockManager

BS = 4


def make(num_blocks: int = 10, caching: bool = True) -> BlockManager:
    return BlockManager(num_blocks, block_size=BS, enable_prefix_caching=caching)


def prompt(start: int, length: int) -> list[int]:
    """Distinct tokens per `start`, so different prompts never share a block by accident."""
    return list(range(start, start + length))


def alloc(bm: BlockManager, seq_id: str, tokens: list[int], extra_keys: tuple = ()) -> list[int]:
    """Allocate the whole prompt the way the scheduler does: cache lookup, then allocate."""
    computed, _ = bm.get_computed_blocks(tokens, extra_keys)
    assert bm.allocate(seq_id, tokens, len(tokens), computed, extra_keys)
    return bm.block_table(seq_id)


def snapshot(bm: BlockManager, seq_ids: list[str]) -> tuple:
    tables = {s: bm.block_table(s) for s in seq_ids if bm.has_seq(s)}
    return bm.num_free_blocks, tables, [bm.ref_count(b) for b in range(bm.num_blocks)]


def test_first_allocations_get_ascending_ids():
    bm = make(10)
    assert alloc(bm, "a", prompt(0, 10)) == [0, 1, 2]
    assert alloc(bm, "b", prompt(100, 5)) == [3, 4]
    assert [bm.ref_count(b) for b in range(6)] == [1, 1, 1, 1, 1, 0]
    assert bm.num_free_blocks == 5
    assert bm.usage == pytest.approx(0.5)
    bm.check_invariants()


def test_append_slots_grows_by_one_block_at_boundaries():
    bm = make(10)
    tokens = prompt(0, 3)
    alloc(bm, "a", tokens)
    lengths = []
    for token in range(50, 56):  # decode: sequence length goes 4, 5, ..., 9
        tokens.append(token)
        assert bm.append_slots("a", tokens, len(tokens))
        lengths.append(len(bm.block_table("a")))
    assert lengths == [1, 2, 2, 2, 2, 3]
    assert bm.block_table("a") == [0, 1, 2]
    assert bm.take_blocks_to_copy() == []
    bm.check_invariants()


def test_append_slots_covers_a_chunk_of_prefill():
    bm = make(10)
    tokens = prompt(0, 20)
    assert bm.allocate("a", tokens, 6)  # first chunk: 6 of 20 prompt tokens
    assert bm.block_table("a") == [0, 1]
    assert bm.append_slots("a", tokens, 20)
    assert bm.block_table("a") == [0, 1, 2, 3, 4]
    assert bm.append_slots("a", tokens, 20)  # nothing new to cover: no change
    assert bm.block_table("a") == [0, 1, 2, 3, 4]


def test_allocate_fails_cleanly_when_out_of_blocks():
    bm = make(4)
    alloc(bm, "a", prompt(0, 9))  # 3 blocks, 1 left
    before = snapshot(bm, ["a", "b"])
    assert not bm.can_allocate(5)
    assert not bm.allocate("b", prompt(100, 5), 5)
    assert snapshot(bm, ["a", "b"]) == before
    assert not bm.has_seq("b")
    assert bm.allocate("b", prompt(100, 4), 4)  # exactly the last block still fits
    assert bm.block_table("b") == [3]
    assert bm.num_free_blocks == 0
    bm.check_invariants()


def test_allocate_failure_leaves_hit_blocks_in_the_free_queue():
    bm = make(3)
    tokens = prompt(0, 9)
    alloc(bm, "a", tokens)
    bm.free("a")  # blocks 0, 1 cached with ref 0
    assert alloc(bm, "x", prompt(100, 4)) == [2]  # a's uncached partial block, at the queue front
    computed, num_cached = bm.get_computed_blocks(tokens)
    assert (computed, num_cached) == ([0, 1], 8)
    before = snapshot(bm, ["x", "a"])
    # Needs 2 revived + 1 new block, but only 2 blocks are free.
    assert not bm.allocate("a", tokens, 9, computed)
    assert snapshot(bm, ["x", "a"]) == before
    assert bm.get_computed_blocks(tokens)[0] == [0, 1]
    bm.check_invariants()


def test_append_slots_fails_cleanly_when_out_of_blocks():
    bm = make(2)
    tokens = prompt(0, 8)
    alloc(bm, "a", tokens)
    tokens.append(99)
    assert not bm.append_slots("a", tokens, 9)
    assert bm.block_table("a") == [0, 1]
    assert bm.num_free_blocks == 0
    bm.check_invariants()


def test_free_puts_blocks_at_the_tail_in_reverse_table_order():
    bm = make(6, caching=False)
    assert alloc(bm, "a", prompt(0, 12)) == [0, 1, 2]
    assert alloc(bm, "b", prompt(100, 8)) == [3, 4]
    bm.free("a")
    bm.free("b")
    assert bm.num_free_blocks == 6
    # Never-used block 5 first, then a's blocks last-to-first, then b's.
    assert alloc(bm, "c", prompt(200, 24)) == [5, 2, 1, 0, 4, 3]
    bm.check_invariants()


def test_free_unknown_sequence_is_a_noop():
    bm = make(4)
    bm.free("nope")
    assert bm.num_free_blocks == 4


def test_prefix_cache_hit_reuses_exact_blocks():
    bm = make(10)
    shared = prompt(0, 12)
    assert alloc(bm, "a", shared + [500, 501]) == [0, 1, 2, 3]
    assert (bm.num_cache_queries, bm.num_cache_hits) == (14, 0)

    computed, num_cached = bm.get_computed_blocks(shared + [600])
    assert (computed, num_cached) == ([0, 1, 2], 12)
    assert [bm.ref_count(b) for b in computed] == [1, 1, 1]  # lookup takes no references
    assert bm.allocate("b", shared + [600], 13, computed)
    assert bm.block_table("b") == [0, 1, 2, 4]
    assert [bm.ref_count(b) for b in range(5)] == [2, 2, 2, 1, 1]
    assert (bm.num_cache_queries, bm.num_cache_hits) == (27, 12)
    bm.check_invariants()


def test_last_token_is_never_served_from_cache():
    bm = make(10)
    tokens = prompt(0, 8)  # exactly 2 full blocks
    alloc(bm, "a", tokens)
    assert bm.get_computed_blocks(tokens) == ([0], 4)
    assert bm.get_computed_blocks(tokens + [99]) == ([0, 1], 8)
    assert bm.get_computed_blocks([]) == ([], 0)


def test_partial_block_is_cached_once_decode_fills_it():
    bm = make(10)
    tokens = prompt(0, 7)
    alloc(bm, "a", tokens)
    assert bm.get_computed_blocks(tokens + [70, 71]) == ([0], 4)
    tokens.append(70)
    assert bm.append_slots("a", tokens, 8)
    assert bm.get_computed_blocks(tokens + [71]) == ([0, 1], 8)


def test_blocks_are_cached_only_up_to_num_tokens():
    bm = make(10)
    tokens = prompt(0, 12)
    assert bm.allocate("a", tokens, 5)  # chunk: only block 0 is full (and written)
    assert bm.get_computed_blocks(tokens + [1]) == ([0], 4)
    assert bm.append_slots("a", tokens, 12)
    assert bm.get_computed_blocks(tokens + [1]) == ([0, 1, 2], 12)


def test_hash_collision_on_tokens_is_a_miss(monkeypatch):
    monkeypatch.setattr(block_manager, "hash_block", lambda parent, tokens, extra: 42)
    bm = make(10)
    a = prompt(0, 9)
    alloc(bm, "a", a)  # block 0 is cached under 42; block 1 collides with it and is not cached
    b = [9, 9, 9, 9] + a[4:]
    assert bm.get_computed_blocks(b) == ([], 0)
    assert alloc(bm, "b", b) == [3, 4, 5]
    assert bm.get_computed_blocks(a) == ([0], 4)
    bm.check_invariants()


def test_hash_collision_on_parent_is_a_miss(monkeypatch):
    monkeypatch.setattr(block_manager, "hash_block", lambda parent, tokens, extra: hash(tokens))
    bm = make(10)
    alloc(bm, "a", prompt(0, 9))
    # Same tokens as a's block 1, but at the start of the prompt: different parent.
    assert bm.get_computed_blocks(prompt(4, 5)) == ([], 0)
    assert bm.get_computed_blocks(prompt(0, 9)) == ([0, 1], 8)


def test_hash_collision_on_extra_keys_is_a_miss(monkeypatch):
    monkeypatch.setattr(block_manager, "hash_block", lambda parent, tokens, extra: hash((parent, tokens)))
    bm = make(10)
    alloc(bm, "a", prompt(0, 9), extra_keys=("lora-1",))
    assert bm.get_computed_blocks(prompt(0, 9), ("lora-2",)) == ([], 0)
    assert bm.get_computed_blocks(prompt(0, 9), ("lora-1",)) == ([0, 1], 8)


def test_fake_map_entry_is_rejected():
    bm = make(10)
    alloc(bm, "a", prompt(0, 5))
    fake_hash = block_manager.hash_block(None, (7, 7, 7, 7), ())
    bm._cached[fake_hash] = 0  # block 0 really holds (0, 1, 2, 3)
    assert bm.get_computed_blocks([7, 7, 7, 7, 7]) == ([], 0)


def test_extra_keys_separate_caches():
    bm = make(10)
    tokens = prompt(0, 9)
    alloc(bm, "a", tokens, extra_keys=("adapter-1",))
    assert bm.get_computed_blocks(tokens) == ([], 0)
    assert bm.get_computed_blocks(tokens, ("adapter-2",)) == ([], 0)
    assert bm.get_computed_blocks(tokens, ("adapter-1",)) == ([0, 1], 8)
    assert alloc(bm, "b", tokens) == [3, 4, 5]
    assert bm.get_computed_blocks(tokens) == ([3, 4], 8)


def test_duplicate_content_keeps_the_first_cached_block():
    bm = make(10)
    tokens = prompt(0, 9)
    assert bm.allocate("a", tokens, 9)  # both skip the lookup, so both compute the blocks
    assert bm.allocate("b", tokens, 9)
    assert bm.block_table("b") == [3, 4, 5]
    bm.free("a")
    bm.free("b")
    assert bm.get_computed_blocks(tokens) == ([0, 1], 8)
    bm.check_invariants()


def test_freed_cached_blocks_are_hit_until_evicted_in_lru_order():
    bm = make(6)
    a = prompt(0, 9)
    assert alloc(bm, "a", a) == [0, 1, 2]
    bm.free("a")  # queue: 3, 4, 5, 2, 1, 0
    assert bm.num_free_blocks == 6
    assert alloc(bm, "x", prompt(100, 12)) == [3, 4, 5]  # never-used blocks go first
    assert bm.get_computed_blocks(a) == ([0, 1], 8)
    assert alloc(bm, "y", prompt(200, 4)) == [2]  # a's partial last block
    assert bm.get_computed_blocks(a) == ([0, 1], 8)
    assert alloc(bm, "z", prompt(300, 4)) == [1]  # evicts a's second block before its first
    assert bm.get_computed_blocks(a) == ([0], 4)
    assert alloc(bm, "w", prompt(400, 4)) == [0]
    assert bm.get_computed_blocks(a) == ([], 0)
    bm.check_invariants()


def test_lru_evicts_the_earliest_freed_sequence_first():
    bm = make(4)
    a, b = prompt(0, 5), prompt(100, 5)
    assert alloc(bm, "a", a) == [0, 1]
    assert alloc(bm, "b", b) == [2, 3]
    bm.free("a")
    bm.free("b")  # queue: 1, 0, 3, 2
    assert alloc(bm, "x", prompt(200, 8)) == [1, 0]
    assert bm.get_computed_blocks(a) == ([], 0)
    assert bm.get_computed_blocks(b) == ([2], 4)


def test_hit_on_a_freed_block_revives_it():
    bm = make(4)
    a = prompt(0, 9)
    alloc(bm, "a", a)
    bm.free("a")  # queue: 3, 2, 1, 0
    assert alloc(bm, "b", a) == [0, 1, 3]
    assert [bm.ref_count(b) for b in range(4)] == [1, 1, 0, 1]
    assert bm.num_free_blocks == 1
    assert alloc(bm, "x", prompt(100, 4)) == [2]
    bm.check_invariants()


def test_stale_computed_blocks_are_rejected():
    bm = make(2)
    tokens = prompt(0, 5)
    alloc(bm, "a", tokens)
    bm.free("a")
    computed, _ = bm.get_computed_blocks(tokens)
    assert computed == [0]
    alloc(bm, "x", prompt(100, 8))  # pops blocks 1 and 0, evicting 0
    bm.free("x")
    with pytest.raises(ValueError):
        bm.allocate("a", tokens, 5, computed)


def test_free_with_discarded_step_uncaches_blocks_that_call_filled():
    bm = make(10)
    tokens = prompt(0, 12)
    assert bm.allocate("a", tokens, 6)  # caches block 0; this step ran
    assert bm.append_slots("a", tokens, 12)  # caches blocks 1, 2; preempted before it runs
    bm.free("a", step_discarded=True)
    assert bm.get_computed_blocks(tokens + [1]) == ([0], 4)
    # A resumed allocation keeps the blocks it got from the cache: their KV exists.
    assert bm.allocate("a", tokens, 12, [0])
    assert bm.block_table("a") == [0, 3, 4]
    bm.free("a", step_discarded=True)
    assert bm.get_computed_blocks(tokens + [1]) == ([0], 4)
    bm.check_invariants()


def test_free_with_discarded_step_keeps_the_first_copy_of_duplicates():
    bm = make(10)
    tokens = prompt(0, 5)
    assert bm.allocate("a", tokens, 5)  # caches block 0
    assert bm.allocate("b", tokens, 5)  # duplicate content: block 2 is not cached
    bm.free("b", step_discarded=True)
    assert bm.get_computed_blocks(tokens) == ([0], 4)
    bm.check_invariants()


def test_fork_shares_blocks_and_copies_on_write():
    bm = make(10)
    tokens = prompt(0, 6)
    assert alloc(bm, "a", tokens) == [0, 1]
    bm.fork("a", "b")
    assert bm.block_table("b") == [0, 1]
    assert [bm.ref_count(b) for b in range(3)] == [2, 2, 0]
    bm.check_invariants()

    assert bm.append_slots("b", tokens + [60], 7)  # b writes into shared partial block 1
    assert bm.take_blocks_to_copy() == [(1, 2)]
    assert bm.take_blocks_to_copy() == []
    assert bm.block_table("b") == [0, 2]
    assert [bm.ref_count(b) for b in range(3)] == [2, 1, 1]

    assert bm.append_slots("a", tokens + [70], 7)  # a owns block 1 alone now: no copy
    assert bm.take_blocks_to_copy() == []
    assert bm.block_table("a") == [0, 1]
    bm.check_invariants()

    bm.free("a")
    bm.free("b")
    assert bm.num_free_blocks == 10
    bm.check_invariants()


def test_fork_with_full_last_block_needs_no_copy():
    bm = make(10)
    tokens = prompt(0, 8)
    alloc(bm, "a", tokens)
    bm.fork("a", "b")
    assert bm.append_slots("b", tokens + [80], 9)
    assert bm.take_blocks_to_copy() == []
    assert bm.block_table("b") == [0, 1, 2]
    assert [bm.ref_count(b) for b in range(3)] == [2, 2, 1]


def test_copy_on_write_fails_cleanly_without_a_free_block():
    bm = make(2)
    tokens = prompt(0, 6)
    alloc(bm, "a", tokens)
    bm.fork("a", "b")
    assert not bm.append_slots("b", tokens + [60], 7)
    assert bm.take_blocks_to_copy() == []
    assert bm.block_table("b") == [0, 1]
    assert [bm.ref_count(0), bm.ref_count(1)] == [2, 2]


def test_caching_off_hashes_nothing():
    bm = make(10, caching=False)
    tokens = prompt(0, 9)
    assert alloc(bm, "a", tokens) == [0, 1, 2]
    assert bm.get_computed_blocks(tokens) == ([], 0)
    assert alloc(bm, "b", tokens) == [3, 4, 5]
    assert (bm.num_cache_queries, bm.num_cache_hits) == (0, 0)
    assert bm._cached == {}


def test_reset_prefix_cache():
    bm = make(4)
    tokens = prompt(0, 9)
    alloc(bm, "a", tokens)
    assert not bm.reset_prefix_cache()  # a is still running
    bm.free("a")
    assert bm.get_computed_blocks(tokens) == ([0, 1], 8)
    assert bm.reset_prefix_cache()
    assert bm.get_computed_blocks(tokens) == ([], 0)
    assert bm.num_free_blocks == 4
    bm.check_invariants()


def test_programmer_errors_raise_value_error():
    bm = make(10)
    tokens = prompt(0, 9)
    alloc(bm, "a", tokens)
    with pytest.raises(ValueError):
        bm.allocate("a", tokens, 9)
    with pytest.raises(ValueError):
        bm.append_slots("nope", tokens, 9)
    with pytest.raises(ValueError):
        bm.fork("nope", "c")
    bm.fork("a", "b")
    with pytest.raises(ValueError):
        bm.fork("a", "b")
    bm.free("a")
    bm.free("b")
    computed, _ = bm.get_computed_blocks(tokens)
    with pytest.raises(ValueError):
        bm.allocate("c", tokens, 4, computed)  # 2 computed blocks cover 8 tokens
    with pytest.raises(ValueError):
        BlockManager(0)
    bm.check_invariants()


def test_num_blocks_needed():
    bm = make(10)
    assert [bm.num_blocks_needed(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


# -- speculative decoding: draft slots, rollback, copy-on-write before drafts ----------------


def test_draft_slots_stay_allocated_after_rollback_and_no_hash_covers_a_draft():
    bm = make(10)
    tokens = prompt(0, 6)  # 6 real tokens, the 6th not computed yet
    alloc(bm, "a", tokens[:5])
    # Verify 3 drafts after the last real token: slots for positions 5..8 (3 blocks).
    assert bm.append_slots("a", tokens, 9, num_computed_tokens=5)
    table = bm.block_table("a")
    assert len(table) == 3
    # Only real tokens are hashed: block 1 (positions 4..7) holds drafts 6, 7, so it is not cached.
    assert bm.get_computed_blocks(tokens + [99, 98, 97]) == ([table[0]], BS)
    # All drafts rejected: the next step computes 1 token; the table keeps its slots.
    assert bm.append_slots("a", tokens + [50], 7, num_computed_tokens=6)
    assert bm.block_table("a") == table
    bm.check_invariants()
    bm.free("a")
    assert bm.num_free_blocks == 10


def test_drafts_landing_in_a_shared_block_copy_it_first():
    bm = make(10)
    tokens = prompt(0, 6)
    parent = alloc(bm, "a", tokens)  # blocks: [0..3] full, [4, 5] partial
    bm.fork("a", "b")
    bm.take_blocks_to_copy()
    # b verifies 3 drafts from position 6: the shared partial block is copied before the write.
    assert bm.append_slots("b", tokens + [7], 10, num_computed_tokens=6)
    child = bm.block_table("b")
    assert child[0] == parent[0] and child[1] != parent[1]
    assert bm.take_blocks_to_copy() == [(parent[1], child[1])]
    assert bm.ref_count(parent[1]) == 1
    bm.check_invariants()
    for seq in ("a", "b"):
        bm.free(seq)
    assert bm.num_free_blocks == 10


def test_block_hashes_are_the_same_in_every_process():
    """A frontend routing by prefix must compute the engine's keys: no per-process salt."""
    code = ("from engine.block_manager import hash_block; "
            "h = hash_block(None, tuple(range(16)), ('adapter-1',)); print(h, hash_block(h, (5,) * 16, ()))")
    outputs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                              env={**os.environ, "PYTHONHASHSEED": seed}).stdout
               for seed in ("1", "2")}
    first = block_manager.hash_block(None, tuple(range(16)), ("adapter-1",))
    assert outputs == {f"{first} {block_manager.hash_block(first, (5,) * 16, ())}\n"}
    assert block_manager.hash_block(None, tuple(range(16)), ()) != first  # extra keys count
