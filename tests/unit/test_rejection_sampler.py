"""Speculative decoding's verification: rejection sampling is lossless, greedy matching exact.

The statistical tests use a toy Markov chain: the target's next-token distribution is P[prev]
and the draft's Q[prev], both small random tables with zeros in them. Each of NUM_SEQS
sequences starts from a random token t_0, gets K drafts and a random num_drafts, and all are
verified in one batched call. Lossless means: among sequences that emitted at least i tokens,

    t_i | t_{i-2}, t_{i-1}   ~   P[t_{i-1}]

Whether a sequence reached position i is settled by the slots before it (drafts accepted so
far, num_drafts), never by the token drawn at i, so restricting to those sequences is unbiased.
Together these conditionals give the chain's joint law of the emitted tokens; position 2 given
t_0 is the joint of the first two. (The plain joint of (t_1, t_2) over sequences that emitted
two tokens would not do: accepting t_1 as a draft tilts its law.) A chi-square test checks each
position, conditioning on t_{i-2} too so that a dependence on more than the last token shows.
Negative controls patch in broken samplers and require the same test to fail them.
"""

from __future__ import annotations

import math

import pytest
import torch

from engine import rejection_sampler as rejection
from engine.keyed_random import mix, seeded_uniforms
from engine.rejection_sampler import greedy_verify, rejection_sample

VOCAB = 8
K = 3  # draft slots
NUM_SEQS = 100_000
CHI2_Z = 5.0  # the threshold's z-score: a correct sampler fails a position once in ~3.5 million


@pytest.fixture(autouse=True)
def _seed_global_rng():
    torch.manual_seed(1234)


def markov_tables(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """P (target) and Q (draft), [V, V] float64 rows summing to 1. About a quarter of P is zero,
    including the draft's favourite token on half the rows, so drafts with p = 0 happen, and Q
    has zeros where P has mass, so the residual max(p - q, 0) matters."""
    gen = torch.Generator().manual_seed(seed)
    concentration = torch.ones(VOCAB, VOCAB, dtype=torch.float64)
    p = torch.distributions.Dirichlet(concentration).sample()  # the global RNG, seeded above
    q = torch.distributions.Dirichlet(concentration * 0.5).sample()
    p = p.where(torch.rand(VOCAB, VOCAB, generator=gen, dtype=torch.float64) > 0.25, 0.0)
    rows = torch.arange(0, VOCAB, 2)
    p[rows, q[rows].argmax(dim=1)] = 0.0
    q = q.where(torch.rand(VOCAB, VOCAB, generator=gen, dtype=torch.float64) > 0.2, 0.0)
    # A floor on the mass left keeps most chi-square cells' expected counts above 5.
    p = torch.where(p > 0, p + 0.05, 0.0)
    p[p.sum(dim=1) == 0, 0] = 1.0
    q[q.sum(dim=1) == 0, 1] = 1.0
    return p / p.sum(dim=1, keepdim=True), q / q.sum(dim=1, keepdim=True)


def speculate(p: torch.Tensor, q: torch.Tensor, drafter: str, num_seqs: int = NUM_SEQS) -> dict:
    """Draft and verify in one call. drafter: 'argmax' (the argmax of Q, passed as one-hot),
    'onehot' (sampled from Q, passed as one-hot) or 'sampled' (sampled from Q, passed with Q)."""
    start = torch.randint(VOCAB, (num_seqs,))
    num_drafts = torch.randint(K + 1, (num_seqs,))
    contexts = [start]  # contexts[j]: the token before slot j
    for _ in range(K):
        prev = contexts[-1]
        contexts.append(q[prev].argmax(dim=1) if drafter == "argmax"
                        else torch.multinomial(q[prev], 1).squeeze(1))
    contexts = torch.stack(contexts, dim=1)  # [N, K+1]
    slots = torch.arange(K + 1)
    # Padding past num_drafts: -1 drafts and zero probs, which a sampler must never read.
    drafts = contexts[:, 1:].where(slots[:K] < num_drafts.unsqueeze(1), -1)
    target_probs = p[contexts].float() * (slots <= num_drafts.unsqueeze(1)).unsqueeze(2)
    draft_probs = None
    if drafter == "sampled":
        draft_probs = q[contexts[:, :K]].float() * (slots[:K] < num_drafts.unsqueeze(1)).unsqueeze(2)
    token_ids, num_emitted = rejection_sample(target_probs, drafts, num_drafts, draft_probs,
                                              [None] * num_seqs)
    seq = torch.cat([start.unsqueeze(1), token_ids], dim=1)  # [N, K+2]: t_0 .. t_{K+1}
    return dict(token_ids=token_ids, num_emitted=num_emitted, num_drafts=num_drafts,
                drafts=drafts, seq=seq)


def chi2_ratio(out: dict, p: torch.Tensor, position: int) -> float:
    """Chi-square of t_i given (t_{i-2}, t_{i-1}) against P[t_{i-1}], over sequences that
    emitted t_i, divided by its z = CHI2_Z threshold (Wilson-Hilferty): below 1 passes.
    Cells expecting < 5 are pooled."""
    seq = out["seq"][out["num_emitted"] >= position]
    before = seq[:, position - 2] if position >= 2 else torch.zeros_like(seq[:, 0])
    prev, nxt = seq[:, position - 1], seq[:, position]
    context = before * VOCAB + prev
    observed = torch.bincount(context * VOCAB + nxt, minlength=VOCAB ** 3).double().view(-1, VOCAB)
    per_context = observed.sum(dim=1, keepdim=True)
    expected = per_context * p[torch.arange(VOCAB ** 2) % VOCAB]
    impossible = observed[expected == 0].sum().item()
    assert impossible == 0, f"position {position}: {impossible:.0f} tokens with target prob 0"
    big = expected >= 5
    stat = ((observed[big] - expected[big]) ** 2 / expected[big]).sum().item()
    num_terms = int(big.sum())
    small_obs, small_exp = observed[~big & (expected > 0)].sum(), expected[~big & (expected > 0)].sum()
    if small_exp > 0:
        stat += ((small_obs - small_exp) ** 2 / small_exp).item()
        num_terms += 1
    df = max(num_terms - int((per_context > 0).sum()), 1)
    a = 2 / (9 * df)
    return stat / (df * (1 - a + CHI2_Z * math.sqrt(a)) ** 3)


def worst_chi2_ratio(out: dict, p: torch.Tensor) -> float:
    return max(chi2_ratio(out, p, i) for i in range(1, K + 2))


def check_layout(out: dict) -> None:
    """Accepted drafts come first, one sampled token follows, -1 pads the rest."""
    token_ids, num_emitted, num_drafts = out["token_ids"], out["num_emitted"], out["num_drafts"]
    assert torch.all((num_emitted >= 1) & (num_emitted <= num_drafts + 1))
    slots = torch.arange(K + 1)
    assert torch.all((token_ids == -1) == (slots >= num_emitted.unsqueeze(1)))
    accepted = slots[:K] < (num_emitted - 1).unsqueeze(1)
    assert torch.equal(token_ids[:, :K][accepted], out["drafts"][accepted])


DRAFTERS = ["argmax", "onehot", "sampled"]


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_emitted_tokens_follow_the_target_chain(drafter):
    p, q = markov_tables(seed=7)
    out = speculate(p, q, drafter)
    check_layout(out)
    assert worst_chi2_ratio(out, p) < 1.0
    # The interesting cases really happened: drafts impossible under p, and both outcomes.
    valid = out["drafts"] >= 0
    contexts = torch.cat([out["seq"][:, :1], out["drafts"].clamp(min=0)], dim=1)
    p_of_draft = p[contexts[:, :K], out["drafts"].clamp(min=0)]
    assert (p_of_draft[valid] == 0).float().mean() > 0.05
    rejected = out["num_emitted"] <= out["num_drafts"]
    assert 0.2 < rejected.float().mean() < 0.8


BROKEN = {
    "recovers_from_p": ("_residual", lambda p, q: p),
    "accepts_with_q_over_p": ("_is_accepted", lambda u, p, q: u * p < q),
    "ignores_q_when_accepting": ("_is_accepted", lambda u, p, q: u < p),
}


# With one-hot drafts q = 1, so ignoring q is the right rule there.
BROKEN_CASES = [(drafter, broken) for drafter in DRAFTERS for broken in BROKEN
                if drafter == "sampled" or broken != "ignores_q_when_accepting"]


@pytest.mark.parametrize("drafter, broken", BROKEN_CASES)
def test_the_chain_test_fails_broken_samplers(drafter, broken, monkeypatch):
    name, replacement = BROKEN[broken]
    monkeypatch.setattr(rejection, name, replacement)
    p, q = markov_tables(seed=7)
    try:
        ratio = worst_chi2_ratio(speculate(p, q, drafter), p)
    except AssertionError:  # emitted a token with target prob 0: failed already
        return
    assert ratio > 2.0


def test_rejection_at_equal_p_and_q_falls_back_to_p(monkeypatch):
    """p == q leaves max(p - q, 0) empty; a rejection there (float rounding) must sample p."""
    monkeypatch.setattr(rejection, "_is_accepted", lambda u, p, q: torch.zeros_like(p, dtype=torch.bool))
    probs = torch.tensor([0.0, 0.5, 0.3, 0.2])
    n = 20_000
    target = probs.expand(n, 2, -1).clone()
    token_ids, num_emitted = rejection_sample(target, torch.ones(n, 1, dtype=torch.long),
                                              torch.ones(n, dtype=torch.long),
                                              probs.expand(n, 1, -1).clone(), [None] * n)
    assert torch.all(num_emitted == 1)
    freq = torch.bincount(token_ids[:, 0], minlength=4).float() / n
    assert (freq - probs).abs().max() < 0.02


@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_drafts_certain_under_the_target_are_all_accepted(with_draft_probs):
    drafts = torch.tensor([[3, 1, 4], [5, 0, 2]])
    bonus = torch.tensor([6, 7])
    target = torch.zeros(2, K + 1, VOCAB)
    target[:, :K].scatter_(2, drafts.unsqueeze(2), 1.0)
    target[torch.arange(2), K, bonus] = 1.0
    draft_probs = torch.full((2, K, VOCAB), 1 / VOCAB) if with_draft_probs else None
    token_ids, num_emitted = rejection_sample(target, drafts, torch.tensor([K, K]), draft_probs, [None, None])
    assert num_emitted.tolist() == [K + 1, K + 1]
    assert torch.equal(token_ids, torch.cat([drafts, bonus.unsqueeze(1)], dim=1))


@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_drafts_impossible_under_the_target_are_never_emitted(with_draft_probs):
    n = 2000
    drafts = torch.randint(VOCAB, (n, K))
    target = torch.rand(n, K + 1, VOCAB)
    target[:, :K].scatter_(2, drafts.unsqueeze(2), 0.0)
    draft_probs = torch.rand(n, K, VOCAB) if with_draft_probs else None
    token_ids, num_emitted = rejection_sample(target, drafts, torch.full((n,), K), draft_probs, [None] * n)
    assert torch.all(num_emitted == 1)
    assert torch.all(token_ids[:, 0] != drafts[:, 0])
    assert torch.all(token_ids[:, 1:] == -1)


def test_num_drafts_varies_across_rows():
    drafts = torch.tensor([[9, 9, 9], [2, 9, 9], [2, 3, 9], [2, 3, 4]])  # 9: padding, out of vocab
    num_drafts = torch.tensor([0, 1, 2, 3])
    target = torch.zeros(4, K + 1, VOCAB)
    for b in range(4):  # every proposed draft is certain; slot num_drafts[b] is the bonus
        for j in range(num_drafts[b]):
            target[b, j, drafts[b, j]] = 1.0
        target[b, num_drafts[b], 7] = 1.0
    for draft_probs in (None, torch.full((4, K, VOCAB), 1 / VOCAB)):
        token_ids, num_emitted = rejection_sample(target, drafts, num_drafts, draft_probs, [None] * 4)
        assert num_emitted.tolist() == [1, 2, 3, 4]
        assert token_ids.tolist() == [[7, -1, -1, -1], [2, 7, -1, -1], [2, 3, 7, -1], [2, 3, 4, 7]]


def test_no_draft_slots_samples_only_the_bonus():
    target = torch.zeros(3, 1, VOCAB)
    target[:, 0, 5] = 1.0
    token_ids, num_emitted = rejection_sample(target, torch.zeros(3, 0, dtype=torch.long),
                                              torch.zeros(3, dtype=torch.long), None, [None] * 3)
    assert token_ids.tolist() == [[5]] * 3 and num_emitted.tolist() == [1] * 3


def random_batch(batch_size: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Random target and draft probs, drafts and num_drafts: both outcomes are common."""
    gen = torch.Generator().manual_seed(seed)
    target = torch.rand(batch_size, K + 1, VOCAB, generator=gen)
    draft_probs = torch.rand(batch_size, K, VOCAB, generator=gen)
    drafts = torch.randint(VOCAB, (batch_size, K), generator=gen)
    num_drafts = torch.randint(K + 1, (batch_size,), generator=gen)
    return target, drafts, num_drafts, draft_probs


def seeded(seed: int) -> int:
    return mix(seed, 0)


@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_seeded_row_repeats_and_ignores_its_batch(with_draft_probs):
    target, drafts, num_drafts, draft_probs = random_batch(6)
    draft_probs = draft_probs if with_draft_probs else None
    num_drafts[2] = K

    def alone(seed: int) -> list[int]:
        token_ids, _ = rejection_sample(target[2:3], drafts[2:3], num_drafts[2:3],
                                        None if draft_probs is None else draft_probs[2:3], [seeded(seed)])
        return token_ids[0].tolist()

    outcomes = set()
    for seed in range(30):
        assert alone(seed) == alone(seed)
        crowd = [None, seeded(99), seeded(seed), None, seeded(seed + 1), None]
        token_ids, _ = rejection_sample(target, drafts, num_drafts, draft_probs, crowd)
        assert token_ids[2].tolist() == alone(seed)
        all_seeded = [seeded(1000 + b) for b in range(6)]
        all_seeded[2] = seeded(seed)
        token_ids, _ = rejection_sample(target, drafts, num_drafts, draft_probs, all_seeded)
        assert token_ids[2].tolist() == alone(seed)
        outcomes.add(tuple(alone(seed)))
    assert len(outcomes) > 5  # the row really samples: the seed matters


def test_seeded_row_draws_k_uniforms_then_v_exponentials_whatever_the_outcome():
    """The documented draws, replayed by hand for one-hot drafts: slot j is accepted iff
    uniform j (its key's column j + 1) < p_j(d_j), and the last token is argmax(residual / E),
    E from the key's columns K+1..K+V."""
    drafts = torch.tensor([[0, 1, 2]])
    base = torch.tensor([0.5, 0.25, 0.125, 0.125, 0.0, 0.0, 0.0, 0.0])  # sums to 1 exactly
    target = torch.stack([base.roll(j) for j in range(K + 1)]).unsqueeze(0)  # p_j(d_j) = 0.5, 0.5, 0.5
    outcomes = set()
    for seed in range(40):
        draws = seeded_uniforms(torch.tensor([seeded(seed)]), K + VOCAB)[0]
        uniforms, exponentials = draws[:K], -torch.log(draws[K:])
        num_accepted = next((j for j in range(K) if uniforms[j] >= 0.5), K)
        residual = target[0, num_accepted].clone()
        if num_accepted < K:
            residual[drafts[0, num_accepted]] = 0.0
        expected = drafts[0, :num_accepted].tolist() + [int((residual / exponentials).argmax())]

        token_ids, num_emitted = rejection_sample(target, drafts, torch.tensor([K]), None, [seeded(seed)])
        assert token_ids[0, :num_emitted[0]].tolist() == expected
        outcomes.add(int(num_emitted[0]))
    assert outcomes == {1, 2, 3, 4}


@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_unnormalised_rows_give_the_same_tokens(with_draft_probs):
    """Rows scaled by powers of two (exact in float) sample the same: min-p leaves rows
    unnormalised, and the acceptance ratio must not see it."""
    target, drafts, num_drafts, draft_probs = random_batch(64, seed=3)
    target = target / target.sum(-1, keepdim=True)
    draft_probs = draft_probs / draft_probs.sum(-1, keepdim=True) if with_draft_probs else None

    def scaled(probs: torch.Tensor | None) -> torch.Tensor | None:
        if probs is None:
            return None
        return probs * 2.0 ** torch.randint(-3, 4, (*probs.shape[:2], 1)).float()

    normalised = rejection_sample(target, drafts, num_drafts, draft_probs, [seeded(b) for b in range(64)])
    unnormalised = rejection_sample(scaled(target), drafts, num_drafts, scaled(draft_probs),
                                    [seeded(b) for b in range(64)])
    assert torch.equal(normalised[0], unnormalised[0]) and torch.equal(normalised[1], unnormalised[1])


def test_greedy_verify_accepts_matches_then_emits_the_targets_token():
    target = torch.tensor([[1, 2, 3, 4]] * 6)
    drafts = torch.tensor([
        [1, 2, 3],  # all match: K+1 tokens, the last the bonus
        [5, 2, 3],  # first wrong: the target's token only
        [1, 2, 5],  # wrong at slot 2
        [1, 5, 3],  # a match after a mismatch does not count
        [1, 2, 3],  # num_drafts 0: padding that happens to match is ignored
        [1, 2, 3],  # num_drafts 2: the bonus is target[2]
    ])
    token_ids, num_emitted = greedy_verify(target, drafts, torch.tensor([3, 3, 3, 3, 0, 2]))
    assert num_emitted.tolist() == [4, 1, 3, 2, 1, 3]
    assert token_ids.tolist() == [[1, 2, 3, 4], [1, -1, -1, -1], [1, 2, 3, -1],
                                  [1, 2, -1, -1], [1, -1, -1, -1], [1, 2, 3, -1]]
