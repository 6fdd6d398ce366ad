"""Sampler statistics and exact behaviour, on CPU with fixed seeds.

Statistical tests batch NUM_DRAWS identical rows into one call over a small
vocab and compare empirical frequencies with the exact distribution, computed
here in float64 without the sampler's code. At 5,000 draws one frequency's
standard deviation is at most 0.007, so TOL = 0.03 is over four sigma.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from common.sampling_params import SamplingParams
from engine import sampler as engine_sampler
from engine.keyed_random import mix, seeded_exponentials
from engine.sampler import SamplerOutput
from engine.sampling_batch import UNSEEDED, SamplingBatch

NUM_DRAWS = 5000
TOL = 0.03
EOS = 7
# Distinct, well-separated logits so no filter boundary sits on a float tie.
LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.6, 0.2, -0.3, -0.9, -1.4, -2.0, -2.6])
VOCAB = LOGITS.numel()


@pytest.fixture(autouse=True)
def _seed_global_rng():
    torch.manual_seed(1234)


@dataclasses.dataclass
class Row:
    """One row of a test's batch, spelled out."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    rng_key: int | None  # None: unseeded
    matcher: object = None
    draft_token_id: int | None = None


def row(params: SamplingParams | None = None, prompt: list[int] | None = None,
        output: list[int] | None = None, seed: int | None = None) -> Row:
    return Row(params or SamplingParams(), list(prompt or []), list(output or []), seed)


def batch(rows: list[Row]) -> SamplingBatch:
    matchers, drafts = [r.matcher for r in rows], [r.draft_token_id for r in rows]
    return SamplingBatch([r.params for r in rows], [r.prompt_token_ids for r in rows],
                         [r.output_token_ids for r in rows],
                         np.array([UNSEEDED if r.rng_key is None else r.rng_key for r in rows], np.int64),
                         matchers if any(m is not None for m in matchers) else None,
                         drafts if any(d is not None for d in drafts) else None)


class Sampler(engine_sampler.Sampler):
    """The engine's sampler, given a test's rows as the SamplingBatch they make."""

    def __call__(self, logits: torch.Tensor, rows: list[Row]) -> SamplerOutput:
        return super().__call__(logits, batch(rows))


def draw(params: SamplingParams, logits: torch.Tensor = LOGITS, n: int = NUM_DRAWS,
         **row_kwargs) -> torch.Tensor:
    """Token frequencies from n copies of one row sampled in a single call."""
    rows = [row(params, **row_kwargs) for _ in range(n)]
    out = Sampler([EOS])(logits.expand(n, -1).clone(), rows)
    return torch.bincount(torch.tensor(out.token_ids), minlength=logits.numel()).double() / n


def assert_matches(freq: torch.Tensor, expected: torch.Tensor) -> None:
    expected = expected.double()
    assert torch.all(freq[expected == 0] == 0), f"filtered tokens drawn: {freq}"
    assert (freq - expected).abs().max() < TOL, f"\nfreq     {freq}\nexpected {expected}"


def softmax64(logits: torch.Tensor) -> torch.Tensor:
    return torch.softmax(logits.double(), dim=-1)


def renormalise(probs: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    kept = torch.where(keep, probs, torch.zeros_like(probs))
    return kept / kept.sum()


@pytest.mark.parametrize("logprobs", [None, 0], ids=["fast_path", "full_path"])
def test_greedy_is_argmax_with_first_index_on_ties(logprobs):
    logits = torch.randn(32, 50, generator=torch.Generator().manual_seed(0))
    logits[3, [5, 9]] = 100.0
    rows = [row(SamplingParams(temperature=0.0, logprobs=logprobs)) for _ in range(32)]
    out = Sampler([EOS])(logits, rows)
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.token_ids[3] == 5


def test_fast_path_leaves_logits_and_global_rng_alone():
    logits = torch.randn(8, 20, generator=torch.Generator().manual_seed(1))
    before, rng_before = logits.clone(), torch.get_rng_state()
    out = Sampler([EOS])(logits, [row(SamplingParams(temperature=0.0)) for _ in range(8)])
    assert isinstance(out, SamplerOutput)
    assert out.token_ids == before.argmax(dim=-1).tolist()
    assert all(type(t) is int for t in out.token_ids)
    assert torch.equal(logits, before)
    assert torch.equal(torch.get_rng_state(), rng_before)


def test_greedy_rows_needing_more_than_argmax_leave_the_fast_path():
    logits = torch.zeros(3, VOCAB)
    logits[:, EOS] = 5.0
    logits[:, 2] = 4.0
    rows = [row(SamplingParams(temperature=0.0)),
            row(SamplingParams(temperature=0.0, min_tokens=2), output=[1]),
            row(SamplingParams(temperature=0.0, logprobs=0))]
    out = Sampler([EOS])(logits, rows)
    assert out.token_ids == [EOS, 2, EOS]
    assert out.logprobs[0] is None and set(out.logprobs[2]) == {EOS}


def test_sampler_does_not_modify_the_callers_logits():
    logits = LOGITS.expand(4, -1).clone()
    before = logits.clone()
    rows = [row(SamplingParams(top_k=2, min_tokens=3, repetition_penalty=1.5), prompt=[0])
            for _ in range(4)]
    Sampler([EOS])(logits, rows)
    assert torch.equal(logits, before)


@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.7])
def test_temperature_matches_softmax_of_scaled_logits(temperature):
    freq = draw(SamplingParams(temperature=temperature))
    assert_matches(freq, softmax64(LOGITS / temperature))


@pytest.mark.parametrize("top_k", [1, 3, 6])
def test_top_k_keeps_only_the_k_best_renormalised(top_k):
    freq = draw(SamplingParams(top_k=top_k))
    keep = torch.arange(VOCAB) < top_k  # LOGITS is sorted descending
    assert_matches(freq, renormalise(softmax64(LOGITS), keep))


@pytest.mark.parametrize("top_p", [0.2, 0.5, 0.8, 0.95])
def test_top_p_keeps_the_smallest_set_reaching_p(top_p):
    probs = softmax64(LOGITS)
    mass_before = probs.cumsum(0) - probs
    keep = mass_before < top_p
    assert keep[0]
    freq = draw(SamplingParams(top_p=top_p))
    assert_matches(freq, renormalise(probs, keep))


def test_top_p_below_the_top_token_keeps_only_it():
    assert_matches(draw(SamplingParams(top_p=0.01)), torch.eye(VOCAB)[0])


@pytest.mark.parametrize("min_p", [0.1, 0.3, 0.7])
def test_min_p_drops_tokens_below_min_p_times_max(min_p):
    probs = softmax64(LOGITS)
    keep = probs >= min_p * probs.max()
    freq = draw(SamplingParams(min_p=min_p))
    assert_matches(freq, renormalise(probs, keep))


def test_filters_compose_in_order_temperature_top_k_top_p_min_p():
    params = SamplingParams(temperature=0.8, top_k=6, top_p=0.9, min_p=0.15)
    probs = renormalise(softmax64(LOGITS / 0.8), torch.arange(VOCAB) < 6)
    probs = renormalise(probs, probs.cumsum(0) - probs < 0.9)
    probs = renormalise(probs, probs >= 0.15 * probs.max())
    assert_matches(draw(params), probs)


def test_mixed_filters_in_one_batch_apply_per_row():
    groups = [SamplingParams(top_k=2), SamplingParams(top_p=0.5), SamplingParams(min_p=0.5),
              SamplingParams(temperature=2.0), SamplingParams(temperature=0.0)]
    per_group = 3000
    # Interleave groups so a filter bleeding into the neighbouring row would show.
    rows = [row(groups[i % len(groups)]) for i in range(per_group * len(groups))]
    tokens = torch.tensor(Sampler([EOS])(LOGITS.expand(len(rows), -1).clone(), rows).token_ids)
    probs = softmax64(LOGITS)
    expected = [renormalise(probs, torch.arange(VOCAB) < 2),
                renormalise(probs, probs.cumsum(0) - probs < 0.5),
                renormalise(probs, probs >= 0.5 * probs.max()),
                softmax64(LOGITS / 2.0),
                torch.eye(VOCAB, dtype=torch.float64)[0]]
    for g, exp in enumerate(expected):
        freq = torch.bincount(tokens[g::len(groups)], minlength=VOCAB).double() / per_group
        assert_matches(freq, exp)


def penalised(logits: torch.Tensor, prompt: list[int], output: list[int],
              rep: float = 1.0, freq: float = 0.0, pres: float = 0.0) -> torch.Tensor:
    """vLLM's penalties, written out element by element."""
    out = logits.double().clone()
    for t in range(out.numel()):
        if t in prompt or t in output:
            out[t] = out[t] / rep if out[t] > 0 else out[t] * rep
        count = output.count(t)
        out[t] -= freq * count + pres * (count > 0)
    return out


def test_repetition_penalty_flips_greedy_choice_both_signs():
    logits = torch.tensor([[2.0, 1.9, -1.0, -1.1, -5.0], [2.0, 1.9, -1.0, -1.1, -5.0]])
    logits[1, :2] = -10.0  # row 1: best is token 2 (negative logit)
    params = SamplingParams(temperature=0.0, repetition_penalty=1.2)
    out = Sampler([EOS])(logits, [row(params, prompt=[0]), row(params, output=[2])])
    # 2.0 / 1.2 < 1.9, and -1.0 * 1.2 < -1.1.
    assert out.token_ids == [1, 3]


def test_frequency_and_presence_penalise_output_tokens_only():
    logits = torch.tensor([[2.2, 0.0, 2.0, 0.0]] * 4)
    prompt, output = [0, 0, 0], [1, 1, 1]
    penalties = [dict(frequency_penalty=0.3), dict(frequency_penalty=0.1),
                 dict(presence_penalty=0.4), dict(presence_penalty=0.6)]
    rows = [row(SamplingParams(temperature=0.0, **p), prompt, output) for p in penalties]
    # Token 0 is only in the prompt: penalising it would drop it below 2.0.
    assert Sampler([EOS])(logits, rows).token_ids == [0, 0, 0, 0]
    logits[:, 0], logits[:, 1] = 0.0, 2.5
    # Token 1 has count 3: 2.5 - 0.9 < 2.0;  2.5 - 0.3 > 2.0;
    # presence ignores the count: 2.5 - 0.4 > 2.0;  2.5 - 0.6 < 2.0.
    assert Sampler([EOS])(logits, rows).token_ids == [2, 1, 1, 2]


def test_penalised_distribution_matches_reference():
    prompt, output = [0, 4], [1, 1, 1, 5, 8]
    params = SamplingParams(repetition_penalty=1.4, frequency_penalty=0.4, presence_penalty=0.3)
    expected = softmax64(penalised(LOGITS, prompt, output, rep=1.4, freq=0.4, pres=0.3))
    assert_matches(draw(params, prompt=prompt, output=output), expected)


def test_penalties_in_a_mixed_batch_touch_only_their_rows():
    logits = torch.tensor([[2.0, 1.9, 1.2, 0.0]] * 4)
    rows = [row(SamplingParams(temperature=0.0), prompt=[0], output=[0, 0]),
            row(SamplingParams(temperature=0.0, frequency_penalty=0.5), output=[0]),
            row(SamplingParams(temperature=0.0), prompt=[0]),
            row(SamplingParams(temperature=0.0, repetition_penalty=2.0), prompt=[1, 0, 3])]
    assert Sampler([EOS])(logits, rows).token_ids == [0, 1, 0, 2]


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_min_tokens_masks_eos_and_stop_ids_until_reached(ignore_eos):
    logits = torch.zeros(4, VOCAB)
    logits[:, EOS], logits[:, 3], logits[:, 9], logits[:, 1] = 9.0, 8.0, 7.0, 6.0
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[3],
                            ignore_eos=ignore_eos)
    rows = [row(params, output=[5]), row(params, output=[5, 5]),
            row(params, output=[5, 5, 5]), row(SamplingParams(temperature=0.0, min_tokens=1))]
    out = Sampler([EOS, 9])(logits, rows)
    assert out.token_ids == [1, 1, EOS, 3]


def test_min_tokens_renormalises_the_remaining_distribution():
    params = SamplingParams(min_tokens=5, stop_token_ids=[0, 2])
    freq = draw(params, output=[4, 4])
    keep = torch.ones(VOCAB, dtype=torch.bool)
    keep[[0, 2, EOS]] = False
    assert_matches(freq, renormalise(softmax64(LOGITS), keep))


def test_logprobs_are_raw_log_softmax_with_top_n_and_the_sampled_token():
    logits = torch.randn(6, 30, generator=torch.Generator().manual_seed(3))
    raw = torch.log_softmax(logits, dim=-1)
    params = [SamplingParams(logprobs=3, temperature=2.0, repetition_penalty=1.5),
              SamplingParams(logprobs=0, top_k=5), SamplingParams(),
              SamplingParams(logprobs=5, temperature=0.0, frequency_penalty=1.0),
              SamplingParams(logprobs=20, min_tokens=4),
              SamplingParams(logprobs=2, temperature=5.0)]
    rows = [row(p, prompt=[1, 2, 3], output=[4, 4]) for p in params]
    out = Sampler([EOS])(logits, rows)
    assert out.logprobs[2] is None
    for i, p in enumerate(params):
        if p.logprobs is None:
            continue
        entry, token = out.logprobs[i], out.token_ids[i]
        top = set(raw[i].topk(p.logprobs).indices.tolist())
        assert set(entry) == top | {token}
        assert next(iter(entry)) == token
        for t, lp in entry.items():
            assert type(t) is int and type(lp) is float
            assert lp == pytest.approx(raw[i, t].item(), abs=1e-6)


@pytest.mark.parametrize("num_logprobs, expected_keys", [(0, {2}), (1, {EOS, 2}), (2, {EOS, 2})])
def test_logprobs_include_a_sampled_token_outside_the_top_n(num_logprobs, expected_keys):
    logits = torch.zeros(1, VOCAB)
    logits[0, EOS], logits[0, 2] = 6.0, 5.0
    params = SamplingParams(temperature=0.0, logprobs=num_logprobs, min_tokens=1)
    out = Sampler([EOS])(logits, [row(params)])
    # eos is the raw top-1 but min_tokens forbids it, so token 2 is sampled.
    assert out.token_ids == [2]
    assert set(out.logprobs[0]) == expected_keys
    raw = torch.log_softmax(logits[0], dim=-1)
    assert out.logprobs[0] == pytest.approx({t: raw[t].item() for t in expected_keys}, abs=1e-6)


def seeded_tokens(crowd: list[Row], position: int, steps: int = 20) -> list[int]:
    """Row `position`'s tokens over `steps` output positions: a seeded row's key (its seed
    here) is mixed with the position, as the runner does."""
    sampler, logits = Sampler([EOS]), LOGITS.expand(len(crowd), -1).clone()
    tokens = []
    for step in range(steps):
        rows = [dataclasses.replace(r, rng_key=None if r.rng_key is None else mix(r.rng_key, step)) for r in crowd]
        tokens.append(sampler(logits, rows).token_ids[position])
    return tokens


def test_seeded_row_is_independent_of_batch_and_position():
    params = SamplingParams(temperature=1.3, top_k=8)
    alone = seeded_tokens([row(params, seed=42)], 0)
    crowd = [row(SamplingParams(temperature=0.5), seed=7), row(SamplingParams(top_p=0.3)),
             row(SamplingParams(temperature=0.0)), row(params, seed=42),
             row(SamplingParams(min_p=0.2, repetition_penalty=1.5), prompt=[0]),
             row(params, seed=43)]
    assert seeded_tokens(crowd, 3) == alone
    assert len(set(alone)) > 3  # the row really samples
    assert seeded_tokens([row(params, seed=43)], 0) != alone


def test_seeded_rows_follow_the_distribution():
    rows = [row(SamplingParams(temperature=1.2), seed=s) for s in range(NUM_DRAWS)]
    out = Sampler([EOS])(LOGITS.expand(NUM_DRAWS, -1).clone(), rows)
    freq = torch.bincount(torch.tensor(out.token_ids), minlength=VOCAB).double() / NUM_DRAWS
    assert_matches(freq, softmax64(LOGITS / 1.2))


def test_unseeded_rows_differ_across_calls():
    logits = torch.zeros(64, 16)
    rows = [row() for _ in range(64)]
    sampler = Sampler([EOS])
    first, second = sampler(logits, rows).token_ids, sampler(logits, rows).token_ids
    assert first != second
    assert len(set(first)) > 8


def test_bf16_logits():
    logits = LOGITS.to(torch.bfloat16).expand(NUM_DRAWS, -1).clone()
    rows = [row(SamplingParams(temperature=0.9, logprobs=2)) for _ in range(NUM_DRAWS - 1)]
    rows.append(row(SamplingParams(temperature=0.0)))
    out = Sampler([EOS])(logits, rows)
    upcast = logits[0].float()
    assert out.token_ids[-1] == int(upcast.argmax())
    freq = torch.bincount(torch.tensor(out.token_ids[:-1]), minlength=VOCAB).double()
    assert_matches(freq / (NUM_DRAWS - 1), softmax64(upcast / 0.9))
    raw = torch.log_softmax(upcast, dim=-1)
    assert out.logprobs[0][out.token_ids[0]] == pytest.approx(raw[out.token_ids[0]].item(), abs=1e-6)
    assert Sampler([EOS])(logits[:4], [row(SamplingParams(temperature=0.0))] * 4).token_ids == [0] * 4


def test_columns_past_num_tokens_are_never_sampled():
    """An LM head padded past the tokenizer: the padding columns never win, on any path."""
    logits = torch.zeros(4, VOCAB + 2)
    logits[:, VOCAB:] = 50.0  # padding that would win everything
    rows = [row(SamplingParams(temperature=0)), row(SamplingParams(temperature=1.0), seed=1),
            row(SamplingParams(temperature=0, logprobs=2)), row(SamplingParams(temperature=3.0))]
    out = Sampler([EOS], num_tokens=VOCAB)(logits, rows)
    assert max(out.token_ids) < VOCAB
    assert all(t < VOCAB for t in out.logprobs[2])


# -- speculative decoding's verification rows --------------------------------------------------


def test_verification_keeps_the_target_distribution():
    """Drafts d1, d2 after token 0 of a Markov chain P: the first emitted token follows P[0];
    given d1 was kept, the next follows P[d1]; given d2 too, the bonus follows P[d2]. Each
    conditioning is on earlier slots only, so the checks are unbiased. ~6e4 groups, one call."""
    vocab, groups = 6, 60_000
    torch.manual_seed(11)
    table = torch.distributions.Dirichlet(torch.ones(vocab)).sample((vocab,))
    d1 = int(table[0].argmax())
    d2 = int(table[d1].argsort()[-2])  # the second likeliest: rejected often
    logits = table[[0, d1, d2]].log().repeat(groups, 1)
    params = SamplingParams(temperature=1.0)
    rows = [Row(params, [], [], None, None, draft) for _ in range(groups) for draft in (d1, d2, None)]
    torch.manual_seed(5)
    tokens = torch.tensor(Sampler([])(logits, rows).token_ids).view(groups, 3)

    def tv(samples: torch.Tensor, expected: torch.Tensor) -> float:
        counts = torch.bincount(samples, minlength=vocab).float()
        return 0.5 * float((counts / counts.sum() - expected).abs().sum())

    assert tv(tokens[:, 0], table[0]) < 0.015
    kept_d1 = tokens[:, 0] == d1
    assert (tokens[~kept_d1, 1] == -1).all()  # a rejection ends the run
    assert tv(tokens[kept_d1, 1], table[d1]) < 0.03
    kept_d2 = kept_d1 & (tokens[:, 1] == d2)
    assert kept_d2.sum() > 1000
    assert tv(tokens[kept_d2, 2], table[d2]) < 0.06


def test_verification_of_a_seeded_row_samples_what_it_samples_without_drafts():
    """Row j draws from its own position's key: with drafts or without, the same tokens."""
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(2))
    params = SamplingParams(temperature=0.9, seed=1)
    plain = [Sampler([])(logits[j:j + 1], [row(params, seed=100 + j)]).token_ids[0] for j in range(3)]
    drafts = [plain[0], plain[1]]  # right drafts: the whole run is kept, plus the bonus
    rows = [Row(params, [], [], 100 + j, None,
                 drafts[j] if j < 2 else None) for j in range(3)]
    assert Sampler([])(logits, rows).token_ids == plain
    wrong = [Row(params, [], [], 100 + j, None,
                 (plain[j] + 1) % 40 if j < 2 else None) for j in range(3)]
    assert Sampler([])(logits, wrong).token_ids == [plain[0], -1, -1]


def test_seeded_exponentials_are_exp1_and_a_function_of_key_and_column_only():
    keys = torch.tensor([3, 2**62 + 5, 7], dtype=torch.int64)
    draws = seeded_exponentials(keys, 20_000)
    assert torch.equal(draws[1:2], seeded_exponentials(keys[1:2], 20_000))  # alone or batched
    assert torch.equal(draws[:, :100], seeded_exponentials(keys, 100))  # the vocabulary's size aside
    assert not torch.equal(draws[0], draws[2])
    assert draws.min() > 0 and torch.isfinite(draws).all()
    # Exp(1): mean 1, variance 1, P(q > 1) = 1/e; and neighbouring columns uncorrelated.
    flat = draws.flatten().double()
    assert abs(flat.mean() - 1) < 0.02 and abs(flat.var() - 1) < 0.05
    assert abs((flat > 1).double().mean() - math.exp(-1)) < 0.01
    assert abs(torch.corrcoef(torch.stack([draws[0, :-1], draws[0, 1:]]))[0, 1]) < 0.03
