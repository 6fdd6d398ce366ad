"""gRPC end to end, generation: streaming, n > 1, chat, stop strings, the same tokens as the
offline API, concurrent streams, an unset max_tokens. Shared engine and frontend (conftest.py)."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import pytest

from grpc_client import FR, MAX_MODEL_LEN, STORY, VOCAB_SIZE, detokenize, generate, greedy, stop_across, user
from common.v1 import generation_pb2 as gen, tokenization_pb2 as tok


# -- streaming ----------------------------------------------------------------------------

def test_stream_started_chunks_finished_and_text_deltas(frontend):
    prompt = "def fibonacci(n):"
    r = generate(frontend, text=prompt, sampling=greedy(32, ignore_eos=True, logprobs=2))
    assert re.fullmatch(r"[A-Za-z0-9._:@=+-]{1,128}", r.started.request_id), r.started
    prompt_ids = frontend.tokenization.Tokenize(tok.TokenizeRequest(text=prompt), timeout=10).token_ids
    assert r.started.prompt_tokens == len(prompt_ids) > 0
    assert list(r.finished) == [0]
    f = r.finished[0]
    assert f.reason == FR.FINISH_REASON_LENGTH
    assert f.usage.completion_tokens == len(r.tokens[0]) == 32
    assert f.usage.prompt_tokens == len(prompt_ids)
    # the deltas concatenate exactly to the detokenized output, and it streamed in pieces
    assert r.texts[0] == detokenize(frontend, r.tokens[0])
    assert "\n" in r.texts[0]
    assert len(r.chunks[0]) >= 4, [c.token_ids for c in r.chunks[0]]
    # logprobs: one per token, the sampled (greedy) token is the most likely one
    for chunk in r.chunks[0]:
        assert len(chunk.logprobs) == len(chunk.token_ids)
        for token_id, lp in zip(chunk.token_ids, chunk.logprobs):
            assert lp.sampled.token_id == token_id and lp.sampled.logprob <= 0
            assert len(lp.top) == 2 and lp.top[0].token_id == token_id
            assert lp.top[0].logprob >= lp.top[1].logprob
    frontend.wait_kv_free()

    # a given request id is echoed; the greedy output does not change
    again = generate(frontend, request_id="my-req.1:x@y=z+w", text=prompt, sampling=greedy(32, ignore_eos=True))
    assert again.started.request_id == "my-req.1:x@y=z+w"
    assert again.tokens[0] == r.tokens[0]
    frontend.wait_kv_free()


def test_assigned_request_ids_are_unique(frontend):
    ids = {generate(frontend, text="Hi", sampling=greedy(1)).started.request_id for _ in range(3)}
    assert len(ids) == 3 and all(ids)
    frontend.wait_kv_free()


# -- n > 1 --------------------------------------------------------------------------------

def test_n_samples_tagged_by_index_and_seeded(frontend):
    sampling = gen.SamplingParams(n=3, temperature=1.0, seed=1234, max_tokens=12, ignore_eos=True)
    first = generate(frontend, text="My favourite animal is", sampling=sampling)
    assert sorted(first.finished) == [0, 1, 2]
    assert sorted(first.chunks) == [0, 1, 2]
    for i in range(3):
        assert first.finished[i].reason == FR.FINISH_REASON_LENGTH
        assert len(first.tokens[i]) == 12
        assert first.texts[i] == detokenize(frontend, first.tokens[i])
    assert len({tuple(first.tokens[i]) for i in range(3)}) > 1, "the 3 samples are all the same"
    frontend.wait_kv_free()

    second = generate(frontend, text="My favourite animal is", sampling=sampling)
    assert second.tokens == first.tokens
    frontend.wait_kv_free()


# -- chat ---------------------------------------------------------------------------------

def test_chat_answers(frontend):
    chat = user("What is the capital of France?")
    r = generate(frontend, chat=chat, sampling=greedy(32))
    assert "Paris" in r.texts[0], r.texts[0]
    assert r.finished[0].reason in (FR.FINISH_REASON_EOS, FR.FINISH_REASON_LENGTH)
    rendered = frontend.tokenization.Tokenize(tok.TokenizeRequest(chat=chat), timeout=10).token_ids
    assert r.started.prompt_tokens == len(rendered) > 16
    frontend.wait_kv_free()
    # the same prompt again: its full KV blocks come from the prefix cache
    again = generate(frontend, chat=chat, sampling=greedy(2))
    cached = again.started.cached_tokens
    assert 16 <= cached < len(rendered) and cached % 16 == 0, again.started
    assert again.finished[0].usage.cached_tokens == cached
    assert again.tokens[0] == r.tokens[0][:2]
    frontend.wait_kv_free()


# -- stop strings -------------------------------------------------------------------------

@pytest.mark.parametrize("include", [False, True], ids=["excluded", "included"])
def test_stop_string_across_tokens(frontend, include):
    free = generate(frontend, text=STORY, sampling=greedy(24))
    ids, text = free.tokens[0], free.texts[0]
    assert len(ids) == 24 and text == detokenize(frontend, ids)
    stop, pos = stop_across(frontend, ids, first_boundary=6)

    r = generate(frontend, text=STORY, include_stop_str_in_output=include,
                 sampling=greedy(24, stop=["zzzz-never", stop]))
    f = r.finished[0]
    assert f.reason == FR.FINISH_REASON_STOP_STRING, f
    assert f.WhichOneof("matched_stop") == "stop_string" and f.stop_string == stop
    expected = text[:pos + len(stop)] if include else text[:pos]
    assert r.texts[0] == expected, (r.texts[0], stop)
    if not include:
        assert all(stop not in c.text for c in r.chunks.get(0, []))
        assert stop not in r.texts[0]
    assert r.tokens[0] == ids[:len(r.tokens[0])]
    assert len(r.tokens[0]) < 24
    frontend.wait_kv_free()


def test_stop_token_id(frontend):
    free = generate(frontend, text=STORY, sampling=greedy(24)).tokens[0]
    k = next(i for i in range(3, len(free)) if free[i] not in free[:i])  # first occurrence
    r = generate(frontend, text=STORY, sampling=greedy(24, stop_token_ids=[VOCAB_SIZE - 1, free[k]]))
    f = r.finished[0]
    assert f.reason == FR.FINISH_REASON_STOP_TOKEN and f.WhichOneof("matched_stop") == "stop_token_id"
    assert f.stop_token_id == free[k]
    assert r.tokens[0] == free[:k + 1]
    assert r.texts[0] == detokenize(frontend, r.tokens[0])
    frontend.wait_kv_free()


def test_multibyte_characters_are_never_split(frontend):
    """An emoji spans several byte-level tokens: no delta may carry half of it."""
    r = generate(frontend, chat=user("Write three emoji that describe happiness."), sampling=greedy(24))
    text = r.texts[0]
    assert text == detokenize(frontend, r.tokens[0])
    assert any(ord(ch) > 0xFFFF for ch in text), text  # the test means something only with one
    assert "\ufffd" not in text
    assert all("\ufffd" not in c.text for c in r.chunks[0]), [c.text for c in r.chunks[0]]
    assert any(c.token_ids and not c.text for c in r.chunks[0]), "nothing was held back"
    frontend.wait_kv_free()


# -- the same tokens as the offline API ---------------------------------------------------

def test_greedy_matches_offline_llm(frontend):
    prompts = ["The capital of France is", "def fibonacci(n):", STORY]
    ours = [generate(frontend, text=p, sampling=greedy(24)) for p in prompts]
    frontend.wait_kv_free()

    from pagedserve import LLM, SamplingParams
    llm = LLM(model=None, dtype="float32", num_kv_blocks=64, max_model_len=MAX_MODEL_LEN, num_threads=1)
    params = SamplingParams(temperature=0, max_tokens=24)
    for prompt, r in zip(prompts, ours):
        offline = llm.generate(prompt, params)[0]
        assert r.started.prompt_tokens == len(offline.prompt_token_ids)
        assert r.tokens[0] == offline.outputs[0].token_ids, prompt
        assert r.texts[0] == offline.outputs[0].text


# -- concurrent streams -------------------------------------------------------------------

def test_concurrent_streams_match_sequential(frontend):
    prompts = [f"Fact number {i}: the number {i * 7} is" for i in range(16)]
    sequential = [generate(frontend, text=p, sampling=greedy(8)).tokens[0] for p in prompts]
    frontend.wait_kv_free()
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda p: generate(frontend, text=p, sampling=greedy(8)), prompts))
    assert all(r.finished[0].reason in (FR.FINISH_REASON_LENGTH, FR.FINISH_REASON_EOS) for r in results)
    mismatched = [i for i, (r, want) in enumerate(zip(results, sequential)) if r.tokens[0] != want]
    assert not mismatched, [(prompts[i], results[i].tokens[0], sequential[i]) for i in mismatched]
    frontend.wait_kv_free()


# -- max_tokens left unset -------------------------------------------------------------------

def test_unset_max_tokens_is_not_16(frontend):
    learned = generate(frontend, text=STORY, sampling=greedy(30))
    assert learned.finished[0].reason == FR.FINISH_REASON_LENGTH  # no eos in the first 30 tokens
    stop, pos = stop_across(frontend, learned.tokens[0], first_boundary=20)
    r = generate(frontend, text=STORY, sampling=gen.SamplingParams(temperature=0, stop=[stop]))
    frontend.wait_kv_free()
    assert r.finished[0].reason == FR.FINISH_REASON_STOP_STRING, r.finished[0]
    assert r.texts[0] == learned.texts[0][:pos]
