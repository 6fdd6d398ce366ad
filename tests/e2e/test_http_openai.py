"""End to end over the OpenAI-compatible HTTP API: real engine and frontend processes on
loopback (conftest's module fixtures, fp32), driven by the official, unmodified `openai` SDK,
with httpx for the server routes. Every test ends with every KV block free (over gRPC)."""

from __future__ import annotations

import asyncio
import math
import re

import httpx
import openai
import pytest

from grpc_client import generate, greedy
from http_client import kv_free_after, model  # noqa: F401 - shared fixtures
from http_client import (async_openai_client, openai_client, post, stop_inside,
                         tokenize)
from common.v1 import info_pb2

PROMPT = "The capital of France is"
GREEDY = dict(temperature=0, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def client(frontend):
    with openai_client(frontend) as c:
        yield c


def greedy_text(client, model, prompt, max_tokens: int = 16) -> str:
    r = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, **GREEDY)
    return r.choices[0].text


# -- completions -----------------------------------------------------------------------------

def test_completion(client, model, frontend):
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, **GREEDY)
    assert r.object == "text_completion" and r.id.startswith("cmpl-") and r.model == model
    [choice] = r.choices
    assert choice.index == 0 and choice.finish_reason == "length" and "Paris" in choice.text
    assert choice.model_extra["stop_reason"] is None
    assert r.usage.prompt_tokens == len(tokenize(frontend, prompt=PROMPT))
    assert r.usage.completion_tokens == 8 and r.usage.total_tokens == r.usage.prompt_tokens + 8


def test_completion_stream_with_usage(client, model):
    whole = greedy_text(client, model, PROMPT, 12)
    chunks = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=12, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    *text_chunks, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == 12
    assert all(c.usage is None for c in text_chunks)
    assert len(text_chunks) >= 3, "it streamed in pieces"
    assert "".join(c.choices[0].text for c in text_chunks) == whole
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert len({c.id for c in chunks}) == 1


def test_completion_continuous_usage_stats(client, model):
    chunks = list(client.completions.create(
        model=model, prompt=PROMPT, max_tokens=6, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}, **GREEDY))
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 6, counts
    assert all(c.usage.prompt_tokens == chunks[0].usage.prompt_tokens > 0 for c in chunks)


def test_n_samples_seeded(client, model):
    def run():
        return client.completions.create(model=model, prompt="Once upon a time", n=2, seed=1234, temperature=1.0,
                                         max_tokens=8, extra_body={"ignore_eos": True})
    first, again = run(), run()
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.text for c in again.choices] == [c.text for c in first.choices]
    assert first.choices[0].text != first.choices[1].text, "the two samples must not share a seed"
    assert first.usage.completion_tokens == 16


def test_many_prompts_in_one_request(client, model, frontend):
    prompts = [PROMPT, "def add(a, b):"]
    solo = [greedy_text(client, model, p, 6) for p in prompts]
    assert solo[0] != solo[1]
    as_ids = [tokenize(frontend, prompt=p) for p in prompts]
    for prompt in (prompts, as_ids):
        r = client.completions.create(model=model, prompt=prompt, n=2, max_tokens=6, **GREEDY)
        assert [c.index for c in r.choices] == [0, 1, 2, 3]
        # choice index = prompt * n + sample
        assert [c.text for c in r.choices] == [solo[0], solo[0], solo[1], solo[1]]
        assert r.usage.prompt_tokens == sum(map(len, as_ids)) and r.usage.completion_tokens == 24


def test_token_id_prompt(client, model, frontend):
    ids = tokenize(frontend, prompt=PROMPT)
    r = client.completions.create(model=model, prompt=ids, max_tokens=6, **GREEDY)
    assert r.choices[0].text == greedy_text(client, model, PROMPT, 6)
    assert r.usage.prompt_tokens == len(ids)


def test_token_id_prompt_cut_inside_a_character(client, model, frontend):
    """The prompt ends with 2 of 語's 3 byte tokens and the model writes the third: the text
    begins with the whole character (the output's), streamed or not, and shows no U+FFFD."""
    ids = tokenize(frontend, prompt="日本語 日本語 日本語 日本語")[:-1]
    whole = client.completions.create(model=model, prompt=ids, max_tokens=4, **GREEDY).choices[0].text
    stream = client.completions.create(model=model, prompt=ids, max_tokens=4, stream=True, **GREEDY)
    pieces = [chunk.choices[0].text for chunk in stream]
    assert whole.startswith("語") and "\ufffd" not in whole, whole
    assert "".join(pieces) == whole and pieces[0] == "語", pieces


def test_logprobs_shape(client, model):
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=5, logprobs=2, **GREEDY)
    choice = r.choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert "".join(lp.tokens) == choice.text
    assert all(isinstance(x, float) and x <= 0 for x in lp.token_logprobs)
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 2 and all(v <= 0 for v in top.values())
        assert math.isclose(top[token], logprob, abs_tol=1e-6)  # greedy: the chosen one is the likeliest
        assert logprob == max(top.values())
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]


def test_streamed_logprobs_offsets_continue(client, model):
    """text_offset counts from the start of the text in every chunk, as vLLM streams it."""
    whole = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, logprobs=1, **GREEDY)
    chunks = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=6, logprobs=1, stream=True,
                                            **GREEDY))
    tokens = [t for c in chunks for t in c.choices[0].logprobs.tokens]
    offsets = [o for c in chunks for o in c.choices[0].logprobs.text_offset]
    assert tokens == whole.choices[0].logprobs.tokens
    assert offsets == whole.choices[0].logprobs.text_offset


def test_echo_logprobs_for_loglikelihood(client, model, frontend):
    """lm-evaluation-harness's loglikelihood request: echo the prompt with its logprobs."""
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=1, echo=True, logprobs=1, temperature=0)
    choice = r.choices[0]
    num_prompt = len(tokenize(frontend, prompt=PROMPT))
    assert choice.text.startswith(PROMPT) and len(choice.text) > len(PROMPT)
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == num_prompt + 1
    assert "".join(lp.tokens[:num_prompt]) == PROMPT
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(isinstance(x, float) and x <= 0 for x in lp.token_logprobs[1:])
    assert lp.text_offset[0] == 0 and lp.text_offset[num_prompt] == len(PROMPT)
    # the continuation's logprob is the one a plain request gives
    plain = client.completions.create(model=model, prompt=PROMPT, max_tokens=1, logprobs=1, temperature=0)
    assert math.isclose(lp.token_logprobs[-1], plain.choices[0].logprobs.token_logprobs[0], abs_tol=1e-4)
    # gRPC's prompt_logprobs (in Started) are the same numbers
    started = generate(frontend, text=PROMPT, sampling=greedy(1, prompt_logprobs=1)).started
    assert [p.sampled.token_id for p in started.prompt_logprobs] == tokenize(frontend, prompt=PROMPT)[1:]
    assert all(len(p.top) == 1 and p.top[0].logprob >= p.sampled.logprob for p in started.prompt_logprobs)
    for ours, theirs in zip(started.prompt_logprobs, lp.token_logprobs[1:num_prompt]):
        assert math.isclose(ours.sampled.logprob, theirs, abs_tol=1e-4)


def test_echo_streamed(client, model):
    """A stream echoes the prompt too (in each choice's first chunk), with its logprobs."""
    whole = client.completions.create(model=model, prompt=PROMPT, max_tokens=3, echo=True, logprobs=1, temperature=0)
    chunks = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=3, echo=True, logprobs=1,
                                            temperature=0, stream=True))
    assert whole.choices[0].text.startswith(PROMPT)
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[0].choices[0].text.startswith(PROMPT)
    want = whole.choices[0].logprobs
    got = {key: [x for c in chunks for x in getattr(c.choices[0].logprobs, key)]
           for key in ("tokens", "text_offset", "token_logprobs")}
    assert got["tokens"] == want.tokens and got["text_offset"] == want.text_offset
    assert got["token_logprobs"][0] is None
    assert got["token_logprobs"] == pytest.approx(want.token_logprobs, abs=1e-4)


def test_stop_string(client, model):
    full = greedy_text(client, model, PROMPT, 16)
    stop, at = stop_inside(full)
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=16, stop=[stop], **GREEDY)
    choice = r.choices[0]
    assert choice.finish_reason == "stop" and choice.model_extra["stop_reason"] == stop
    assert choice.text == full[:at]
    chunks = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=16, stop=stop, stream=True,
                                            **GREEDY))
    assert "".join(c.choices[0].text for c in chunks) == full[:at]
    assert chunks[-1].choices[0].finish_reason == "stop" and chunks[-1].choices[0].model_extra["stop_reason"] == stop


# -- the same tokens over HTTP, gRPC and the offline API --------------------------------------

def test_greedy_matches_grpc_and_offline_llm(client, model, frontend):
    """The engine runs in fp32 (conftest's ENGINE_FLAGS: --dtype float32), as the offline LLM here."""
    prompt = "def fibonacci(n):"
    http = client.completions.create(model=model, prompt=prompt, max_tokens=16, logprobs=0, **GREEDY)
    choice = http.choices[0]
    grpc_result = generate(frontend, text=prompt, sampling=greedy(16, ignore_eos=True))
    frontend.wait_kv_free()

    from pagedserve import LLM, SamplingParams
    llm = LLM(model=None, dtype="float32", num_kv_blocks=64, max_model_len=2048, num_threads=1)
    offline = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0))[0]
    ids = offline.outputs[0].token_ids
    assert grpc_result.tokens[0] == ids
    assert choice.text == grpc_result.texts[0] == offline.outputs[0].text
    assert http.usage.prompt_tokens == grpc_result.started.prompt_tokens == len(offline.prompt_token_ids)
    # HTTP gives no ids: each token's own text must be that of the offline token at its place
    own_text = [post(frontend, "/detokenize", {"tokens": [t]}).json()["prompt"] for t in ids]
    assert choice.logprobs.tokens == own_text
    for got, want, token in zip(choice.logprobs.token_logprobs, offline.outputs[0].logprobs, ids):
        assert math.isclose(got, want[token], abs_tol=1e-3)


def test_concurrent_streams(client, model, frontend):
    prompts = [f"Fact number {i}: the number {i * 7} is" for i in range(16)]

    async def one(c, prompt: str) -> tuple[int, str | None, int, str]:
        tokens, reason, usage, text = 0, None, 0, ""
        stream = await c.completions.create(model=model, prompt=prompt, max_tokens=8, logprobs=0, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY)
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage.completion_tokens
            for choice in chunk.choices:
                tokens += len(choice.logprobs.tokens)
                text += choice.text
                reason = choice.finish_reason or reason
        return tokens, reason, usage, text

    async def all_of_them():
        async with async_openai_client(frontend) as c:
            return await asyncio.gather(*(one(c, p) for p in prompts))

    results = asyncio.run(all_of_them())
    assert all(r[:3] == (8, "length", 8) for r in results), results
    assert results[0][3] == greedy_text(client, model, prompts[0], 8), "batched output differs from solo"


# -- chat ------------------------------------------------------------------------------------

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_chat(client, model, frontend):
    r = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=6, temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    [choice] = r.choices
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length" and "stop_reason" in choice.model_extra
    assert r.usage.completion_tokens == 6
    assert r.usage.prompt_tokens == len(tokenize(frontend, messages=QUESTION))
    short = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=6, max_completion_tokens=2,
                                           temperature=0)
    assert short.usage.completion_tokens == 2  # max_completion_tokens wins over max_tokens
    assert choice.message.content.startswith(short.choices[0].message.content)


def test_chat_stream(client, model):
    whole = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=6, temperature=0)
    chunks = list(client.chat.completions.create(model=model, messages=QUESTION, max_tokens=6, temperature=0, n=2,
                                                 stream=True))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    for index in (0, 1):
        mine = [ch for c in chunks for ch in c.choices if ch.index == index]
        assert mine[0].delta.role == "assistant"
        assert all(ch.delta.role is None for ch in mine[1:])
        assert "".join(ch.delta.content or "" for ch in mine) == whole.choices[0].message.content
        [last] = [ch for ch in mine if ch.finish_reason is not None]
        assert last is mine[-1] and last.finish_reason == "length"
        assert "stop_reason" in last.model_extra and last.model_extra["stop_reason"] is None


def test_chat_stop_reason_streamed(client, model):
    full = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=12, temperature=0)
    stop, at = stop_inside(full.choices[0].message.content)
    chunks = list(client.chat.completions.create(model=model, messages=QUESTION, max_tokens=12, temperature=0,
                                                 stop=[stop], stream=True))
    [last] = [ch for c in chunks for ch in c.choices if ch.finish_reason is not None]
    assert last.finish_reason == "stop" and last.model_extra["stop_reason"] == stop
    assert "".join(ch.delta.content or "" for c in chunks for ch in c.choices) == full.choices[0].message.content[:at]


def test_chat_logprobs(client, model):
    r = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=4, temperature=0, logprobs=True,
                                       top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == 4
    assert "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:
        assert t.logprob <= 0 and t.bytes == list(t.token.encode())
        assert len(t.top_logprobs) == 2 and t.top_logprobs[0].token == t.token  # greedy
        assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob
        assert all(top.bytes == list(top.token.encode()) for top in t.top_logprobs)
    plain = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=4, temperature=0)
    assert plain.choices[0].logprobs is None


def test_chat_continue_final_message(client, model, frontend):
    messages = [{"role": "user", "content": "Name a fruit."},
                {"role": "assistant", "content": "My favourite fruit is the"}]
    r = client.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0,
                                       extra_body={"continue_final_message": True, "add_generation_prompt": False,
                                                   "ignore_eos": True})
    # The same as completing the rendered conversation with its last turn left open.
    rendered = post(frontend, "/tokenize", {"messages": messages, "add_generation_prompt": False}).json()
    ids, strs = rendered["tokens"], rendered["token_strs"]
    assert strs[-2:] == ["<|im_end|>", "Ċ"], strs
    raw = client.completions.create(model=model, prompt=ids[:-2], max_tokens=6, **GREEDY)
    assert r.choices[0].message.content == raw.choices[0].text
    assert r.usage.prompt_tokens == len(ids) - 2
    answered = client.chat.completions.create(model=model, messages=messages, max_tokens=1, temperature=0)
    assert answered.usage.prompt_tokens > r.usage.prompt_tokens  # a new assistant turn, not a continuation


def test_chat_template_kwargs(client, model):
    base = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=2, temperature=0)
    r = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=2, temperature=0,
                                       extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.usage.prompt_tokens == base.usage.prompt_tokens  # this template reads no such variable
    assert r.choices[0].message.content == base.choices[0].message.content
    # a kwarg that clashes with the renderer's own arguments is the client's mistake, not a crash
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model, messages=QUESTION, max_tokens=2,
                                       extra_body={"chat_template_kwargs": {"add_generation_prompt": 1}})
    assert "template" in info.value.body["message"]


# -- server routes ---------------------------------------------------------------------------

def test_models(client, frontend):
    [m] = client.models.list().data
    info = frontend.info.GetModelInfo(info_pb2.GetModelInfoRequest(), timeout=10)
    assert m.id == info.model_name and m.object == "model"
    assert m.model_extra["max_model_len"] == info.max_model_len == 2048
    assert m.model_extra["quantization"] == info.quantization == "gguf"  # the weights' format (issue 46)


def test_health_version_tokenize_detokenize(frontend):
    base = frontend.http_url
    health = httpx.get(f"{base}/health", timeout=10)
    assert health.status_code == 200
    version = httpx.get(f"{base}/version", timeout=10).json()["version"]
    assert re.fullmatch(r"\d+\.\d+\.\d+.*", version)
    text = "Hello world, how are you?"
    r = post(frontend, "/tokenize", {"prompt": text}).json()
    assert r["count"] == len(r["tokens"]) == len(r["token_strs"]) > 0 and r["max_model_len"] == 2048
    assert post(frontend, "/detokenize", {"tokens": r["tokens"]}).json() == {"prompt": text}
    chat = post(frontend, "/tokenize", {"messages": QUESTION}).json()
    assert chat["token_strs"][0] == "<|im_start|>" and chat["count"] > r["count"]


def test_metrics_on_http_port(client, model, frontend):
    client.completions.create(model=model, prompt=PROMPT, max_tokens=2, temperature=0)
    r = httpx.get(f"{frontend.http_url}/metrics", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    for name in ("pagedserve:num_requests_running", "pagedserve:kv_cache_usage_perc", "pagedserve:active_streams"):
        assert re.search(rf"^{re.escape(name)}[{{ ]", r.text, re.M), name
