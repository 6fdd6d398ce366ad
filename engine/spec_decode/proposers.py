"""The proposers the engine builds from its config: n-gram lookup or a draft model."""

from __future__ import annotations

from collections.abc import Sequence

from engine.config import EngineConfig
from engine.request import Request
from engine.spec_decode.ngram import NgramProposer
from engine.spec_decode.speculator import Proposer, Speculator


class PromptLookupProposer:
    """NgramProposer over each request's tokens; no state, no KV."""

    def __init__(self, config: EngineConfig) -> None:
        self.ngram = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max,
                                   config.num_speculative_tokens)

    def propose(self, requests: list[Request], max_drafts: list[int], block_tables: list[list[int]],
                blocks_to_copy: Sequence[tuple[int, int]]) -> list[list[int]]:
        return [self.ngram.propose(r.all_token_ids, k) for r, k in zip(requests, max_drafts)]

    def release(self, request_ids: set[str]) -> None:
        pass


def build_speculator(config: EngineConfig, target_runner, max_model_len: int,
                     vocab_limit: int) -> Speculator | None:
    """None when speculative decoding is off."""
    if config.speculative_method is None:
        return None
    proposer: Proposer
    if config.speculative_method == "ngram":
        proposer = PromptLookupProposer(config)
    else:
        from engine.spec_decode.draft import DraftModelProposer
        proposer = DraftModelProposer(config, target_runner, max_model_len)
    return Speculator(proposer, config.num_speculative_tokens, max_model_len, vocab_limit)
