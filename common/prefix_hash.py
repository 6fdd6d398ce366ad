"""The prefix cache's block keys, computed the same way in every process: the engine's block
manager caches blocks under them, and a frontend routes a prompt to the engine that holds
its prefix (frontend/router.py)."""

from __future__ import annotations

import array
import hashlib
from collections.abc import Sequence

ROOT_HASH = None  # parent hash of a sequence's first block


def hash_block(parent_hash: int | None, token_ids: Sequence[int], extra_keys: tuple) -> int:
    """Chained content hash of one full block, the same in every process (about 2 µs).
    `extra_keys` must repr the same everywhere (ints, strings). Module-level so tests can
    force collisions; a hit is verified against the block's tokens anyway."""
    digest = hashlib.blake2b(digest_size=8)
    digest.update((parent_hash or 0).to_bytes(8, "little"))
    digest.update(array.array("q", token_ids).tobytes())
    if extra_keys:
        digest.update(repr(extra_keys).encode())
    return int.from_bytes(digest.digest(), "little")


def block_extra_keys(lora_name: str | None, lora_path: str | None = None) -> tuple:
    """The prefix-cache extra keys of a request's blocks (hash_block):
    () for the base model, so its hashes stay what they were; for an adapter its name and
    the engine's path to it (`LoraAdapter.path`), so base and adapter requests never share
    KV, and an adapter unloaded and loaded again from another folder never hits stale blocks."""
    if not lora_name:
        return ()
    return ("lora", lora_name, lora_path or "")
