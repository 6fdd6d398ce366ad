"""The sampler's stage of per-request logit edits (SamplingParams.uses_logit_rules), in vLLM's
order, before penalties and sampling:

    allowed_token_ids: every other token -inf
    bad_words:         a word's last token -inf where the output ends with the rest of the word
                       (a one-token word: always)
    logit_bias:        added to its token's logit

Each row's edits read only its own parameters and output tokens, so a request samples the
same tokens whatever it is batched with. A verification row's output includes the drafts
before it (engine/sampling_batch.py), so speculative decoding verifies drafts against the
same edited logits as plain decoding samples from: the output is the same with and without it.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.sampling_batch import LOGIT_RULES, SamplingBatch


def apply_logit_rules(logits: torch.Tensor, rows: SamplingBatch) -> None:
    """In place, on the rows that have rules. Token ids past the logits' columns (a tokenizer
    larger than the LM head) cannot be sampled anyway: they are skipped."""
    vocab_size = logits.shape[-1]
    allowed: dict[int, list[int]] = {}  # row -> the tokens it may sample
    banned: list[tuple[int, int]] = []  # (row, token)
    biased: list[tuple[int, int, float]] = []  # (row, token, bias)
    for i in np.flatnonzero(rows.flag(LOGIT_RULES)).tolist():
        params = rows.params[i]
        if params.allowed_token_ids is not None:
            allowed[i] = [t for t in params.allowed_token_ids if t < vocab_size]
        banned.extend((i, t) for t in banned_tokens(params.bad_words_token_ids, rows.output_token_ids[i])
                      if t < vocab_size)
        biased.extend((i, t, b) for t, b in (params.logit_bias or {}).items() if t < vocab_size)
    if allowed:
        mask = torch.ones(len(allowed), vocab_size, dtype=torch.bool)
        for k, tokens in enumerate(allowed.values()):
            mask[k, tokens] = False
        index = _index(list(allowed), logits)
        logits[index] = logits[index].masked_fill_(mask.to(logits.device), float("-inf"))
    if banned:
        row_idx, token_idx = zip(*banned)
        logits[_index(row_idx, logits), _index(token_idx, logits)] = float("-inf")
    if biased:
        row_idx, token_idx, biases = zip(*biased)
        logits[_index(row_idx, logits), _index(token_idx, logits)] += torch.tensor(
            biases, dtype=logits.dtype, device=logits.device)


def banned_tokens(words: list[list[int]], output: list[int]) -> list[int]:
    """vLLM's bad-words rule: the last token of each word whose other tokens end the output."""
    out = []
    for word in words:
        prefix = word[:-1]
        if len(prefix) <= len(output) and output[len(output) - len(prefix):] == prefix:
            out.append(word[-1])
    return out


def _index(ids, like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.long, device=like.device)
