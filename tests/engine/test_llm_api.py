"""The offline API on the bundled model: inputs, n>1, stop strings, logprobs, seeds, errors."""

from __future__ import annotations

import pytest

from pagedserve import LLM, SamplingParams
from helpers import assert_no_leak


@pytest.fixture(scope="module")
def llm(bundled_path):
    return LLM(str(bundled_path), dtype="float32", num_kv_blocks=256)


@pytest.fixture(autouse=True)
def no_leak(llm):
    yield
    assert_no_leak(llm)


def chat(llm: LLM, text: str) -> str:
    return llm.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)


def test_text_and_token_prompts_agree(llm):
    params = SamplingParams(temperature=0, max_tokens=12)
    by_text = llm.generate("The capital of France is", params)[0]
    by_ids = llm.generate([llm.tokenizer.encode("The capital of France is")], params)[0]
    assert by_text.outputs[0].token_ids == by_ids.outputs[0].token_ids
    assert by_text.outputs[0].text == llm.tokenizer.decode(by_text.outputs[0].token_ids)
    assert "Paris" in by_text.outputs[0].text


def test_one_result_per_prompt_in_order(llm):
    prompts = ["One", "Two three", "Four five six"]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=3))
    assert [o.prompt for o in outs] == prompts
    assert all(len(o.outputs) == 1 and o.outputs[0].finish_reason in ("length", "stop") for o in outs)


def test_eos_stops_with_reason_stop(llm):
    out = llm.generate(chat(llm, "Say hi."), SamplingParams(temperature=0, max_tokens=200))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason in (llm.tokenizer.eos_token_id, 2)
    assert len(out.token_ids) < 200


def test_max_tokens_gives_length(llm):
    out = llm.generate("Count: 1, 2, 3,", SamplingParams(temperature=0, max_tokens=5))[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5


def test_ignore_eos_runs_to_max_tokens(llm):
    out = llm.generate(chat(llm, "Say hi."), SamplingParams(temperature=0, max_tokens=60,
                                                            ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 60 and out.finish_reason == "length"


def test_stop_string_truncates_text(llm):
    params = SamplingParams(temperature=0, max_tokens=30, stop=["Paris"])
    out = llm.generate("The capital of France is", params)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == "Paris"
    assert "Paris" not in out.text
    kept = llm.generate("The capital of France is", SamplingParams(
        temperature=0, max_tokens=30, stop=["Paris"], include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text.endswith("Paris")


def test_stop_token_ids(llm):
    first = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=8))[0]
    third = first.outputs[0].token_ids[2]
    out = llm.generate("The capital of France is", SamplingParams(
        temperature=0, max_tokens=8, stop_token_ids=[third]))[0].outputs[0]
    assert out.token_ids == first.outputs[0].token_ids[:3]
    assert out.finish_reason == "stop" and out.stop_reason == third


def test_n_samples_share_the_prompt_and_differ(llm):
    out = llm.generate(chat(llm, "Write a story."), SamplingParams(n=4, temperature=1.0, seed=7,
                                                                   max_tokens=16))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    again = llm.generate(chat(llm, "Write a story."), SamplingParams(n=4, temperature=1.0, seed=7,
                                                                     max_tokens=16))[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]


def test_n_greedy_samples_are_identical(llm):
    out = llm.generate("The capital of France is", SamplingParams(n=3, temperature=0, max_tokens=10))[0]
    assert out.outputs[0].token_ids == out.outputs[1].token_ids == out.outputs[2].token_ids


def test_seed_reproducible_whatever_the_batch(llm):
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=20)
    alone = llm.generate("Tell me a joke", params)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=25)
    batch = llm.generate(["Hello there", "Tell me a joke", "A long time ago"], [others, params, others])
    assert batch[1].outputs[0].token_ids == alone


def test_logprobs_hold_sampled_token_and_top_n(llm):
    out = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=4,
                                                                  logprobs=3))[0].outputs[0]
    assert len(out.logprobs) == 4
    for token, lp in zip(out.token_ids, out.logprobs):
        assert token in lp and 3 <= len(lp) <= 4
        assert max(lp, key=lp.get) == token  # greedy: the sampled token is the most likely
        assert all(v <= 0 for v in lp.values())


@pytest.mark.parametrize("field,value,message", [
    ("temperature", -1.0, "temperature: must be in [0.0, 100.0]"),
    ("top_p", 0.0, "top_p: must be in (0.0, 1.0]"),
    ("top_k", -2, "top_k"),
    ("n", 0, "n: must be in [1, 64]"),
    ("max_tokens", 0, "max_tokens: must be in [1,"),
    ("logprobs", 21, "logprobs: must be in [0, 20]"),
    ("temperature", float("nan"), "temperature: must be a finite number"),
    ("repetition_penalty", 0.0, "repetition_penalty"),
])
def test_invalid_params_name_field_and_range(field, value, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(")):
        SamplingParams(**{field: value})


def test_request_errors_leave_engine_usable(llm):
    vocab = llm.engine.vocab_size
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([[1, 2, vocab]], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="at least one token"):
        llm.generate([[]], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match=r"max_tokens \(\d+\) = \d+ exceeds"):
        llm.generate([[1] * 10], SamplingParams(max_tokens=llm.engine.max_model_len))
    assert llm.generate("Hi", SamplingParams(temperature=0, max_tokens=3))[0].outputs[0].token_ids


def test_request_longer_than_the_kv_pool_is_refused(bundled_path):
    # 8 blocks of 16 hold 128 tokens: the model's 8192 is lowered to that, and the error says why.
    small = LLM(str(bundled_path), dtype="float32", num_kv_blocks=8)
    assert small.engine.max_model_len == 128
    with pytest.raises(ValueError, match=r"KV cache's capacity of 128 tokens.*can never fit"):
        small.engine.add_request("too-big", [1] * 100, SamplingParams(max_tokens=29))
    assert small.generate([[1] * 100], SamplingParams(temperature=0, max_tokens=28))[0].outputs[0].token_ids
    assert_no_leak(small)


def test_unknown_engine_option_is_rejected(bundled_path):
    with pytest.raises(ValueError, match="unknown engine option"):
        LLM(str(bundled_path), block_sz=16)
