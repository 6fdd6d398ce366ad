"""Speculative decoding in the engine: greedy output equals output without it, token for token,
on the bundled SmolLM2 and tiny random models, with batching, chunking, prefix caching and
preemption at once; forced drafts give k+1 or 1 tokens a step; every per-row process (stops,
penalties, grammars, seeds, logprobs, n>1) is unchanged; back-off and metrics."""

from __future__ import annotations

import pytest

from common.sampling_params import SamplingParams
from engine.spec_decode.speculator import Speculator
from pagedserve.llm import LLM
from helpers import Oracle, assert_no_leak, build_tiny_model

pytestmark = pytest.mark.heavy(73)  # seconds on the 2-core CI machine: scheduled first

K = 4
MAX_NEW = 40
TEXT = ("The committee met on Tuesday to review the budget for the new library. After a long "
        "discussion, they agreed to spend more on children's books and less on furniture.")
ASKS = [f"Repeat the text below word for word, but change Tuesday to Monday.\n\n{TEXT}",
        "Count from one to twelve in words, separated by commas.",
        "Write a short story about a robot who learns to paint.",
        f"Summarise in one sentence: {TEXT}"]
BOUNDED = dict(dtype="float32", num_kv_blocks=14, max_num_batched_tokens=48, max_num_seqs=4)


@pytest.fixture(scope="module")
def prompts(bundled_tokenizer):
    texts = [bundled_tokenizer.apply_chat_template([{"role": "user", "content": a}], add_generation_prompt=True,
                                                   tokenize=False) for a in ASKS]
    return [bundled_tokenizer.encode(t, add_special_tokens=False) for t in texts]


@pytest.fixture(scope="module")
def reference(bundled_path, prompts):
    """Greedy, no speculation: tokens and top-3 logprobs per prompt."""
    llm = LLM(str(bundled_path), dtype="float32")
    outs = llm.generate(prompts, greedy(logprobs=3))
    return [o.outputs[0] for o in outs]


@pytest.fixture(scope="module")
def ngram_llm(bundled_path):
    return LLM(str(bundled_path), dtype="float32", speculative_method="ngram", num_speculative_tokens=K)


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_NEW, **kw)


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def with_proposer(llm: LLM, proposer) -> Speculator:
    """Swap the engine's proposer (and forget back-off state); returns the speculator."""
    speculator = llm.engine.speculator
    speculator.proposer = proposer
    speculator._backoff.clear()
    return speculator


def answers(prompts, reference) -> dict[tuple[int, ...], list[int]]:
    return {tuple(p): r.token_ids for p, r in zip(prompts, reference)}


# -- greedy equality ----------------------------------------------------------------------


def test_ngram_greedy_equals_no_speculation_with_logprobs_from_the_target(ngram_llm, prompts, reference):
    before = ngram_llm.engine.stats().spec_decoding
    outs = ngram_llm.generate(prompts, greedy(logprobs=3))
    assert tokens(outs) == [r.token_ids for r in reference]
    for ours, ref in zip(outs, reference):
        for a, b in zip(ours.outputs[0].logprobs, ref.logprobs):
            assert a.keys() == b.keys()
            assert all(abs(a[t] - b[t]) < 1e-3 for t in a)
    stats = ngram_llm.engine.stats().spec_decoding
    assert stats.num_accepted_tokens > before.num_accepted_tokens  # the repeat prompt drafts well
    assert_no_leak(ngram_llm)


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_greedy_equals_with_batching_chunking_prefix_caching_and_preemption(bundled_path, prompts, reference,
                                                                            method):
    extra = {"speculative_model": str(bundled_path)} if method == "draft" else {}
    llm = LLM(str(bundled_path), speculative_method=method, num_speculative_tokens=K, **BOUNDED, **extra)
    for _ in range(2):  # the second run is served from the prefix cache
        assert tokens(llm.generate(prompts, greedy())) == [r.token_ids for r in reference]
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0 and stats.num_prefix_cache_hits > 0
    llm.engine.step()  # hands the last finished ids on: no per-request state outlives them
    assert not llm.engine.speculator._backoff
    assert method == "ngram" or not llm.engine.speculator.proposer._states
    spec = stats.spec_decoding
    assert spec.num_accepted_tokens > 0
    if method == "draft":  # the model drafting for itself: every draft is right
        assert spec.num_accepted_tokens == spec.num_draft_tokens
        assert spec.accepted_per_position[0] == spec.num_drafts
    assert_no_leak(llm)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def tiny_pair(request, tmp_path_factory, bundled_tokenizer):
    """A tiny random target and a tinier random draft (one layer, other weights), same vocab."""
    folder = tmp_path_factory.mktemp(request.param)
    target = build_tiny_model(request.param, folder / "target", bundled_tokenizer)
    draft = build_tiny_model("llama", folder / "draft", bundled_tokenizer, num_hidden_layers=1,
                             initializer_range=0.5)
    return target, draft


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_tiny_models_greedy_equals_no_speculation(tiny_pair, method):
    from test_tiny_hf_equivalence import tiny_prompts
    target, draft = tiny_pair
    tiny = dict(dtype="float32", num_kv_blocks=20, max_num_batched_tokens=40, max_num_seqs=8)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    expected = tokens(LLM(str(target), **tiny).generate(tiny_prompts(), params))
    extra = {"speculative_model": str(draft)} if method == "draft" else {}
    llm = LLM(str(target), speculative_method=method, num_speculative_tokens=3, **tiny, **extra)
    assert tokens(llm.generate(tiny_prompts(), params)) == expected
    assert llm.engine.stats().spec_decoding.num_drafts > 0
    assert_no_leak(llm)


# -- forced drafts ------------------------------------------------------------------------


def run_counting_steps(llm: LLM, prompt: list[int], params: SamplingParams) -> tuple[list[int], list[int]]:
    """Drive the engine step by step: (tokens, tokens emitted by each step)."""
    llm.engine.add_request("counted", prompt, params)
    out, per_step = [], []
    while llm.engine.has_unfinished_requests():
        emitted = [t for o in llm.engine.step() for t in o.new_token_ids]
        out += emitted
        per_step.append(len(emitted))
    return out, per_step


@pytest.mark.parametrize("wrong", [False, True])
def test_forced_drafts_yield_k_plus_1_or_1_tokens_a_step(ngram_llm, prompts, reference, wrong):
    oracle = Oracle(answers(prompts, reference), wrong)
    with_proposer(ngram_llm, oracle)
    before = ngram_llm.engine.stats().spec_decoding
    params = SamplingParams(temperature=0, max_tokens=21, min_tokens=21, ignore_eos=True)
    expected = reference[2].token_ids[:21]  # the story prompt runs past 21 tokens
    out, per_step = run_counting_steps(ngram_llm, prompts[2], params)
    assert out == expected
    after = ngram_llm.engine.stats().spec_decoding
    drafted = after.num_draft_tokens - before.num_draft_tokens
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    if wrong:
        assert per_step == [1] * 21 and accepted == 0 and drafted > 0
    else:  # prefill gives 1; then k drafts + 1 a step
        assert per_step == [1, K + 1, K + 1, K + 1, K + 1] and accepted == drafted == 4 * K
    assert_no_leak(ngram_llm)


def test_stops_inside_an_accepted_run_end_at_the_right_token(ngram_llm, bundled_tokenizer, prompts, reference):
    with_proposer(ngram_llm, Oracle(answers(prompts, reference)))
    ref = reference[2].token_ids
    stop_token = ref[6]
    cut = ref.index(stop_token)
    stop_text = bundled_tokenizer.decode(ref[9:11])
    cases = [
        (SamplingParams(temperature=0, max_tokens=7), ref[:7]),
        (SamplingParams(temperature=0, max_tokens=MAX_NEW, stop_token_ids=[stop_token]), ref[:cut + 1]),
    ]
    for params, expected in cases:
        assert tokens(ngram_llm.generate([prompts[2]], params)) == [expected]
    plain = LLM(dtype="float32", num_kv_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, stop=[stop_text])
    ours, theirs = ngram_llm.generate([prompts[2]], params)[0], plain.generate([prompts[2]], params)[0]
    assert ours.outputs[0].text == theirs.outputs[0].text and ours.outputs[0].token_ids == theirs.outputs[0].token_ids
    assert ours.outputs[0].finish_reason == theirs.outputs[0].finish_reason == "stop"
    assert_no_leak(ngram_llm)


# -- every row processed as a normal one ----------------------------------------------------


def test_penalties_count_the_preceding_drafts(ngram_llm, bundled_path, prompts):
    params = greedy(repetition_penalty=1.3, frequency_penalty=0.4)
    expected = tokens(LLM(str(bundled_path), dtype="float32").generate(prompts[:2], params))
    # Oracle drafts are the penalised greedy answers: all accepted only if row j penalises
    # the drafts before it exactly as a normal step would.
    with_proposer(ngram_llm, Oracle({tuple(p): e for p, e in zip(prompts, expected)}))
    before = ngram_llm.engine.stats().spec_decoding
    assert tokens(ngram_llm.generate(prompts[:2], params)) == expected
    after = ngram_llm.engine.stats().spec_decoding
    assert after.num_accepted_tokens - before.num_accepted_tokens == after.num_draft_tokens - before.num_draft_tokens


def test_grammar_mask_applies_to_verification_rows(ngram_llm, bundled_path, prompts):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "count": {"type": "integer"}},
              "required": ["name", "count"], "additionalProperties": False}
    params = greedy(structured_outputs={"json": schema})
    expected = tokens(LLM(str(bundled_path), dtype="float32").generate(prompts[:2], params))
    for wrong in (False, True):  # wrong drafts are outside the grammar: masked to probability 0
        with_proposer(ngram_llm, Oracle({tuple(p): e for p, e in zip(prompts, expected)}, wrong))
        assert tokens(ngram_llm.generate(prompts[:2], params)) == expected
    assert_no_leak(ngram_llm)


def test_seeded_sampling_is_reproducible_batch_independent_and_as_without_drafts(ngram_llm, bundled_path,
                                                                                 prompts, reference):
    with_proposer(ngram_llm, Oracle(answers(prompts, reference)))
    before = ngram_llm.engine.stats().spec_decoding
    seeded = SamplingParams(temperature=0.8, top_p=0.95, seed=7, max_tokens=MAX_NEW)
    alone = tokens(ngram_llm.generate([prompts[0]], seeded))[0]
    again = tokens(ngram_llm.generate([prompts[0]], seeded))[0]
    others = SamplingParams(temperature=1.0, max_tokens=MAX_NEW)
    batched = tokens(ngram_llm.generate([prompts[0], prompts[1], prompts[2]], [seeded, others, others]))[0]
    plain = tokens(LLM(str(bundled_path), dtype="float32").generate([prompts[0]], seeded))[0]
    assert alone == again == batched == plain
    after = ngram_llm.engine.stats().spec_decoding
    assert after.num_accepted_tokens > before.num_accepted_tokens
    assert after.num_accepted_tokens - before.num_accepted_tokens < after.num_draft_tokens - before.num_draft_tokens
    assert_no_leak(ngram_llm)


def test_n_samples_fork_and_copy_on_write_under_drafts(ngram_llm, prompts, reference):
    with_proposer(ngram_llm, Oracle(answers(prompts, reference)))
    outs = ngram_llm.generate([prompts[2]], greedy(n=3))
    assert [o.token_ids for o in outs[0].outputs] == [reference[2].token_ids] * 3
    assert_no_leak(ngram_llm)


def test_per_request_opt_out_gets_no_drafts(ngram_llm, prompts, reference):
    oracle = Oracle(answers(prompts, reference))
    with_proposer(ngram_llm, oracle)
    assert tokens(ngram_llm.generate(prompts[:2], greedy(disable_speculation=True))) == \
        [r.token_ids for r in reference[:2]]
    assert oracle.calls == 0


# -- back-off and errors --------------------------------------------------------------------


def test_back_off_stops_proposing_when_drafts_keep_missing(ngram_llm, prompts, reference):
    oracle = Oracle(answers(prompts, reference), wrong=True)
    with_proposer(ngram_llm, oracle)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, min_tokens=MAX_NEW, ignore_eos=True)
    before = ngram_llm.engine.stats().spec_decoding
    out, per_step = run_counting_steps(ngram_llm, prompts[2], params)
    assert out == reference[2].token_ids
    drafted = ngram_llm.engine.stats().spec_decoding.num_draft_tokens - before.num_draft_tokens
    # 39 decode steps could verify 156 drafts; after a few misses the drafts shrink, then stop
    # for pauses of 4, 8, 16 steps, each ended by a one-draft try.
    assert oracle.calls <= 12 and drafted <= 40, (oracle.calls, drafted)
    assert_no_leak(ngram_llm)


def test_a_draft_model_with_another_vocabulary_is_refused(bundled_path, tiny_pair):
    target, _ = tiny_pair  # 512 tokens, against SmolLM2's 49,152
    with pytest.raises(ValueError, match="share the model's tokenizer"):
        LLM(str(bundled_path), num_kv_blocks=16, speculative_model=str(target))


def test_config_errors_name_the_flag():
    from engine.config import EngineConfig
    with pytest.raises(ValueError, match="speculative_model"):
        EngineConfig(speculative_method="draft")
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        EngineConfig(speculative_method="ngram", num_speculative_tokens=0)
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        EngineConfig(speculative_method="ngram", prompt_lookup_min=4, prompt_lookup_max=2)
    assert EngineConfig(speculative_model="x").speculative_method == "draft"
