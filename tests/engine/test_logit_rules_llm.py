"""The offline LLM on the bundled model: logit_bias, allowed_token_ids and bad_words (tokenized
by the offline path too), the same tokens with n-gram speculation as without, and a
generation config given as a folder (engine option generation_config)."""

from __future__ import annotations

import json

import pytest

from pagedserve import LLM, SamplingParams
from helpers import assert_no_leak

REPEAT = "one two three four one two three four one two three four one two"
PROMPTS = [REPEAT, "The capital of France is", "Once upon a time"]
MAX_NEW = 12


@pytest.fixture(scope="module")
def llm(bundled_path, tmp_path_factory):
    """Its generation config makes unset requests greedy, 6 tokens long."""
    folder = tmp_path_factory.mktemp("generation-config")
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "max_new_tokens": 6}))
    return LLM(str(bundled_path), dtype="float32", num_kv_blocks=256, generation_config=str(folder))


@pytest.fixture(scope="module")
def ngram_llm(bundled_path):
    return LLM(str(bundled_path), dtype="float32", num_kv_blocks=256, speculative_method="ngram",
               num_speculative_tokens=4)


def tokens(llm: LLM, params: SamplingParams, prompts=PROMPTS) -> list[list[int]]:
    outs = llm.generate(prompts, params)
    assert_no_leak(llm)
    return [o.outputs[0].token_ids for o in outs]


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, **kwargs)


def test_the_generation_config_gives_the_defaults(llm):
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.max_tokens, defaults.top_p) == (0.0, 6, 1.0)
    unset = tokens(llm, None)
    assert all(len(t) <= 6 for t in unset) and unset == tokens(llm, None)  # greedy: the same again
    assert unset == [t[:6] for t in tokens(llm, SamplingParams(temperature=0, max_tokens=6))]


def test_logit_bias_allowed_tokens_and_bad_words(llm):
    [plain] = tokens(llm, greedy(), PROMPTS[1:2])
    [forced] = tokens(llm, greedy(logit_bias={42: 100}), PROMPTS[1:2])
    assert forced == [42] * MAX_NEW
    [avoided] = tokens(llm, greedy(logit_bias={plain[0]: -100}), PROMPTS[1:2])
    assert avoided[0] != plain[0]
    [allowed] = tokens(llm, SamplingParams(temperature=1.0, max_tokens=MAX_NEW, ignore_eos=True, seed=1,
                                           allowed_token_ids=[11, 42, 1000]), PROMPTS[1:2])
    assert set(allowed) <= {11, 42, 1000}
    text = llm.tokenizer.decode(plain)
    assert "Paris" in text
    [banned] = tokens(llm, greedy(bad_words=["Paris"]), PROMPTS[1:2])
    assert "Paris" not in llm.tokenizer.decode(banned)


def test_speculation_gives_the_same_tokens(llm, ngram_llm):
    """The repeating prompt drafts well; banning "four" makes the drafts wrong where the ban
    bites: verification must reject them exactly where plain decoding would not sample them."""
    for params in (greedy(bad_words=["four"]), greedy(logit_bias={llm.tokenizer.encode(" one")[0]: -100}),
                   SamplingParams(temperature=0.8, seed=7, max_tokens=MAX_NEW, ignore_eos=True, bad_words=["two"],
                                  logit_bias={llm.tokenizer.encode(" three")[0]: 3.0})):
        before = ngram_llm.engine.stats().spec_decoding.num_draft_tokens
        assert tokens(ngram_llm, params) == tokens(llm, params)
        assert ngram_llm.engine.stats().spec_decoding.num_draft_tokens > before
    [text] = tokens(llm, greedy(bad_words=["four"]), [REPEAT])
    assert "four" not in llm.tokenizer.decode(text)
