"""Structured output after the reasoning (StructuredOutputsParams.starts_after): the output is
free until the prompt and output so far end with the marker, or with its text written in other
tokens, and matches the grammar from the next token on. Checked on the bundled SmolLM2 with
tokens it emits anyway as the marker, and with `</think>` spelled as a few-shot prompt spells
it: the gated run equals the free run up to and including the marker, then fits the grammar.
On one engine with speculation (n-gram, and an oracle proposer whose drafts run past the
marker), async scheduling and a pool small enough to preempt."""

from __future__ import annotations

import re

import pytest

from common.sampling_params import SamplingParams
from frontend.detokenizer import IncrementalDetokenizer
from frontend.output_events import Content, Reasoning
from frontend.sample_parser import SampleParser
from pagedserve.llm import LLM
from helpers import Oracle, assert_no_leak

DIGITS = "[0-9]{3}"  # ends by itself: a gated run stops three digits after its marker
PROMPTS = ["The capital of France is", "My favourite recipe for soup:", "Ten facts about the Moon:",
           "Dear diary, today", "The history of the bicycle began"]


@pytest.fixture(scope="module")
def llm(bundled_path):
    # 8 blocks of 16 tokens: a batch of these prompts preempts.
    return LLM(str(bundled_path), num_kv_blocks=8, max_num_batched_tokens=64,
               speculative_method="ngram", num_speculative_tokens=3, async_scheduling=True)


@pytest.fixture(scope="module")
def prompts(bundled_tokenizer):
    return [bundled_tokenizer.encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def free(llm, prompts):
    """Each prompt's greedy output, unconstrained."""
    return [o.outputs[0].token_ids for o in llm.generate(prompts, greedy())]


def greedy(constraint: dict | None = None, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=24, structured_outputs=constraint, **kw)


def gated(marker: tuple[int, ...], **kw) -> SamplingParams:
    return greedy({"regex": DIGITS, "starts_after": marker}, **kw)


def first_end(tokenizer, prompt: list[int], tokens: list[int], marker: tuple[int, ...]) -> int | None:
    """The output position of the token that first completes the marker's text (in its own
    tokens or others: the engine reads text); -1: the prompt's last token does."""
    text = tokenizer.decode(list(marker))
    seq = prompt + tokens
    counts = [tokenizer.decode(seq[:p]).count(text) for p in range(len(prompt) - 1, len(seq) + 1)]
    return next((p - 1 for p in range(len(counts) - 1) if counts[p + 1] > counts[p]), None)


def pick_marker(tokenizer, prompt: list[int], tokens: list[int], width: int,
                k_min: int = 2) -> tuple[int, tuple[int, ...]]:
    """(k, marker): `width` tokens of the free output that end at position k, whose text the
    output writes nowhere before."""
    for k in range(k_min, len(tokens) - 4):
        marker = tuple(tokens[k - width + 1:k + 1])
        if first_end(tokenizer, prompt, tokens, marker) == k:
            return k, marker
    raise AssertionError(f"no marker of width {width} in {tokens}")


def assert_gated(out, free_tokens: list[int], k: int, tokenizer) -> None:
    assert out.token_ids[:k + 1] == free_tokens[:k + 1]
    assert re.fullmatch(DIGITS, tokenizer.decode(out.token_ids[k + 1:])), out.text
    assert out.finish_reason == "stop"


@pytest.mark.parametrize("width", [1, 2])
def test_the_grammar_starts_after_the_marker(llm, prompts, free, bundled_tokenizer, width):
    k, marker = pick_marker(bundled_tokenizer, prompts[0], free[0], width)
    out = llm.generate([prompts[0]], gated(marker))[0].outputs[0]
    assert_gated(out, free[0], k, bundled_tokenizer)
    assert_no_leak(llm)


def test_a_prompt_that_ends_with_the_marker_constrains_from_the_first_token(llm, prompts):
    params = [greedy({"regex": DIGITS})] + [gated(tuple(prompts[1][-width:])) for width in (1, 2)]
    whole, *ended = [o.outputs[0] for o in llm.generate([prompts[1]] * 3, params)]
    assert re.fullmatch(DIGITS, whole.text)
    assert [o.token_ids for o in ended] == [whole.token_ids] * 2
    assert_no_leak(llm)


def test_a_marker_never_emitted_leaves_the_output_free(llm, prompts, free, bundled_tokenizer):
    written = bundled_tokenizer.decode(prompts[2] + free[2])
    unused = next(t for t in range(1000, 2000) if bundled_tokenizer.decode([t]) not in written)
    out = llm.generate([prompts[2]], gated((unused,)))[0].outputs[0]
    assert out.token_ids == free[2] and out.finish_reason == "length"
    assert_no_leak(llm)


def test_n_samples_wait_each_on_their_own(llm, prompts, free, bundled_tokenizer):
    k, marker = pick_marker(bundled_tokenizer, prompts[3], free[3], 1)
    outs = llm.generate([prompts[3]], gated(marker, n=3))[0].outputs
    for out in outs:
        assert_gated(out, free[3], k, bundled_tokenizer)
    assert_no_leak(llm)


def test_batched_with_free_neighbours_and_preempted(llm, prompts, free, bundled_tokenizer):
    """Eight blocks for seven requests: as the free neighbours (first come) grow, the gated ones
    (newest) are preempted and recomputed, keeping their state; nobody's tokens change."""
    picked = [pick_marker(bundled_tokenizer, p, f, 1, k_min=6) for p, f in zip(prompts, free)]
    long = prompts[0] * 4
    neighbours = [greedy(ignore_eos=True), SamplingParams(temperature=0.8, seed=5, max_tokens=24, ignore_eos=True)]
    alone = [o.outputs[0].token_ids for o in llm.generate([long, long], neighbours)]
    before = llm.engine.scheduler.num_preemptions
    outs = llm.generate([long, long] + prompts, neighbours + [gated(m) for _, m in picked])
    assert llm.engine.scheduler.num_preemptions > before
    assert [o.outputs[0].token_ids for o in outs[:2]] == alone
    for out, free_tokens, (k, _) in zip(outs[2:], free, picked):
        assert_gated(out.outputs[0], free_tokens, k, bundled_tokenizer)
    assert_no_leak(llm)


def test_drafts_stop_before_the_marker(llm, prompts, free, bundled_tokenizer):
    k, marker = pick_marker(bundled_tokenizer, prompts[4], free[4], 1, k_min=5)
    expected = llm.generate([prompts[4]], gated(marker, disable_speculation=True))[0].outputs[0]
    speculator = llm.engine.speculator
    ngram = speculator.proposer
    # Drafts of the free output run on past the marker, where the gated output differs.
    speculator.proposer = Oracle({tuple(prompts[4]): free[4]})
    speculator._backoff.clear()
    before = speculator_accepted(llm)
    try:
        out = llm.generate([prompts[4]], gated(marker))[0].outputs[0]
    finally:
        speculator.proposer = ngram
        speculator._backoff.clear()
    assert speculator_accepted(llm) > before  # the drafts before the marker ran
    assert out.token_ids == expected.token_ids
    assert_gated(out, free[4], k, bundled_tokenizer)
    assert_no_leak(llm)


def speculator_accepted(llm: LLM) -> int:
    return llm.engine.stats().spec_decoding.num_accepted_tokens


# --- The marker written in other tokens than starts_after's ---------------------------------
# The frontend attaches its tokenizer's encoding of `</think>` ("</" "think" ">" here); a model
# may write the same text otherwise: " </think>" ("Ġ</" "think" ">"), or "<" "/" "think" ">".
# The bundled model copies a few-shot prompt down to how it spells the tag.
SHOTS = ["<think>Two plus two.", " 4\n<think>Three plus three.", " 6\n<think>Four plus"]


def spelled_prompt(tokenizer, spelling: list[str]) -> tuple[list[int], list[int]]:
    """(prompt, the tag's tokens): the shots joined by `</think>` written as `spelling`'s tokens."""
    tag = tokenizer.convert_tokens_to_ids(spelling)
    prompt = tokenizer.encode(SHOTS[0])
    for shot in SHOTS[1:]:
        prompt += tag + tokenizer.encode(shot, add_special_tokens=False)
    return prompt, tag


@pytest.mark.parametrize("spelling", [["Ġ</", "think", ">"], ["<", "/", "think", ">"]])
def test_a_marker_written_in_other_tokens_opens_the_gate(llm, bundled_tokenizer, spelling):
    """The grammar starts after the model's `</think>` however it is tokenized, as the
    reasoning parser splits the text there: the thinking, then an answer that fits."""
    tokenizer = bundled_tokenizer
    prompt, tag = spelled_prompt(tokenizer, spelling)
    marker = tuple(tokenizer.encode("</think>", add_special_tokens=False))  # as after_reasoning
    assert tuple(tag[-len(marker):]) != marker
    free_tokens = llm.generate([prompt], greedy())[0].outputs[0].token_ids
    k = first_end(tokenizer, prompt, free_tokens, marker)
    assert free_tokens[k + 1 - len(tag):k + 1] == tag  # the model wrote the tag as the prompt does
    for speculate in (True, False):
        out = llm.generate([prompt], gated(marker, disable_speculation=not speculate))[0].outputs[0]
        assert_gated(out, free_tokens, k, tokenizer)
    assert_no_leak(llm)
    detok, parser = IncrementalDetokenizer(tokenizer, prompt), SampleParser("deepseek_r1")
    events = [e for t in out.token_ids for e in parser.feed(detok.add([t]))]  # streamed, a token at a time
    events += parser.feed(detok.flush(), final=True)
    thinking = tokenizer.decode(free_tokens[:k + 1]).removesuffix("</think>")
    assert thinking.strip() and "".join(e.text for e in events if isinstance(e, Reasoning)) == thinking
    assert "".join(e.text for e in events if isinstance(e, Content)) == out.text[-3:]
