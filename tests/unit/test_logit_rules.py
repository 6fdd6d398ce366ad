"""logit_bias, allowed_token_ids and bad_words: SamplingParams' checks, the sampler's exact
edits, batch invariance, the fast paths they leave, and verification rows (speculative
decoding), on CPU with fixed seeds."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from common.errors import InvalidRequest
from common.sampling_params import SamplingParams
from common.validation import PromptLimits, check_prompt
from engine.logit_rules import apply_logit_rules, banned_tokens
from engine.sampler import Sampler
from engine.sampling_batch import UNSEEDED, SamplingBatch, rng_keys

VOCAB = 12
EOS = 11
LOGITS = torch.linspace(3.0, -3.0, VOCAB)  # token 0 likeliest, then 1, ...


def batch(params: list[SamplingParams], outputs: list[list[int]] | None = None, seeds: list[int | None] | None = None,
          drafts: list[int | None] | None = None) -> SamplingBatch:
    outputs = outputs or [[] for _ in params]
    seeds = seeds or [None] * len(params)
    keys = rng_keys(seeds, np.array([len(o) for o in outputs], np.int64))
    return SamplingBatch(params, [[0]] * len(params), outputs, keys, None,
                         drafts if drafts and any(d is not None for d in drafts) else None)


def edited(params: SamplingParams, output: list[int] = ()) -> torch.Tensor:
    logits = LOGITS.clone().unsqueeze(0)
    apply_logit_rules(logits, batch([params], [list(output)]))
    return logits[0]


def sample(params: list[SamplingParams], outputs=None, seeds=None, logits=None) -> list[int]:
    logits = LOGITS.expand(len(params), -1).clone() if logits is None else logits
    return Sampler([EOS])(logits, batch(params, outputs, seeds)).token_ids


# -- the edits, exactly --------------------------------------------------------------------------

def test_logit_bias_is_added_to_its_tokens_only():
    out = edited(SamplingParams(logit_bias={"3": 2.5, 7: -100}))
    expected = LOGITS.clone()
    expected[3] += 2.5
    expected[7] -= 100
    assert torch.equal(out, expected)


def test_allowed_token_ids_masks_every_other_token():
    out = edited(SamplingParams(allowed_token_ids=[5, 2, 5]))
    assert torch.equal(out[[2, 5]], LOGITS[[2, 5]])
    assert torch.isinf(out[[t for t in range(VOCAB) if t not in (2, 5)]]).all()


def test_bad_words_ban_the_last_token_where_the_output_ends_with_the_rest():
    words = [[4], [1, 2], [7, 8, 9]]
    assert banned_tokens(words, []) == [4]
    assert banned_tokens(words, [3, 1]) == [4, 2]
    assert banned_tokens(words, [7, 8]) == [4, 9]
    assert banned_tokens(words, [8]) == [4]  # only the word's whole prefix counts
    out = edited(SamplingParams(bad_words_token_ids=words), [0, 7, 8])
    assert torch.isinf(out[[4, 9]]).all() and torch.isfinite(out[[0, 1, 2, 3, 5, 6, 7, 8, 10]]).all()


def test_rules_combine_in_vllms_order():
    """Allowed first (a bias can't revive a masked token), then bad words, then the bias."""
    out = edited(SamplingParams(allowed_token_ids=[1, 2, 3], bad_words_token_ids=[[2]], logit_bias={3: 10, 4: 50}))
    assert out[1] == LOGITS[1] and out[3] == LOGITS[3] + 10
    assert torch.isinf(out[[0, 2, 4]]).all()


def test_ids_past_the_logits_are_skipped():
    """A tokenizer larger than the LM head: such ids can never be sampled anyway."""
    out = edited(SamplingParams(logit_bias={VOCAB + 5: 3}, allowed_token_ids=[1, VOCAB + 1],
                                bad_words_token_ids=[[VOCAB + 2]]))
    assert out[1] == LOGITS[1] and torch.isinf(out[torch.arange(VOCAB) != 1]).all()


# -- sampling with them --------------------------------------------------------------------------

def test_greedy_and_random_rows_obey_them():
    params = [SamplingParams(temperature=0, logit_bias={6: 100}),
              SamplingParams(temperature=0, logit_bias={0: -100}),
              SamplingParams(temperature=1.5, allowed_token_ids=[8, 9]),
              SamplingParams(temperature=0, bad_words_token_ids=[[0], [1]])]
    for _ in range(20):
        tokens = sample(params)
        assert tokens[0] == 6 and tokens[1] == 1 and tokens[2] in (8, 9) and tokens[3] == 2


def test_allowed_tokens_keep_their_relative_probabilities():
    n = 4000
    params = [SamplingParams(temperature=1.0, allowed_token_ids=[1, 4])] * n
    torch.manual_seed(3)
    freq = np.bincount(sample(params), minlength=VOCAB) / n
    p1 = 1 / (1 + float(torch.exp(LOGITS[4] - LOGITS[1])))
    assert set(np.flatnonzero(freq)) <= {1, 4} and abs(freq[1] - p1) < 0.03


def test_a_rows_tokens_do_not_depend_on_its_batch():
    """Each row alone, then all together with rows that do other things: the same tokens."""
    logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(4))
    params = [SamplingParams(temperature=0.8, seed=1, logit_bias={3: 4.0}),
              SamplingParams(temperature=0),
              SamplingParams(temperature=0.7, seed=2, allowed_token_ids=[1, 5, 9]),
              SamplingParams(temperature=0, repetition_penalty=1.5),
              SamplingParams(temperature=1.2, seed=3, bad_words_token_ids=[[2, 7], [int(logits[4].argmax())]]),
              SamplingParams(temperature=0.9, seed=4, top_k=3)]
    outputs = [[1], [], [4, 4], [0], [6, 2], [3]]
    seeds = [p.seed for p in params]
    alone = [sample([p], [o], [s], logits[i:i + 1])[0] for i, (p, o, s) in enumerate(zip(params, outputs, seeds))]
    assert sample(params, outputs, seeds, logits) == alone
    order = [5, 2, 0, 4, 1, 3]
    shuffled = sample([params[i] for i in order], [outputs[i] for i in order], [seeds[i] for i in order],
                      logits[order])
    assert shuffled == [alone[i] for i in order]


def test_verification_rows_see_the_drafts_before_them():
    """As the model runner builds them: row j's output is the request's plus drafts[:j]. A bad
    word whose prefix is the first draft bans its last token on the second row only, so a draft
    of that token is rejected there, as plain decoding would never sample it."""
    logits = torch.zeros(3, VOCAB)
    logits[:, 5] = 10.0  # the greedy token everywhere
    params = SamplingParams(temperature=0, bad_words_token_ids=[[5, 5]])
    output = [0]
    rows = SamplingBatch([params] * 3, [[0]] * 3, [output, output + [5], output + [5, 5]],
                         np.full(3, UNSEEDED, np.int64), None, [5, 5, None])
    # Row 0 keeps draft 5; row 1 may not sample 5 after a 5: it emits its own argmax instead.
    assert Sampler([EOS])(logits, rows).token_ids == [5, 0, -1]


def test_requests_using_them_leave_the_fast_paths():
    for rules in (dict(logit_bias={1: 1.0}), dict(allowed_token_ids=[1]), dict(bad_words=["x"]),
                  dict(bad_words_token_ids=[[1]])):
        assert SamplingParams(temperature=0, **rules).uses_logit_rules
        assert not SamplingParams(temperature=0, **rules).plain_greedy
        assert not SamplingParams(temperature=1.0, **rules).plain_random
    assert SamplingParams(temperature=0).plain_greedy and not SamplingParams().uses_logit_rules


# -- checks --------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, words", [
    (dict(logit_bias={"abc": 1}), "logit_bias: keys must be token ids"),
    (dict(logit_bias={1.5: 1}), "logit_bias: token ids must be integers"),
    (dict(logit_bias={-1: 1}), "logit_bias: token id -1 is negative"),
    (dict(logit_bias={1: 101}), "logit_bias: the bias of token 1 must be a number in [-100, 100]"),
    (dict(logit_bias={1: "x"}), "logit_bias: the bias of token 1"),
    (dict(logit_bias={i: 1 for i in range(301)}), "logit_bias: at most 300"),
    (dict(logit_bias=[1]), "logit_bias: must be an object"),
    (dict(allowed_token_ids=[]), "allowed_token_ids: must hold at least one"),
    (dict(allowed_token_ids=[1, True]), "allowed_token_ids: token ids must be integers"),
    (dict(allowed_token_ids=5), "allowed_token_ids: must be a list"),
    (dict(bad_words=[" "]), "bad_words: every word"),
    (dict(bad_words=["x" * 300]), "bad_words: every word"),
    (dict(bad_words=["w"] * 129), "bad_words: at most 128"),
    (dict(bad_words_token_ids=[[]]), "bad_words_token_ids: every word needs"),
])
def test_bad_values_name_the_field(kwargs, words):
    with pytest.raises(InvalidRequest) as e:
        SamplingParams(**kwargs)
    assert str(e.value).startswith(words), str(e.value)


def test_logit_bias_keys_become_integers():
    assert SamplingParams(logit_bias={"7": -100, 8: 1}).logit_bias == {7: -100, 8: 1}
    assert SamplingParams(logit_bias={}).logit_bias is None


@pytest.mark.parametrize("kwargs, field", [
    (dict(logit_bias={49152: 1}), "logit_bias"),
    (dict(allowed_token_ids=[3, 99999]), "allowed_token_ids"),
    (dict(bad_words_token_ids=[[1, 49152]]), "bad_words"),
])
def test_token_ids_are_checked_against_the_vocabulary(kwargs, field):
    with pytest.raises(InvalidRequest) as e:
        check_prompt([1, 2], SamplingParams(**kwargs), PromptLimits(49152, 2048, 128, 16))
    assert str(e.value).startswith(f"{field}: token id ") and "outside the vocabulary [0, 49152)" in str(e.value)


# -- the frontend's side: tokenizing bad_words, and the engine's messages ----------------------

def test_bad_words_are_tokenized_with_and_without_a_leading_space(bundled_tokenizer):
    from frontend.input_processor import InputProcessor
    processor = InputProcessor(bundled_tokenizer, PromptLimits(len(bundled_tokenizer), 2048, 128, 16))
    params = SamplingParams(bad_words=["Paris", " the capital"])
    processor.check([1, 2], params)
    encode = bundled_tokenizer.encode
    assert params.bad_words_token_ids == [encode("Paris"), encode(" Paris"), encode("the capital"),
                                          encode(" the capital")]
    assert len({tuple(ids) for ids in params.bad_words_token_ids}) == 4


def test_the_rules_cross_the_engine_socket():
    from common.ipc import bad_words_from_proto, bad_words_to_proto, sampling_params_from_proto, \
        sampling_params_to_proto
    from common.v1 import engine_ipc_pb2 as ipc
    params = SamplingParams(logit_bias={5: -100, 9: 2.5}, allowed_token_ids=[5, 9, 12], bad_words=["hi"],
                            bad_words_token_ids=[[1, 2], [3]])
    add = ipc.AddRequest.FromString(ipc.AddRequest(
        sampling=sampling_params_to_proto(params), bad_words_token_ids=bad_words_to_proto(params)).SerializeToString())
    back = sampling_params_from_proto(add.sampling, bad_words_token_ids=bad_words_from_proto(add))
    assert back == params
