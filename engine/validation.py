"""Checks a prompt against the model and the KV pool; shared by the frontend (before any
stream message) and the engine (which trusts no socket)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.sampling_params import SamplingParams


class EngineOverloaded(Exception):
    """The engine's waiting queue is full; the request may be retried later."""


@dataclass(frozen=True)
class PromptLimits:
    vocab_size: int
    max_model_len: int
    num_kv_blocks: int
    block_size: int


def check_prompt(prompt: list[int], params: SamplingParams, limits: PromptLimits) -> None:
    """Raises ValueError with a message a person can act on."""
    if not prompt:
        raise ValueError("prompt: must contain at least one token")
    bad = next((t for t in prompt if not 0 <= t < limits.vocab_size), None)
    if bad is not None:
        raise ValueError(f"prompt: token id {bad} is outside the vocabulary [0, {limits.vocab_size})")
    bad = next((t for t in params.stop_token_ids if t >= limits.vocab_size), None)
    if bad is not None:
        raise ValueError(f"stop_token_ids: {bad} is outside the vocabulary [0, {limits.vocab_size})")
    total = len(prompt) + (params.max_tokens or 1)
    if total > limits.max_model_len:
        # The engine caps max_model_len at the KV pool's size (a longer sequence would preempt
        # itself forever), so this one check also refuses what could never fit in the cache.
        kv_tokens = limits.num_kv_blocks * limits.block_size
        why = (f"the KV cache's capacity of {kv_tokens} tokens ({limits.num_kv_blocks} blocks of "
               f"{limits.block_size}); it can never fit" if kv_tokens <= limits.max_model_len else
               f"the model's maximum length of {limits.max_model_len} tokens")
        raise ValueError(
            f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) = {total} exceeds "
            f"{why}; shorten the prompt or lower max_tokens")
