"""The output processor on hand-made engine outputs: text, stop strings, finish reasons,
n>1, logprobs, prompt logprobs. No engine, no processes."""

from __future__ import annotations

import pytest

from common.outputs import EngineCoreOutput, sample_request_id
from common.sampling_params import SamplingParams
from frontend.output_processor import (ABORT, EOS, LENGTH, STOP_STRING, STOP_TOKEN, TIME_LIMIT, OutputProcessor,
                                       PositionLogprobs, RequestState, SampleDelta, TokenLogprob)

RID = "req-1"
EOS_ID = 2  # SmolLM2's <|im_end|>
STORY = "The quick brown fox jumps over the lazy dog 🦊 and runs."


@pytest.fixture(scope="module")
def frontend_tokenizer(bundled_tokenizer):
    from engine.models.loader import tokenizer_files
    from frontend.tokenizer import Tokenizer
    return Tokenizer.from_files(tokenizer_files(bundled_tokenizer))


@pytest.fixture(params=["hf", "frontend"])
def tok(request, bundled_tokenizer, frontend_tokenizer):
    assert bundled_tokenizer.eos_token_id == frontend_tokenizer.eos_token_id == EOS_ID
    return bundled_tokenizer if request.param == "hf" else frontend_tokenizer


def encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def out(token_ids: list[int], index: int = 0, finish: str | None = None, stop_token: int | None = None,
        logprobs: list[dict[int, float]] | None = None, request_id: str = RID, **kwargs) -> EngineCoreOutput:
    return EngineCoreOutput(request_id, index, list(token_ids), logprobs, finish, stop_token, **kwargs)


def state_for(tok, params: SamplingParams, prompt: str = "Tell me a story:", rid: str = RID) -> RequestState:
    return RequestState(rid, encode(tok, prompt), params, tok, [EOS_ID])


def one_by_one(state: RequestState, ids: list[int], finish: str | None = None,
               stop_token: int | None = None) -> list[tuple[list[SampleDelta], list[str]]]:
    """Each token in its own engine output; the last one carries `finish`."""
    results = []
    for i, t in enumerate(ids):
        last = i == len(ids) - 1
        results.append(state.process([out([t], finish=finish if last else None,
                                          stop_token=stop_token if last else None)]))
    return results


def texts(results) -> str:
    return "".join(d.text for deltas, _ in results for d in deltas)


def test_deltas_concatenate_to_the_text(tok):
    ids = encode(tok, STORY)
    state = state_for(tok, SamplingParams(max_tokens=len(ids)))
    results = one_by_one(state, ids, finish="length")
    assert texts(results) == tok.decode(ids) == STORY
    assert all(len(deltas) == 1 and not stop for deltas, stop in results)
    assert [deltas[0].num_tokens for deltas, _ in results] == list(range(1, len(ids) + 1))
    assert [deltas[0].token_ids for deltas, _ in results] == [[t] for t in ids]
    *middle, (last, _) = results
    assert all(d[0].finish_reason is None for d, _ in middle)
    assert (last[0].finish_reason, last[0].stop_reason) == (LENGTH, None)
    assert state.done and state.num_completion_tokens == len(ids)


def test_stop_string_ends_the_sample_and_asks_the_engine_to_stop(tok):
    ids = encode(tok, STORY)
    state = state_for(tok, SamplingParams(stop=["fox j"], max_tokens=100))
    results = one_by_one(state, ids)
    stopped_at = next(i for i, (_, stop) in enumerate(results) if stop)
    assert results[stopped_at][1] == [RID]
    delta = results[stopped_at][0][0]
    assert (delta.finish_reason, delta.stop_reason) == (STOP_STRING, "fox j")
    assert texts(results) == "The quick brown "
    assert ids[stopped_at] != ids[-1] and all(r == ([], []) for r in results[stopped_at + 1:])
    assert state.done and state.samples[0].num_tokens == stopped_at + 1


def test_stop_string_in_the_engines_last_output_needs_no_stop(tok):
    ids = encode(tok, "Say it and end")
    state = state_for(tok, SamplingParams(stop=["end"], include_stop_str_in_output=True))
    deltas, to_stop = state.process([out(ids, finish="length")])
    assert to_stop == []
    assert (deltas[0].text, deltas[0].finish_reason, deltas[0].stop_reason) == ("Say it and end", STOP_STRING, "end")


def test_stop_string_of_one_sample_of_n(tok):
    a, b = encode(tok, "alpha beta gamma"), encode(tok, "one two three four")
    state = state_for(tok, SamplingParams(n=2, stop=["two"]))
    deltas, to_stop = state.process([out(a[:1], 0), out(b[:1], 1)])
    assert to_stop == []
    deltas, to_stop = state.process([out(b[1:2], 1), out(a[1:2], 0)])
    assert to_stop == [sample_request_id(RID, 1)] == [f"{RID}/1"]
    by_index = {d.index: d for d in deltas}
    assert by_index[1].finish_reason == STOP_STRING and by_index[0].finish_reason is None
    assert not state.done
    deltas, to_stop = state.process([out(b[2:3], 1), out(a[2:], 0, finish="length")])
    assert [(d.index, d.text, d.finish_reason) for d in deltas] == [(0, " gamma", LENGTH)]
    assert state.done and state.samples[1].num_tokens == 2


@pytest.mark.parametrize("params, stop_token, expected", [
    (SamplingParams(), EOS_ID, EOS),
    (SamplingParams(stop_token_ids=[13]), 13, STOP_TOKEN),
    (SamplingParams(ignore_eos=True, stop_token_ids=[EOS_ID]), EOS_ID, STOP_TOKEN),
], ids=["eos", "stop_token_ids", "ignore_eos"])
def test_stop_tokens(tok, params, stop_token, expected):
    ids = encode(tok, "Done here") + [stop_token]
    state = state_for(tok, params)
    deltas, to_stop = state.process([out(ids, finish="stop", stop_token=stop_token)])
    assert to_stop == []
    assert (deltas[0].finish_reason, deltas[0].stop_reason) == (expected, stop_token)
    assert deltas[0].text == tok.decode(ids, skip_special_tokens=True)
    assert deltas[0].num_tokens == len(ids)


@pytest.mark.parametrize("engine_reason, expected", [("length", LENGTH), ("abort", ABORT)])
def test_length_and_abort(tok, engine_reason, expected):
    state = state_for(tok, SamplingParams(stop=["never"]))
    ids = encode(tok, "cut off at nev")
    first, _ = state.process([out(ids)])
    assert first[0].text == "cut off at "  # "nev" may begin "never"
    last, _ = state.process([out([], finish=engine_reason)])
    assert (last[0].text, last[0].finish_reason, last[0].stop_reason) == ("nev", expected, None)


def test_outputs_after_the_end_are_ignored(tok):
    state = state_for(tok, SamplingParams())
    state.process([out(encode(tok, "end"), finish="length")])
    assert state.process([out(encode(tok, " more"))]) == ([], [])
    assert state.samples[0].num_tokens == 1


def test_interleaved_samples_coalesce_into_one_delta_each(tok):
    a, b = encode(tok, "red green blue"), encode(tok, "cats and dogs")
    state = state_for(tok, SamplingParams(n=2))
    state.process([out(b[:1], 1)])
    deltas, _ = state.process([out(a[:1], 0), out(b[1:2], 1), out(a[1:2], 0), out(b[2:3], 1), out(a[2:3], 0)])
    assert len(deltas) == 2
    d = {x.index: x for x in deltas}
    assert (d[0].text, d[0].token_ids, d[0].num_tokens) == ("red green blue", a, 3)
    assert (d[1].text, d[1].token_ids, d[1].num_tokens) == (" and dogs", b[1:], 3)
    assert state.num_completion_tokens == 6


def test_logprobs_are_decoded(tok):
    t1, t2, x, y = ids = encode(tok, " fox jumps over the")
    assert len(set(ids)) == 4
    state = state_for(tok, SamplingParams(logprobs=2))
    inside = {x: -0.3, t1: -0.5, y: -2.0}  # sampled in the top 2; one more to cut off
    outside = {x: -0.1, y: -0.4, t2: -3.0}  # sampled below the top 2: reported anyway
    deltas, _ = state.process([out([t1, t2], logprobs=[inside, outside])])
    name = tok.convert_ids_to_tokens
    assert deltas[0].logprobs == [
        PositionLogprobs(TokenLogprob(t1, -0.5, name(t1)), [TokenLogprob(x, -0.3, name(x)),
                                                           TokenLogprob(t1, -0.5, name(t1))]),
        PositionLogprobs(TokenLogprob(t2, -3.0, name(t2)), [TokenLogprob(x, -0.1, name(x)),
                                                           TokenLogprob(y, -0.4, name(y))]),
    ]
    assert name(t1).startswith("Ġ")  # vocabulary entries, not decoded text


def test_logprobs_zero_and_none(tok):
    t, x = encode(tok, " fox jumps")[:2]
    zero = state_for(tok, SamplingParams(logprobs=0))
    deltas, _ = zero.process([out([t], logprobs=[{t: -0.7}])])
    assert deltas[0].logprobs == [PositionLogprobs(TokenLogprob(t, -0.7, tok.convert_ids_to_tokens(t)), [])]
    unasked = state_for(tok, SamplingParams())
    deltas, _ = unasked.process([out([t], logprobs=[{t: -0.7, x: -0.1}])])
    assert deltas[0].logprobs == []


def test_prompt_logprobs_decoded_once(tok):
    prompt = encode(tok, "Once upon a")
    _, p1, p2 = prompt
    other = encode(tok, " time")[0]
    state = RequestState(RID, prompt, SamplingParams(prompt_logprobs=1), tok, [EOS_ID])
    scored = [None, {p1: -2.0, other: -0.5}, {p2: -0.25}]
    state.process([out([other], prompt_logprobs=scored, prompt_token_ids=prompt)])
    name = tok.convert_ids_to_tokens
    expected = [None, PositionLogprobs(TokenLogprob(p1, -2.0, name(p1)), [TokenLogprob(other, -0.5, name(other))]),
                PositionLogprobs(TokenLogprob(p2, -0.25, name(p2)), [TokenLogprob(p2, -0.25, name(p2))])]
    assert state.prompt_logprobs == expected
    state.process([out([other], prompt_logprobs=[None, {p1: -9.0}, {p2: -9.0}])])
    assert state.prompt_logprobs == expected


def test_finish_all_releases_held_back_text(tok):
    state = state_for(tok, SamplingParams(n=3, stop=["STOP", "🦊!"]))
    state.process([out(encode(tok, "done"), 0, finish="length")])
    state.process([out(encode(tok, "wait ST"), 1)])
    fox = encode(tok, "run 🦊")
    first = state.process([out(fox[:-1], 2)])[0][0].text
    assert "\ufffd" not in first  # the fox's last byte is yet to come: its first ones wait
    deltas = state.finish_all(TIME_LIMIT)
    assert [d.index for d in deltas] == [1, 2]
    assert deltas[0].text == "ST" and deltas[0].num_tokens == len(encode(tok, "wait ST"))
    assert first + deltas[1].text == tok.decode(fox[:-1]) and "\ufffd" in deltas[1].text
    assert all(d.finish_reason == TIME_LIMIT for d in deltas)
    assert state.done and state.finish_all(TIME_LIMIT) == []


def test_a_run_of_tokens_stops_at_the_token_completing_a_stop_string(tok):
    """Speculative decoding hands over several tokens at once: the sample ends at the token
    that completes the stop string, with the tokens, logprobs and text one-at-a-time gives."""
    tokens = encode(tok, "one two STOP three four")
    cut = next(i for i in range(1, len(tokens) + 1) if "STOP" in tok.decode(tokens[:i]))
    lps = [{t: -0.5} for t in tokens]
    runs = []
    for chunks in ([tokens], [[t] for t in tokens]):
        state = state_for(tok, SamplingParams(stop=["STOP"], logprobs=0))
        text, ids, logprobs, to_stop = "", [], [], []
        for i, chunk in enumerate(chunks):
            start = sum(len(c) for c in chunks[:i])
            deltas, stop = state.process([out(chunk, logprobs=lps[start:start + len(chunk)])])
            for d in deltas:
                text, ids, logprobs = text + d.text, ids + d.token_ids, logprobs + d.logprobs
            to_stop += stop
            if state.done:
                break
        runs.append((text, ids, [lp.sampled.token_id for lp in logprobs], to_stop))
    assert runs[0] == runs[1]
    assert runs[0][0] == "one two " and runs[0][1] == tokens[:cut] and runs[0][3] == [RID]


def test_output_processor_groups_by_request_and_forgets_finished(tok):
    processor = OutputProcessor(tok, [EOS_ID])
    a, b, c = encode(tok, "first one"), encode(tok, "second STOP here"), encode(tok, "third")
    for rid in ("a", "b", "c"):
        processor.add_request(rid, encode(tok, "Go:"), SamplingParams(stop=["STOP"]))
    deltas, to_stop = processor.process_outputs([
        out(a[:1], request_id="a"), out(b[:1], request_id="b"), out(a[1:], request_id="a", finish="length"),
        out(b[1:], request_id="b")])
    assert set(deltas) == {"a", "b"} and to_stop == ["b"]
    assert [(d.text, d.finish_reason) for d in deltas["a"]] == [("first one", LENGTH)]
    assert [(d.text, d.finish_reason) for d in deltas["b"]] == [("second ", STOP_STRING)]
    assert set(processor.requests) == {"c"}
    deltas, to_stop = processor.process_outputs([out(c, request_id="c", finish="stop", stop_token=EOS_ID)])
    assert deltas["c"][0].finish_reason == EOS and to_stop == [] and processor.requests == {}


def test_engine_errors_become_typed_exceptions(tok):
    from common.errors import InvalidRequest, RequestFailed
    state = RequestState(RID, [1, 2], SamplingParams(), tok, [EOS_ID])
    with pytest.raises(InvalidRequest, match="did not compile"):
        state.process([out([], finish="invalid", error="structured_outputs.regex: did not compile")])
    state = RequestState(RID, [1, 2], SamplingParams(), tok, [EOS_ID])
    with pytest.raises(RequestFailed, match="rejected sampled token"):
        state.process([out(encode(tok, "a"), finish="error", error="the grammar rejected sampled token 5")])


def test_a_completed_grammar_ends_a_sample_as_eos_would(tok):
    state = RequestState(RID, [1, 2], SamplingParams(), tok, [EOS_ID])
    [delta], _ = state.process([out(encode(tok, '{"a":1}'), finish="stop", stop_token=None)])
    assert delta.finish_reason == EOS and delta.text == '{"a":1}'


def test_structured_outputs_cross_the_engine_socket():
    from common.ipc import structured_from_proto, structured_to_proto
    from common.structured_output.params import StructuredOutputsParams
    for params in (StructuredOutputsParams(json={"type": "object", "b": 1, "a": [1]}),
                   StructuredOutputsParams(json_object=True), StructuredOutputsParams(regex="[ab]+"),
                   StructuredOutputsParams(choice=("x", "y \"z\"")), StructuredOutputsParams(grammar='start: "a"')):
        msg = type(structured_to_proto(params)).FromString(structured_to_proto(params).SerializeToString())
        assert structured_from_proto(msg) == params
    assert structured_to_proto(None) is None


def test_plain_tokens_cross_the_engine_socket_packed():
    """One token of sample 0 that ends nothing travels in OutputBatch's packed lists; every other
    output as a RequestOutput; a reader of the batch gets them all back."""
    from common.ipc import add_plain_tokens, is_plain_token, outputs_from_batch, plain_tokens_from_batch
    from common.outputs import PlainTokens
    from common.v1 import engine_ipc_pb2 as ipc
    plain = [out([7], request_id="a", num_cached_tokens=16), out([9], request_id="b")]
    others = [out([7, 8]), out([7], index=1), out([7], finish="length"), out([7], logprobs=[{7: -0.5}])]
    assert [is_plain_token(o) for o in plain + others] == [True, True, False, False, False, False]
    batch = ipc.OutputBatch()
    add_plain_tokens(batch, PlainTokens(["a", "b"], [7, 9], [16, 0]))
    batch = ipc.OutputBatch.FromString(batch.SerializeToString())
    assert plain_tokens_from_batch(batch) == plain  # num_prompt_tokens is not sent: the frontend has the prompt
    assert outputs_from_batch(batch) == plain


def test_the_short_way_for_plain_tokens_gives_the_general_ways_deltas(tok):
    ids = encode(tok, STORY)  # an emoji among them: bytes that complete a character later
    fast, general = state_for(tok, SamplingParams()), state_for(tok, SamplingParams())
    general._plain = False
    for i, t in enumerate(ids):
        output = out([t], num_cached_tokens=4, finish="length" if i == len(ids) - 1 else None)
        assert fast.process([output]) == general.process([output])
    assert fast.done and fast.num_cached_tokens == 4


@pytest.mark.parametrize("chunk", [2, 5, 100])
def test_runs_of_tokens_give_the_text_of_one_by_one(tok, chunk):
    """Engine outputs of several tokens (speculative runs), no stop strings: one detokenizer
    step per output, the same text, ids and counts as token by token."""
    ids = encode(tok, STORY)
    state = state_for(tok, SamplingParams())
    runs = [ids[i:i + chunk] for i in range(0, len(ids), chunk)]
    results = [state.process([out(run, finish="length" if run is runs[-1] else None)]) for run in runs]
    assert texts(results) == STORY
    assert [d[0].token_ids for d, _ in results] == runs
    assert results[-1][0][0].num_tokens == len(ids) and results[-1][0][0].finish_reason == LENGTH


def test_vocabulary_entries_are_looked_up_only_for_logprobs(tok, monkeypatch):
    looked_up = []
    monkeypatch.setattr(tok, "convert_ids_to_tokens", lambda i: looked_up.append(i) or str(i))
    ids = encode(tok, " fox jumps")
    one_by_one(state_for(tok, SamplingParams()), ids, finish="length")
    assert looked_up == []
    state = state_for(tok, SamplingParams(logprobs=0))
    state.process([out(ids, logprobs=[{t: -1.0} for t in ids])])
    assert looked_up == ids
