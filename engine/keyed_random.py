"""Counter-based randomness: draws that are a pure function of a key and a column.

A seeded request's randomness at output position p has the key `mix(seed, p)`; its draws for
that position are splitmix64's outputs 1, 2, ... of the stream the key seeds. No generator
state exists anywhere, so a seeded request's tokens depend on neither its batch nor
speculative decoding (which samples several positions in one step and discards rows past a
rejection), and every row of a batch draws in one tensor op, on any device alike.
"""

from __future__ import annotations

import numpy as np
import torch

_MASK64 = (1 << 64) - 1
# splitmix64's constants as int64 (torch has no uint64 arithmetic; int64 wraps the same way).
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)
_MIX1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MIX2 = 0x94D049BB133111EB - (1 << 64)
_UNIFORM_BITS = 23  # float32 holds (x + 0.5) / 2^23 exactly, strictly inside (0, 1)


def mix(seed: int, position: int) -> int:
    """The key of (seed, position): splitmix64, so neighbouring positions get unrelated keys."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & 0x7FFFFFFFFFFFFFFF


def seeded_uniforms(keys: torch.Tensor, num_cols: int) -> torch.Tensor:
    """[R, num_cols] float32 uniforms in (0, 1), entry (r, c) splitmix64's output c + 1 of the
    stream seeded by keys[r] (int64), cut to 23 bits. Rows are independent of each other."""
    cols = torch.arange(1, num_cols + 1, dtype=torch.int64, device=keys.device)
    z = keys[:, None] + cols[None, :] * _GOLDEN
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    z = z ^ _shr(z, 31)
    return (_shr(z, 64 - _UNIFORM_BITS).to(torch.float32) + 0.5) * 2.0 ** -_UNIFORM_BITS


def seeded_exponentials(keys: torch.Tensor, num_cols: int) -> torch.Tensor:
    """[R, num_cols] float32 Exp(1) draws: -log of `seeded_uniforms`."""
    return -torch.log(seeded_uniforms(keys, num_cols))


def _shr(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (>> is arithmetic on signed tensors)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def mix_array(seeds: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """`mix` of each (seed, position) pair: seeds uint64, positions int64; the keys as int64."""
    z = seeds * np.uint64(0x9E3779B97F4A7C15) + positions.astype(np.uint64) + np.uint64(1)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return ((z ^ (z >> np.uint64(31))) & np.uint64(0x7FFFFFFFFFFFFFFF)).astype(np.int64)
