"""BlockManager: exact block ids, ref counts, free order, prefix-cache hits and copy-on-write.

Modelled on vLLM's tests/v1/core/test_prefix_caching.py. Free-queue order is observed through
which block ids later allocations receive, never by reading the queue itself.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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


def test_a_decode_lease_is_the_last_blocks_room_when_nothing_else_needs_doing():
    bm = make(10)
    tokens = prompt(0, 6)  # blocks [0, 1]; block 1 holds 2 of 4 tokens
    alloc(bm, "a", tokens)
    assert bm.decode_lease("a") == 8  # positions 6 and 7 need no call
    tokens += [60, 61]  # spent without a call; the next decode crosses into a new block
    assert bm.append_slots("a", tokens + [62], 9, 8) and bm.block_table("a") == [0, 1, 2]
    assert bm.decode_lease("a") == 12
    bm.check_invariants()
    bm.free("a")


def test_no_decode_lease_in_a_shared_last_block_or_under_a_window():
    bm = make(10)
    tokens = prompt(0, 6)
    alloc(bm, "a", tokens)
    bm.fork("a", "b")  # block 1 is shared: the next write copies it first
    assert bm.decode_lease("a") == bm.decode_lease("b") == 0
    windowed = BlockManager(10, block_size=BS, enable_prefix_caching=True, sliding_window=8)
    alloc(windowed, "w", prompt(100, 6))
    assert windowed.decode_lease("w") == 0


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


# --- randomized: a simulated KV store checks every sequence reads back its own tokens ---

# Prompts over a two-token vocabulary make cache hits common. Steps are listed twice, and
# decode samples from four tokens, because sibling decodes after a fork exercise copy-on-write.
_step = st.tuples(st.just("step"), st.integers(0, 20), st.integers(0, 3), st.integers(1, 8))
_ops = st.one_of(
    st.tuples(st.just("new"), st.lists(st.integers(0, 1), min_size=1, max_size=12), st.integers(1, 8)),
    _step,
    _step,
    st.tuples(st.just("fork"), st.integers(0, 20)),
    st.tuples(st.just("free"), st.integers(0, 20)),
    st.tuples(st.just("preempt")),
)


class _Sim:
    """Drives a BlockManager like a scheduler and keeps a fake KV store, where each slot holds
    the token prefix that produced it, so wrong sharing or a missed copy shows up as bad KV.

    A step's copies and writes stay pending until the next operation, which may instead
    preempt that step's sequence: then they never happen, as when a scheduler takes back a
    sequence it had already scheduled.
    """

    def __init__(self, bm: BlockManager) -> None:
        self.bm = bm
        self.kv: dict[tuple[int, int], tuple[int, ...]] = {}
        self.tokens: dict[str, list[int]] = {}
        self.num_computed: dict[str, int] = {}
        self.pending: tuple[str, list, dict] | None = None
        self.next_id = 0

    def schedule(self, seq_id: str, start: int, end: int) -> None:
        table, toks = self.bm.block_table(seq_id), self.tokens[seq_id]
        writes = {(table[pos // BS], pos % BS): tuple(toks[:pos + 1]) for pos in range(start, end)}
        self.pending = (seq_id, self.bm.take_blocks_to_copy(), writes)
        self.num_computed[seq_id] = end

    def flush(self) -> None:
        if self.pending is not None:
            _, copies, writes = self.pending
            for src, dst in copies:
                for slot in range(BS):
                    if (src, slot) in self.kv:
                        self.kv[(dst, slot)] = self.kv[(src, slot)]
            self.kv.update(writes)
            self.pending = None

    def preempt(self) -> None:
        if self.pending is not None:
            seq_id = self.pending[0]
            self.pending = None
            self.bm.free(seq_id, step_discarded=True)
            del self.tokens[seq_id], self.num_computed[seq_id]

    def new(self, toks: list[int], chunk: int) -> None:
        seq_id = f"s{self.next_id}"
        self.next_id += 1
        computed, num_cached = self.bm.get_computed_blocks(toks)
        assert num_cached == len(computed) * BS < len(toks)
        for i, block_id in enumerate(computed):  # a hit must hold exactly this prefix's KV
            for slot in range(BS):
                assert self.kv.get((block_id, slot)) == tuple(toks[:i * BS + slot + 1])
        end = min(len(toks), num_cached + chunk)
        before = snapshot(self.bm, list(self.tokens))
        if not self.bm.allocate(seq_id, toks, end, computed):
            assert snapshot(self.bm, list(self.tokens)) == before
            return
        self.tokens[seq_id] = list(toks)
        self.schedule(seq_id, num_cached, end)

    def step(self, seq_id: str, sampled: int, chunk: int) -> None:
        toks, start = self.tokens[seq_id], self.num_computed[seq_id]
        decoding = start == len(toks)  # prefill done: the step decodes one sampled token
        if decoding:
            toks.append(sampled)
        end = min(len(toks), start + chunk)
        before = snapshot(self.bm, list(self.tokens))
        if not self.bm.append_slots(seq_id, toks, end):
            assert snapshot(self.bm, list(self.tokens)) == before
            if decoding:
                toks.pop()
            return
        self.schedule(seq_id, start, end)

    def fork(self, parent: str) -> None:
        child = f"s{self.next_id}"
        self.next_id += 1
        self.bm.fork(parent, child)
        self.tokens[child] = list(self.tokens[parent])
        self.num_computed[child] = self.num_computed[parent]

    def free(self, seq_id: str) -> None:
        self.bm.free(seq_id)
        del self.tokens[seq_id], self.num_computed[seq_id]

    def check(self) -> None:
        self.bm.check_invariants()
        for seq_id, toks in self.tokens.items():
            table = self.bm.block_table(seq_id)
            for pos in range(self.num_computed[seq_id]):
                assert self.kv.get((table[pos // BS], pos % BS)) == tuple(toks[:pos + 1]), seq_id


@settings(max_examples=500, deadline=None)
@given(ops=st.lists(_ops, min_size=5, max_size=50), num_blocks=st.integers(1, 16))
def test_random_operations_keep_invariants(ops, num_blocks):
    run_random_operations(_Sim(BlockManager(num_blocks, block_size=BS)), ops, num_blocks)


def run_random_operations(sim: _Sim, ops: list[tuple], num_blocks: int) -> None:
    """Apply `ops` to `sim`, checking its KV and the invariants after each; at the end every
    sequence is freed and every block must be free again."""
    for op in ops:
        if op[0] == "preempt":
            sim.preempt()
        sim.flush()
        sim.check()
        live = sorted(sim.tokens)
        if op[0] == "new":
            sim.new(op[1], op[2])
        elif op[0] != "preempt" and live:
            getattr(sim, op[0])(live[op[1] % len(live)], *op[2:])
        sim.bm.check_invariants()
    sim.flush()
    sim.check()
    for seq_id in list(sim.tokens):
        sim.free(seq_id)
    sim.bm.check_invariants()
    assert sim.bm.num_free_blocks == num_blocks
    assert all(sim.bm.ref_count(b) == 0 for b in range(num_blocks))


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


class _FullAppendOnly(BlockManager):
    """append_slots without its O(1) decode case: the reference that case must equal."""

    def _fits_last_block(self, *args) -> bool:
        return False


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(_ops, min_size=5, max_size=50), num_blocks=st.integers(1, 16))
def test_decode_fast_path_leaves_the_same_state_as_the_full_append(ops, num_blocks):
    fast, full = _Sim(BlockManager(num_blocks, block_size=BS)), _Sim(_FullAppendOnly(num_blocks, block_size=BS))
    run_random_operations(fast, ops, num_blocks)
    run_random_operations(full, ops, num_blocks)
    # Every allocation, copy, hash and free since the start shows in the free queue's order
    # and the cache map.
    assert list(fast.bm._free) == list(full.bm._free)
    assert fast.bm._cached == full.bm._cached


def test_decode_inside_the_last_block_takes_the_fast_path():
    bm = make(10)
    tokens = prompt(0, BS + 2)
    alloc(bm, "a", tokens[:BS + 1])
    table = bm.live_block_table("a")
    state = bm._seqs["a"]
    assert bm._fits_last_block(state, BS + 1, BS + 2)
    assert not bm._fits_last_block(state, BS + 1, 2 * BS)  # fills the block: it must be hashed
    assert bm.append_slots("a", tokens, BS + 2)
    assert bm.live_block_table("a") is table and len(table) == 2
    bm.fork("a", "b")  # the last block is shared now: a write must copy it first
    assert not bm._fits_last_block(state, BS + 2, BS + 3)
    bm.free("a")
    bm.free("b")
