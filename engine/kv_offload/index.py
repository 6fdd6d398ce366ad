"""The second tier's index: which cached blocks it holds, in which slot. Pure ints, no torch.

The block manager offers it each cached block that it pops for reuse (its KV about to be
overwritten): the block's KV goes to a slot first. A later prompt whose prefix misses the
first tier asks here for the blocks that follow; each hit is verified on the key parts
(parent hash, tokens, extra keys), as a first-tier hit is, and restored into a fresh block.

The copies themselves are the model runner's (engine/kv_offload/store.py): every step takes
the pending ones (`take_copies`), saves first, then restores, then the forward:

    step N schedule:  pop cached block 7 -> save (7 -> slot 2)     hit slot 5 -> restore (5 -> block 9)
    step N execute:   saves [(7, 2)]  ->  restores [(5, 9)]  ->  forward (may overwrite block 7)

A slot with a restore pending is pinned until the step's copies are taken, so a save in the
same schedule never reuses it. Slots are handed out lowest first, evicted least recently
used (a hit or a repeated save counts as a use).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(slots=True)
class OffloadEntry:
    """A saved block: its slot and the key parts its hash covers (for verification)."""

    slot: int
    parent_hash: int
    token_ids: tuple[int, ...]
    extra_keys: tuple

    def matches(self, parent_hash: int, token_ids: tuple[int, ...], extra_keys: tuple) -> bool:
        return self.token_ids == token_ids and self.parent_hash == parent_hash and self.extra_keys == extra_keys


class OffloadIndex:
    """Block hash -> slot, LRU, at most `num_slots` entries. Not thread-safe: the block
    manager is its only caller."""

    def __init__(self, num_slots: int) -> None:
        if num_slots <= 0:
            raise ValueError(f"num_slots must be > 0, got {num_slots}")
        self.num_slots = num_slots
        self._entries: OrderedDict[int, OffloadEntry] = OrderedDict()  # least recently used first
        self._free_slots = list(range(num_slots - 1, -1, -1))  # popped from the end: lowest first
        self._pinned: set[int] = set()
        self._saves: list[tuple[int, int]] = []  # (block_id, slot), this step
        self._restores: list[tuple[int, int]] = []  # (slot, block_id), this step

    def __len__(self) -> int:
        return len(self._entries)

    def save(self, block_hash: int, parent_hash: int, token_ids: tuple[int, ...], extra_keys: tuple,
             block_id: int) -> int | None:
        """Record that `block_id`'s KV goes to a slot before the next forward; returns the slot,
        or None when nothing is copied: the tier holds this block already (a use, for the LRU),
        or every slot is pinned by this step's restores. A colliding hash (another block's key
        parts) keeps the block saved first, as the first tier does."""
        entry = self._entries.get(block_hash)
        if entry is not None:
            if entry.matches(parent_hash, token_ids, extra_keys):
                self._entries.move_to_end(block_hash)
            return None
        slot = self._take_slot()
        if slot is None:
            return None
        self._entries[block_hash] = OffloadEntry(slot, parent_hash, token_ids, extra_keys)
        self._saves.append((block_id, slot))
        return slot

    def lookup(self, block_hash: int, parent_hash: int, token_ids: tuple[int, ...], extra_keys: tuple) -> int | None:
        """The slot holding this block, verified on its key parts; None on a miss. Changes nothing."""
        entry = self._entries.get(block_hash)
        if entry is None or not entry.matches(parent_hash, token_ids, extra_keys):
            return None
        return entry.slot

    def hold(self, block_hash: int) -> int:
        """Pin the slot of `block_hash` (found by `lookup`) until this step's copies are taken,
        so that saves meanwhile never reuse it; a use, for the LRU. Returns the slot."""
        entry = self._entries[block_hash]
        self._entries.move_to_end(block_hash)
        self._pinned.add(entry.slot)
        return entry.slot

    def restore(self, block_hash: int, block_id: int) -> int:
        """Record that the slot of `block_hash` (found by `lookup`) goes into `block_id` before
        the next forward; holds the slot until then. Returns the slot."""
        slot = self.hold(block_hash)
        self._restores.append((slot, block_id))
        return slot

    def take_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """This step's (block_id, slot) saves and (slot, block_id) restores, in order; clears them
        and unpins the slots."""
        saves, restores = self._saves, self._restores
        self._saves, self._restores = [], []
        self._pinned.clear()
        return saves, restores

    def forget(self, slots: set[int]) -> None:
        """Drop the entries in these slots (their bytes cannot be trusted: a save failed)."""
        for block_hash in [h for h, e in self._entries.items() if e.slot in slots]:
            self._drop(block_hash)

    def reset(self) -> None:
        """Forget every entry (the KV they hold is stale: new weights, or the cache dropped)."""
        self._entries.clear()
        self._free_slots = list(range(self.num_slots - 1, -1, -1))
        self._saves, self._restores = [], []
        self._pinned.clear()

    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent (for tests)."""
        used = [e.slot for e in self._entries.values()]
        if len(set(used)) != len(used) or set(used) & set(self._free_slots):
            raise AssertionError("a slot is used twice, or both used and free")
        if len(used) + len(self._free_slots) != self.num_slots:
            raise AssertionError("slots lost")

    def _take_slot(self) -> int | None:
        if self._free_slots:
            return self._free_slots.pop()
        for block_hash, entry in self._entries.items():  # least recently used first
            if entry.slot not in self._pinned:
                del self._entries[block_hash]
                return entry.slot
        return None

    def _drop(self, block_hash: int) -> None:
        self._free_slots.append(self._entries.pop(block_hash).slot)
