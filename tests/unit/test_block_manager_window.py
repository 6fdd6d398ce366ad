"""BlockManager with a sliding window (every layer windowed): blocks wholly behind the
window of a sequence's next tokens are released, with exact block ids, ref counts and free
counts; prefix-cache hits, forks, preemption and the invariants stay right."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.block_manager import FREED_BLOCK, BlockManager
from unit.test_block_manager_decode import _ops, _Sim, run_random_operations

BS, W = 4, 6  # a query at position p sees p - 5 .. p
X = FREED_BLOCK


def make(num_blocks: int = 10, caching: bool = True, window: int | None = W) -> BlockManager:
    return BlockManager(num_blocks, block_size=BS, enable_prefix_caching=caching, sliding_window=window)


def decode_to(bm: BlockManager, seq_id: str, toks: list[int], end: int) -> None:
    """Decode one token at a time until `end` tokens are computed."""
    while len(toks) < end:
        toks.append(1000 + len(toks))
        assert bm.append_slots(seq_id, toks, len(toks), len(toks) - 1)
        bm.check_invariants()


def test_decode_releases_blocks_behind_the_window():
    bm = make(caching=False)
    toks = list(range(10))
    assert bm.allocate("a", toks, 10)
    assert bm.block_table("a") == [0, 1, 2]
    decode_to(bm, "a", toks, 11)  # writes position 10: sees 5..10, block 0 (0..3) is behind
    assert bm.block_table("a") == [X, 1, 2]
    assert bm.ref_count(0) == 0 and bm.num_free_blocks == 8
    decode_to(bm, "a", toks, 13)  # position 12 needs block 3; it sees 7..12: block 1 stays
    assert bm.block_table("a") == [X, 1, 2, 3]
    decode_to(bm, "a", toks, 14)  # position 13 sees 8..13
    assert bm.block_table("a") == [X, X, 2, 3]
    assert bm.num_free_blocks == 8


def test_a_long_generation_holds_a_bounded_number_of_blocks():
    bm = make(num_blocks=3, caching=False)
    toks = list(range(5))
    assert bm.allocate("a", toks, 5)
    peak = 0
    for end in range(6, 400):
        decode_to(bm, "a", toks, end)
        peak = max(peak, bm.num_blocks - bm.num_free_blocks)
    assert peak == bm.window_peak_blocks(1) == 3  # ceil((W - 1 + 1) / BS) + 1
    assert len(bm.block_table("a")) == 100  # positions still map to entries
    bm.free("a")
    assert bm.num_free_blocks == 3


def test_released_room_counts_toward_the_step():
    bm = make(num_blocks=2, caching=False, window=4)
    toks = list(range(8))
    assert bm.allocate("a", toks, 8)
    assert bm.num_free_blocks == 0
    toks.append(8)  # position 8 sees 5..8: block 0 goes, and is reused for block 2
    assert bm.append_slots("a", toks, 9, 8)
    assert bm.block_table("a") == [X, 1, 0]
    assert bm.ref_count(0) == 1 and bm.num_free_blocks == 0


def test_a_short_pool_changes_nothing():
    bm = make(num_blocks=3, caching=False, window=12)
    assert bm.allocate("a", list(range(12)), 12)
    toks = list(range(13))  # position 12 sees 1..12: nothing released, no room for block 3
    before = bm.block_table("a")
    assert not bm.append_slots("a", toks, 13, 12)
    assert bm.block_table("a") == before and bm.num_free_blocks == 0


def test_released_cached_blocks_stay_hittable():
    bm = make()
    toks = list(range(20))
    assert bm.allocate("a", toks, 20)
    decode_to(bm, "a", toks, 21)  # position 20 sees 15..20: blocks 0, 1, 2 released
    assert bm.block_table("a") == [X, X, X, 3, 4, 5]
    assert [bm.ref_count(b) for b in (0, 1, 2)] == [0, 0, 0] and bm.num_free_blocks == 7
    computed, num_cached = bm.get_computed_blocks(list(range(20)))
    assert computed == [0, 1, 2, 3] and num_cached == 16
    # b computes 16..19, which see 11..: blocks 0 and 1 are not even referenced.
    assert bm.allocate("b", list(range(20)), 20, computed)
    assert bm.block_table("b") == [X, X, 2, 3, 6]
    assert [bm.ref_count(b) for b in (0, 1, 2, 3)] == [0, 0, 1, 2]
    assert bm.num_free_blocks == 5
    bm.check_invariants()
    bm.free("a")
    bm.free("b")
    assert bm.num_free_blocks == 10
    assert bm.get_computed_blocks(list(range(20)))[0] == [0, 1, 2, 3]  # still cached
    bm.check_invariants()


def test_fork_shares_live_entries_only():
    bm = make(caching=False)
    toks = list(range(10))
    assert bm.allocate("a", toks, 10)
    decode_to(bm, "a", toks, 14)
    bm.fork("a", "b")
    assert bm.block_table("b") == [X, X, 2, 3]
    assert bm.ref_count(2) == bm.ref_count(3) == 2 and bm.ref_count(1) == 0
    toks_b = list(toks)
    decode_to(bm, "b", toks_b, 15)  # position 14 (sees 9..14) is in shared block 3: copied
    assert bm.block_table("b") == [X, X, 2, 4]
    assert bm.take_blocks_to_copy() == [(3, 4)]
    assert bm.ref_count(2) == 2 and bm.ref_count(3) == 1
    decode_to(bm, "b", toks_b, 17)  # position 16 sees 11..16: block 2 still visible
    decode_to(bm, "b", toks_b, 18)  # position 17 sees 12..17: b drops its share of block 2
    assert bm.block_table("b") == [X, X, X, 4, 5]
    assert bm.ref_count(2) == 1
    bm.free("a")
    bm.free("b")
    assert bm.num_free_blocks == 10
    bm.check_invariants()


def test_preempting_a_windowed_step_frees_everything():
    bm = make()
    toks = list(range(12))
    assert bm.allocate("a", toks, 12)
    toks += [100, 101, 102, 103]  # a chunk of 4 from position 12 (sees 7..): block 0 released
    assert bm.append_slots("a", toks, 16, 12)
    assert bm.block_table("a") == [X, 1, 2, 3]
    bm.free("a", step_discarded=True)  # block 3's hash leaves the cache: never written
    assert bm.num_free_blocks == 10
    assert bm.get_computed_blocks(toks + [7])[0] == [0, 1, 2]
    bm.check_invariants()


def test_window_peak_and_bad_window():
    assert make().window_peak_blocks(1) == 3 and make().window_peak_blocks(8) == 5
    assert make(window=None).window_peak_blocks(8) is None
    with pytest.raises(ValueError, match="sliding_window"):
        make(window=0)


class _WindowSim(_Sim):
    def schedule(self, seq_id: str, start: int, end: int) -> None:
        """The keys this step's first query sees (start - W + 1 .. start - 1) are still held."""
        super().schedule(seq_id, start, end)
        table, toks = self.bm.block_table(seq_id), self.tokens[seq_id]
        source = {dst: src for src, dst in self.pending[1]}  # copy-on-write runs first
        for pos in range(max(0, start - W + 1), start):
            block = table[pos // BS]
            assert self.kv.get((source.get(block, block), pos % BS)) == tuple(toks[:pos + 1]), seq_id

    def check(self) -> None:
        """The KV that each sequence's next query can see is right; older entries are released
        or still held, never wrong."""
        self.bm.check_invariants()
        for seq_id, toks in self.tokens.items():
            table, end = self.bm.block_table(seq_id), self.num_computed[seq_id]
            for pos in range(max(0, end - W + 1), end):
                assert self.kv.get((table[pos // BS], pos % BS)) == tuple(toks[:pos + 1]), seq_id


@settings(max_examples=300, deadline=None)
@given(ops=st.lists(_ops, min_size=5, max_size=50), num_blocks=st.integers(2, 16))
def test_random_operations_keep_invariants(ops, num_blocks):
    run_random_operations(_WindowSim(make(num_blocks)), ops, num_blocks)
