"""Speculative decoding served end to end: an engine with `--speculative-method ngram` behind a
frontend, driven by gRPC stubs and the `openai` and `anthropic` SDKs. Replies equal the offline
engine's without speculation; the engine's /metrics count drafts; a request can opt out."""

from __future__ import annotations

import pytest

from grpc_client import generate, greedy, user
from http_client import anthropic_client, kv_free_after, model, openai_client  # noqa: F401 - fixtures
from test_operations import metric, read_metrics_url, scrape

TEXT = ("The committee met on Tuesday to review the budget for the new library. After a long "
        "discussion, they agreed to spend more on children's books and less on furniture.")
ASK = f"Repeat the text below word for word, but change Tuesday to Monday.\n\n{TEXT}"
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def speculative(procs):
    address = f"tcp://127.0.0.1:{procs.free_port()}"
    engine = procs.start_engine(address, "--speculative-method", "ngram", "--num-speculative-tokens", "4",
                                "--metrics-port", "0")
    fe = procs.start_frontend(address)
    fe.engine_url = read_metrics_url(engine)
    fe.wait_serving()
    yield fe
    fe.close()
    procs.stop(engine)


@pytest.fixture(scope="module")
def frontend(speculative):  # http_client's fixtures (model, kv_free_after) take `frontend`
    return speculative


@pytest.fixture(scope="module")
def expected(bundled_path, bundled_tokenizer):
    """The offline engine without speculation, as the server runs (float32, greedy)."""
    from pagedserve import LLM, SamplingParams
    llm = LLM(str(bundled_path), dtype="float32", num_kv_blocks=64)
    prompt = bundled_tokenizer.apply_chat_template([{"role": "user", "content": ASK}], add_generation_prompt=True,
                                                   tokenize=False)
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))[0].outputs[0]
    return out.token_ids, out.text


def spec_counters(fe) -> dict[str, float]:
    samples = scrape(fe.engine_url)
    counters = {name: metric(samples, f"pagedserve:spec_decode_{name}_total")
                for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
    counters["pos0"] = metric(samples, "pagedserve:spec_decode_num_accepted_tokens_per_pos_total", position="0")
    return counters


def test_grpc_reply_equals_no_speculation_and_metrics_count_drafts(speculative, expected):
    before = spec_counters(speculative)
    result = generate(speculative, chat=user(ASK), sampling=greedy(MAX_TOKENS))
    assert result.tokens[0] == expected[0] and result.texts[0] == expected[1]
    after = spec_counters(speculative)
    drafts = after["num_drafts"] - before["num_drafts"]
    accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
    assert drafts > 0 and 0 < accepted <= after["num_draft_tokens"] - before["num_draft_tokens"]
    assert 0 < after["pos0"] - before["pos0"] <= drafts
    # A copying reply is mostly accepted drafts: far fewer steps than tokens.
    assert drafts < len(expected[0]) / 2


def test_grpc_opt_out_proposes_nothing(speculative, expected):
    before = spec_counters(speculative)
    result = generate(speculative, chat=user(ASK), sampling=greedy(MAX_TOKENS, disable_speculation=True))
    assert result.tokens[0] == expected[0]
    assert spec_counters(speculative)["num_drafts"] == before["num_drafts"]


def test_openai_stream_and_stop_string_inside_accepted_runs(speculative, expected, model, kv_free_after):
    with openai_client(speculative) as client:
        messages = [{"role": "user", "content": ASK}]
        whole = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=MAX_TOKENS)
        assert whole.choices[0].message.content == expected[1]
        stream = client.chat.completions.create(model=model, messages=messages, temperature=0,
                                                max_tokens=MAX_TOKENS, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == expected[1]
        # A stop string in the middle of the copied text, where drafts run several tokens a step.
        stop = "books"
        cut = client.chat.completions.create(model=model, messages=messages, temperature=0,
                                             max_tokens=MAX_TOKENS, stop=[stop])
        assert cut.choices[0].finish_reason == "stop"
        assert cut.choices[0].message.content == expected[1][:expected[1].index(stop)]


def test_anthropic_reply_with_and_without_speculation(speculative, expected, model, kv_free_after):
    client = anthropic_client(speculative)
    for opt_out in (False, True):
        message = client.messages.create(model=model, max_tokens=MAX_TOKENS,
                                         messages=[{"role": "user", "content": ASK}],
                                         extra_body={"temperature": 0, "disable_speculation": opt_out})
        assert message.content[0].text == expected[1]
