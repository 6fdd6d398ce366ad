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
        raise ValueError(
            f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) = {total} exceeds "
            f"the model's maximum length of {limits.max_model_len} tokens; shorten the prompt or "
            f"lower max_tokens")
    if -(-total // limits.block_size) > limits.num_kv_blocks:
        raise ValueError(
            f"prompt + max_tokens = {total} tokens can never fit in the KV cache "
            f"({limits.num_kv_blocks} blocks of {limits.block_size} tokens)")
