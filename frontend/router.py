"""Which engine runs a request (data parallel): routing policies, the frontend's picture of
each engine's prefix cache, and a circuit breaker per engine. Pure logic over plain values;
the engine pool (frontend/engine_pool.py) feeds it the live engines and acts on its choice.

`cache_aware` follows SGLang's router (sgl-router's cache-aware policy), with its rules:
  1. Load is unbalanced when both (max - min) > balance_abs_threshold and
     max > balance_rel_threshold * min: the least loaded engine takes the request.
  2. Otherwise the engine holding the longest cached prefix takes it, if that prefix is more
     than cache_threshold of the prompt's full blocks.
  3. Otherwise the engine caching the fewest blocks (the most room) takes it.
Where we differ: prefixes are the engine's own block hashes (so a match is what the engine's
prefix cache will hit, unless it evicted the blocks since), kept in a per-engine LRU bounded
by the engine's KV pool instead of a radix tree trimmed on a timer; load is the engine's own
waiting + running count (plus what was sent since it last reported), not only this router's;
a prompt with no full block goes to the least loaded engine (no prefix to place).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from common.multimodal import image_block_keys
from common.prefix_hash import ROOT_HASH, hash_block

POLICIES = ("cache_aware", "least_loaded", "round_robin")


def prompt_block_hashes(prompt: Sequence[int], block_size: int, extra_keys: tuple = ()) -> list[int]:
    """The chained hashes of the prompt's blocks that an engine's prefix cache can serve: the
    full ones, never the one holding the last token (BlockManager.get_computed_blocks).
    `extra_keys`: the engine's for the request's LoRA adapter (engine.lora.block_extra_keys)
    and images (common.multimodal.with_images)."""
    hashes, parent = [], ROOT_HASH
    for i in range((len(prompt) - 1) // block_size):
        parent = hash_block(parent, prompt[i * block_size:(i + 1) * block_size],
                            image_block_keys(extra_keys, i, block_size))
        hashes.append(parent)
    return hashes


@dataclass(slots=True)
class EngineView:
    """What a policy sees of one engine it may route to."""

    address: str
    num_requests: int  # waiting + running, as the engine last reported, plus sent since
    capacity: int = 1  # its KV blocks: a bigger pool holds more requests
    kv_usage: float = 0.0  # 0..1, the tie-breaker

    @property
    def load(self) -> float:
        return self.num_requests / max(1, self.capacity)


@dataclass(slots=True)
class Route:
    """A policy's choice."""

    address: str
    num_matched_blocks: int = 0  # > 0: chosen for a cached prefix this long


class RoutingPolicy(Protocol):
    """Chooses among the routable engines (never empty); `forget` drops what it knows of an
    engine whose cache is gone (lost, restarted, removed)."""

    def choose(self, engines: list[EngineView], block_hashes: list[int]) -> Route: ...

    def forget(self, address: str) -> None: ...

    @property
    def needs_block_hashes(self) -> bool: ...


class RoundRobin:
    needs_block_hashes = False

    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, engines: list[EngineView], block_hashes: list[int]) -> Route:
        return Route(engines[next(self._counter) % len(engines)].address)

    def forget(self, address: str) -> None:
        pass


class LeastLoaded:
    """The lowest requests/capacity; ties go to the emptier KV pool, then rotate."""

    needs_block_hashes = False

    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, engines: list[EngineView], block_hashes: list[int]) -> Route:
        return Route(least_loaded(engines, next(self._counter)).address)

    def forget(self, address: str) -> None:
        pass


def least_loaded(engines: list[EngineView], rotate: int = 0) -> EngineView:
    start = rotate % len(engines)
    rotated = engines[start:] + engines[:start]
    return min(rotated, key=lambda e: (e.load, e.kv_usage))


def is_unbalanced(engines: list[EngineView], abs_threshold: float, rel_threshold: float) -> bool:
    """SGLang's rule: both the absolute and the relative difference of load pass their threshold."""
    loads = [e.num_requests for e in engines]
    high, low = max(loads), min(loads)
    return high - low > abs_threshold and high > rel_threshold * low


class BlockLRU:
    """The block hashes sent to one engine, least recently used first, at most `capacity`
    (the engine's KV pool cannot hold more, so older ones are likely evicted there too)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self._hashes: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._hashes)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._hashes

    def match(self, block_hashes: list[int]) -> int:
        """How many leading blocks are held."""
        n = 0
        while n < len(block_hashes) and block_hashes[n] in self._hashes:
            n += 1
        return n

    def insert(self, block_hashes: list[int]) -> None:
        """Mark these used now (a prefix's first block is evicted last, as in the engine)."""
        for block_hash in reversed(block_hashes):
            self._hashes[block_hash] = None
            self._hashes.move_to_end(block_hash)
        while len(self._hashes) > self.capacity:
            self._hashes.popitem(last=False)


class CacheAware:
    """SGLang's cache-aware rules (module docstring) over per-engine BlockLRUs."""

    needs_block_hashes = True

    def __init__(self, cache_threshold: float = 0.3, balance_abs_threshold: int = 16,
                 balance_rel_threshold: float = 1.5, max_blocks_per_engine: int = 1 << 20) -> None:
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.max_blocks_per_engine = max_blocks_per_engine
        self.caches: dict[str, BlockLRU] = {}
        self._counter = itertools.count()

    def choose(self, engines: list[EngineView], block_hashes: list[int]) -> Route:
        route = self._route(engines, block_hashes)
        self._cache(route.address, engines).insert(block_hashes)
        return route

    def _route(self, engines: list[EngineView], block_hashes: list[int]) -> Route:
        rotate = next(self._counter)
        if not block_hashes or is_unbalanced(engines, self.balance_abs_threshold, self.balance_rel_threshold):
            return Route(least_loaded(engines, rotate).address)
        matches = {e.address: self._cache(e.address, engines).match(block_hashes) for e in engines}
        best = max(engines, key=lambda e: (matches[e.address], -e.load))
        num_matched = matches[best.address]
        if num_matched and num_matched / len(block_hashes) > self.cache_threshold:
            return Route(best.address, num_matched)
        start = rotate % len(engines)
        rotated = engines[start:] + engines[:start]
        roomiest = min(rotated, key=lambda e: (len(self._cache(e.address, engines)), e.load))
        return Route(roomiest.address)

    def _cache(self, address: str, engines: list[EngineView]) -> BlockLRU:
        cache = self.caches.get(address)
        if cache is None:
            capacity = next((e.capacity for e in engines if e.address == address), self.max_blocks_per_engine)
            cache = self.caches[address] = BlockLRU(min(capacity, self.max_blocks_per_engine))
        return cache

    def forget(self, address: str) -> None:
        self.caches.pop(address, None)


def make_policy(name: str) -> RoutingPolicy:
    if name == "cache_aware":
        return CacheAware()
    if name == "least_loaded":
        return LeastLoaded()
    if name == "round_robin":
        return RoundRobin()
    raise ValueError(f"unknown routing policy {name!r}; choose one of {', '.join(POLICIES)}")


class CircuitBreaker:
    """Skips an engine that keeps failing (lost, or overloaded, `failure_threshold` times in a
    row without a success between):

        closed ──failures──► open (backoff_s) ──► half-open: one probe request
          ▲                     ▲                    │ success        │ failure
          └─────────────────────┼────────────────────┘                │
                                └──── backoff doubled, up to max ─────┘
    """

    def __init__(self, failure_threshold: int = 3, backoff_s: float = 1.0, max_backoff_s: float = 30.0) -> None:
        self.failure_threshold = failure_threshold
        self.base_backoff_s, self.max_backoff_s = backoff_s, max_backoff_s
        self.backoff_s = backoff_s
        self.num_failures = 0  # in a row
        self.open_until: float | None = None  # None: closed
        self.probe_until = 0.0  # half-open: no second probe before this

    def state(self, now: float) -> str:
        if self.open_until is None:
            return "closed"
        return "open" if now < self.open_until else "half_open"

    def available(self, now: float) -> bool:
        state = self.state(now)
        return state == "closed" or (state == "half_open" and now >= self.probe_until)

    def on_routed(self, now: float) -> None:
        """A request was sent; in half-open it is the probe, and the only one for a while."""
        if self.state(now) == "half_open":
            self.probe_until = now + self.backoff_s

    def record_success(self) -> None:
        self.num_failures, self.open_until = 0, None
        self.backoff_s = self.base_backoff_s

    def record_failure(self, now: float) -> None:
        state = self.state(now)
        self.num_failures += 1
        if state == "half_open":  # the probe failed
            self.backoff_s = min(self.backoff_s * 2, self.max_backoff_s)
            self.open_until = now + self.backoff_s
        elif state == "closed" and self.num_failures >= self.failure_threshold:
            self.open_until = now + self.backoff_s
