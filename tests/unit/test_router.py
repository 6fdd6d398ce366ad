"""Routing over engines (frontend/router.py): policies, the block LRU, SGLang's balance rule,
the circuit breaker. Pure logic, exact decisions."""

from __future__ import annotations

import pytest

from engine.block_manager import BlockManager
from frontend.router import (BlockLRU, CacheAware, CircuitBreaker, EngineView, LeastLoaded, RoundRobin,
                             is_unbalanced, make_policy, prompt_block_hashes)


def views(*loads: int, capacity: int = 100) -> list[EngineView]:
    return [EngineView(f"e{i}", n, capacity) for i, n in enumerate(loads)]


def test_block_hashes_are_the_engines_prefix_cache_keys():
    """Blocks the frontend hashes are exactly the ones the engine's cache looks up."""
    bm = BlockManager(num_blocks=16, block_size=4)
    prompt = list(range(100, 114))  # 3 full blocks + 2; the last token is never served from cache
    bm.allocate("a", prompt, len(prompt))
    hashes = prompt_block_hashes(prompt, 4)
    assert len(hashes) == 3
    assert hashes == bm._seqs["a"].block_hashes
    assert prompt_block_hashes(prompt[:13], 4) == hashes  # 13 tokens: block 3 holds the last one
    assert prompt_block_hashes(prompt[:12], 4) == hashes[:2]
    assert prompt_block_hashes([1], 4) == []


def test_block_lru_matches_leading_blocks_and_evicts_oldest():
    lru = BlockLRU(capacity=4)
    lru.insert([1, 2, 3])
    assert lru.match([1, 2, 3, 4]) == 3
    assert lru.match([9, 1, 2]) == 0  # a match starts at the first block
    lru.insert([7, 8])  # 5 hashes: the oldest goes, which is the tail of the first prompt
    assert len(lru) == 4 and 3 not in lru
    assert lru.match([1, 2, 3]) == 2


def test_round_robin_cycles():
    rr = RoundRobin()
    assert [rr.choose(views(0, 0, 0), []).address for _ in range(4)] == ["e0", "e1", "e2", "e0"]


def test_least_loaded_against_capacity_then_kv_usage():
    ll = LeastLoaded()
    assert ll.choose(views(5, 2, 9), []).address == "e1"
    # Twice the KV pool holds twice the requests: 6/200 < 4/100.
    engines = [EngineView("small", 4, 100), EngineView("big", 6, 200)]
    assert ll.choose(engines, []).address == "big"
    tied = [EngineView("a", 1, 100, kv_usage=0.5), EngineView("b", 1, 100, kv_usage=0.1)]
    assert ll.choose(tied, []).address == "b"


def test_balance_rule_needs_both_thresholds():
    assert not is_unbalanced(views(20, 10), abs_threshold=16, rel_threshold=1.5)  # diff 10
    assert not is_unbalanced(views(100, 80), abs_threshold=16, rel_threshold=1.5)  # ratio 1.25
    assert is_unbalanced(views(40, 10), abs_threshold=16, rel_threshold=1.5)
    assert is_unbalanced(views(17, 0), abs_threshold=16, rel_threshold=1.5)


def test_cache_aware_follows_the_longest_prefix():
    policy = CacheAware(cache_threshold=0.3)
    shared = list(range(64))  # 4 blocks of 16
    a = prompt_block_hashes(shared + [1000, 1001], 16)
    first = policy.choose(views(0, 0), a)
    assert first.num_matched_blocks == 0
    # A new prefix goes to the engine caching the fewest blocks: the other one.
    other = policy.choose(views(0, 0), prompt_block_hashes(list(range(500, 564)) + [1], 16))
    assert other.address != first.address and other.num_matched_blocks == 0
    # The same prefix with another tail returns to the first engine, even when a bit busier.
    again = policy.choose(views(3, 0) if first.address == "e0" else views(0, 3),
                          prompt_block_hashes(shared + [2000, 2001, 2002], 16))
    assert (again.address, again.num_matched_blocks) == (first.address, 4)


def test_cache_aware_below_threshold_goes_to_the_roomiest():
    policy = CacheAware(cache_threshold=0.5)
    hashes = prompt_block_hashes(list(range(160)) + [1], 16)  # 10 blocks
    policy.choose(views(0, 0), hashes)  # e0 caches all 10
    policy.choose(views(0, 0), prompt_block_hashes(list(range(900, 916)) + [1], 16))  # e1 caches 1
    # Only 2 of 10 blocks match on e0 (20% < 50%): the engine caching fewer blocks gets it.
    partial = prompt_block_hashes(list(range(32)) + list(range(5000, 5128)) + [1], 16)
    assert policy.choose(views(0, 0), partial).address == "e1"


def test_cache_aware_unbalanced_load_wins_over_the_prefix():
    policy = CacheAware(balance_abs_threshold=4, balance_rel_threshold=1.5)
    hashes = prompt_block_hashes(list(range(64)) + [1], 16)
    assert policy.choose(views(0, 0), hashes).address == "e0"
    hit = policy.choose(views(4, 0), hashes)  # diff 4: not past the threshold
    assert (hit.address, hit.num_matched_blocks) == ("e0", 4)
    moved = policy.choose(views(5, 0), hashes)
    assert (moved.address, moved.num_matched_blocks) == ("e1", 0)


def test_cache_aware_short_prompt_goes_to_least_loaded_and_forget_drops_a_cache():
    policy = CacheAware()
    assert policy.choose(views(3, 1), [1, 2][:0]).address == "e1"
    hashes = prompt_block_hashes(list(range(64)) + [1], 16)
    address = policy.choose(views(0, 0), hashes).address
    policy.forget(address)
    assert policy.choose([EngineView(address, 0, 100)], hashes).num_matched_blocks == 0


def test_cache_aware_lru_bounded_by_engine_capacity():
    policy = CacheAware()
    policy.choose([EngineView("e0", 0, capacity=3)], prompt_block_hashes(list(range(100)) + [1], 16))
    assert len(policy.caches["e0"]) == 3


def test_make_policy():
    assert isinstance(make_policy("cache_aware"), CacheAware)
    with pytest.raises(ValueError, match="round_robin"):
        make_policy("random")


def test_circuit_breaker_opens_backs_off_and_probes():
    cb = CircuitBreaker(failure_threshold=3, backoff_s=1.0, max_backoff_s=3.0)
    cb.record_failure(0.0)
    cb.record_failure(0.1)
    assert cb.available(0.2)
    cb.record_failure(0.2)  # the third in a row opens it
    assert cb.state(0.3) == "open" and not cb.available(1.1)
    assert cb.state(1.3) == "half_open" and cb.available(1.3)
    cb.on_routed(1.3)  # the probe: one at a time
    assert not cb.available(1.4)
    cb.record_failure(1.5)  # the probe failed: back-off doubles
    assert not cb.available(3.4) and cb.available(3.6)
    cb.on_routed(3.6)
    cb.record_failure(3.7)
    assert cb.backoff_s == 3.0  # capped
    assert not cb.available(6.6) and cb.available(6.8)
    cb.record_success()
    assert cb.state(6.8) == "closed" and cb.available(6.8) and cb.backoff_s == 1.0
    cb.record_failure(7.0)
    assert cb.available(7.0)  # one failure after a success does not open it


def test_circuit_breaker_abandoned_probe_allows_another():
    cb = CircuitBreaker(failure_threshold=1, backoff_s=1.0)
    cb.record_failure(0.0)
    cb.on_routed(1.0)  # a probe whose outcome never comes (its client left)
    assert not cb.available(1.5) and cb.available(2.0)
