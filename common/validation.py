"""Checks a prompt against the model and the KV pool; shared by the frontend (before any
stream message) and the engine (which trusts no socket)."""

from __future__ import annotations

from dataclasses import dataclass

from common.errors import InvalidRequest
from common.sampling_params import SamplingParams


@dataclass(frozen=True)
class PromptLimits:
    vocab_size: int
    max_model_len: int
    num_kv_blocks: int
    block_size: int


def check_prompt(prompt: list[int], params: SamplingParams, limits: PromptLimits, field: str = "prompt") -> None:
    """Raises InvalidRequest with a message a person can act on; `field` names the prompt as
    the caller's API does."""
    if not prompt:
        raise InvalidRequest(f"{field}: must contain at least one token")
    bad = next((t for t in prompt if isinstance(t, bool) or not isinstance(t, int)
                or not 0 <= t < limits.vocab_size), None)
    if bad is not None:
        raise InvalidRequest(f"{field}: token id {bad!r} is outside the vocabulary [0, {limits.vocab_size})")
    bad = next((t for t in params.stop_token_ids if t >= limits.vocab_size), None)
    if bad is not None:
        raise InvalidRequest(f"stop_token_ids: {bad} is outside the vocabulary [0, {limits.vocab_size})")
    for name, ids in (("logit_bias", params.logit_bias or ()), ("allowed_token_ids", params.allowed_token_ids or ()),
                      ("bad_words", (t for word in params.bad_words_token_ids for t in word))):
        bad = next((t for t in ids if t >= limits.vocab_size), None)
        if bad is not None:
            raise InvalidRequest(f"{name}: token id {bad} is outside the vocabulary [0, {limits.vocab_size})")
    total = len(prompt) + (params.max_tokens or 1)
    if total > limits.max_model_len:
        # The engine caps max_model_len at the KV pool's size (a longer sequence would preempt
        # itself forever; not with every layer windowed, where a sequence holds a bounded number
        # of blocks), so this one check also refuses what could never fit in the cache.
        kv_tokens = limits.num_kv_blocks * limits.block_size
        why = (f"the KV cache's capacity of {kv_tokens} tokens ({limits.num_kv_blocks} blocks of "
               f"{limits.block_size}); it can never fit" if kv_tokens == limits.max_model_len else
               f"the model's maximum length of {limits.max_model_len} tokens")
        raise InvalidRequest(
            f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) = {total} exceeds "
            f"{why}; shorten the prompt or lower max_tokens")


def check_pooling_prompt(prompt: list[int], vocab_size: int, max_tokens: int, field: str = "input") -> None:
    """A pooling request's prompt (embed, score): it runs whole in one step, so it must fit
    both the model's length and the engine's step budget (`max_tokens`, the smaller)."""
    if not prompt:
        raise InvalidRequest(f"{field}: must contain at least one token")
    bad = next((t for t in prompt if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequest(f"{field}: token id {bad!r} is outside the vocabulary [0, {vocab_size})")
    if len(prompt) > max_tokens:
        raise InvalidRequest(f"{field}: {len(prompt)} tokens is more than the {max_tokens} this model takes; "
                             "shorten it or set truncate_prompt_tokens to truncate it")
