"""Verify draft tokens against the target model: lossless rejection sampling and greedy matching.

Layout, for one row b with K = 3 draft slots and num_drafts[b] = 2 (d = draft, . = padding):

    draft_token_ids[b]   d0   d1   .
    target_probs[b]      p0   p1   p2   .     p_j: the target's next-token probs after
    draft_probs[b]       q0   q1   .          the prefix plus d0..d_{j-1}

    accept d_j with probability min(1, p_j(d_j) / q_j(d_j)), left to right; then
    at the first rejection j:   emit d0..d_{j-1}, then a draw from norm(max(p_j - q_j, 0))
    if all num_drafts accepted: emit d0..d1, then the bonus token, a draw from p_2

    token_ids[b]         d0   x    -1   -1    num_emitted[b] = 2   (rejected at j = 1)

This emits tokens distributed exactly as sampling the target alone would (Leviathan et al.
2023; vLLM's RejectionSampler). q = None means one-hot drafts (n-gram lookup, greedy draft
model): q_j(d_j) = 1, so d_j is accepted with probability p_j(d_j).

The engine's proposers draft deterministically, and for one-hot drafts the sampler verifies by
coupling instead (engine/sampler.py `_verify`): each row samples as it would alone, and a draft
is kept while it equals the sample. That is this rule exactly (accept with probability p(d);
a rejection emits a sample of p given it is not d, i.e. of the residual), and it keeps a seeded
request's tokens the same with and without speculation. `rejection_sample` is the general rule,
for proposers that sample their drafts from a full q; `greedy_verify` serves both.

Randomness: every row draws K uniforms (acceptance tests, slot j uses uniform j), then one [V]
vector of Exp(1) (the final token's exponential race), however many drafts it has or accepts.
A seeded row's are columns 1..K and K+1..K+V of its key's stream (engine/keyed_random.py), so
the same key and the same drafts give the same tokens whatever the row is batched with, with
no generator per row; unseeded rows draw in one call.
"""

from __future__ import annotations

import torch

from engine.keyed_random import seeded_uniforms


def rejection_sample(target_probs: torch.Tensor, draft_token_ids: torch.Tensor,
                     num_drafts: torch.Tensor, draft_probs: torch.Tensor | None,
                     keys: list[int | None]) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept a prefix of each row's drafts and emit one more token after it.

    target_probs [B, K+1, V]: the target's processed probs (temperature, top-k/p, min-p applied)
    at each verification slot; rows need not sum to 1 (min-p leaves them unnormalised).
    draft_token_ids [B, K]: entries past num_drafts[b] are padding, any value.
    num_drafts [B]: 0..K drafts proposed per row.
    draft_probs [B, K, V] or None: what each draft was sampled from; None means one-hot.
    keys: per row, a seeded request's key (engine/keyed_random.py) or None.

    Returns token_ids [B, K+1] padded with -1, and num_emitted [B] in 1..num_drafts+1.
    """
    batch_size, num_slots, vocab_size = target_probs.shape
    max_drafts = num_slots - 1
    device = target_probs.device
    uniforms, exponentials = _draw(keys, max_drafts, vocab_size, device)
    slots = torch.arange(max_drafts, device=device)
    is_draft = slots < num_drafts.unsqueeze(1)  # [B, K]
    drafts = torch.where(is_draft, draft_token_ids, 0)  # padding may be -1: keep gathers in range

    p = _prob_of(target_probs[:, :max_drafts], drafts)
    q = torch.ones_like(p) if draft_probs is None else _prob_of(draft_probs, drafts)
    accepted = _is_accepted(uniforms, p, q) & is_draft
    # Drafts count only up to the first rejection: cumprod zeroes everything after it.
    num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)

    final_probs = _final_probs(target_probs, drafts, draft_probs, num_accepted, num_drafts)
    final_token = _race(final_probs, exponentials)

    token_ids = torch.full((batch_size, num_slots), -1, dtype=torch.long, device=device)
    token_ids[:, :max_drafts] = torch.where(slots < num_accepted.unsqueeze(1), drafts, -1)
    token_ids.scatter_(1, num_accepted.unsqueeze(1), final_token.unsqueeze(1))
    return token_ids, num_accepted + 1


def greedy_verify(target_token_ids: torch.Tensor, draft_token_ids: torch.Tensor,
                  num_drafts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept drafts while they equal the target's argmax; then emit the target's token at the
    first mismatch, or the bonus token target_token_ids[b, num_drafts[b]] if all matched.

    Accepted drafts equal the target's tokens, so every emitted token is the target's.
    Same shapes and padding as rejection_sample.
    """
    max_drafts = draft_token_ids.shape[1]
    slots = torch.arange(max_drafts, device=draft_token_ids.device)
    matched = (draft_token_ids == target_token_ids[:, :max_drafts]) & (slots < num_drafts.unsqueeze(1))
    num_accepted = matched.long().cumprod(dim=1).sum(dim=1)
    all_slots = torch.arange(max_drafts + 1, device=draft_token_ids.device)
    token_ids = torch.where(all_slots <= num_accepted.unsqueeze(1), target_token_ids, -1)
    return token_ids, num_accepted + 1


def _is_accepted(uniforms: torch.Tensor, p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """u < p / q without the division: u in [0, 1), so p >= q always accepts and p = 0 never
    (q = 0 with p > 0, a draft its own distribution ruled out, counts as an infinite ratio)."""
    return uniforms * q < p


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """What a rejection samples from, unnormalised: the mass p has beyond q."""
    return (p - q).clamp(min=0.0)


def _final_probs(target_probs: torch.Tensor, drafts: torch.Tensor, draft_probs: torch.Tensor | None,
                 num_accepted: torch.Tensor, num_drafts: torch.Tensor) -> torch.Tensor:
    """[B, V], unnormalised: the residual at a rejected slot, the target's probs for a bonus."""
    rows = torch.arange(target_probs.shape[0], device=target_probs.device)
    p = _normalised(target_probs[rows, num_accepted])
    max_drafts = drafts.shape[1]
    if max_drafts == 0:
        return p
    rejected = num_accepted < num_drafts
    slot = num_accepted.clamp(max=max_drafts - 1)  # a bonus row's slot is masked out below
    if draft_probs is None:
        q = torch.zeros_like(p).scatter_(1, drafts[rows, slot].unsqueeze(1), 1.0)
    else:
        q = _normalised(draft_probs[rows, slot])
    residual = _residual(p, q * rejected.unsqueeze(1))
    # p == q up to rounding leaves nothing: p itself is then the right distribution.
    empty = residual.amax(dim=1, keepdim=True) <= 0.0
    return torch.where(empty, p, residual)


def _draw(keys: list[int | None], max_drafts: int, vocab_size: int,
          device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, K] uniforms and [B, V] exponentials; a seeded row's are its key's columns 1..K,
    then K+1..K+V."""
    uniforms = torch.empty(len(keys), max_drafts, device=device).uniform_()
    exponentials = torch.empty(len(keys), vocab_size, device=device).exponential_()
    seeded = [i for i, key in enumerate(keys) if key is not None]
    if seeded:
        index = torch.tensor(seeded, dtype=torch.long, device=device)
        draws = seeded_uniforms(torch.tensor([keys[i] for i in seeded], dtype=torch.int64, device=device),
                                max_drafts + vocab_size)
        uniforms[index] = draws[:, :max_drafts]
        exponentials[index] = -torch.log(draws[:, max_drafts:])
    return uniforms, exponentials


def _race(probs: torch.Tensor, exponentials: torch.Tensor) -> torch.Tensor:
    """argmax(p / E), E ~ Exp(1): a draw from p, normalised or not (engine/sampler.py's race)."""
    # E == 0 would give 0/0 = nan for a zero-probability token, and argmax would pick it.
    return (probs / exponentials.clamp(min=torch.finfo(exponentials.dtype).tiny)).argmax(dim=1)


def _prob_of(probs: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """[B, K, V] probs at [B, K] token ids, normalised by each row's sum (no [B, K, V] copy)."""
    total = probs.sum(dim=-1).clamp(min=torch.finfo(probs.dtype).tiny)
    return probs.gather(2, token_ids.unsqueeze(2)).squeeze(2) / total


def _normalised(probs: torch.Tensor) -> torch.Tensor:
    """Divide by the row sum; all-zero padding rows stay zero instead of becoming nan."""
    return probs / probs.sum(dim=-1, keepdim=True).clamp(min=torch.finfo(probs.dtype).tiny)
