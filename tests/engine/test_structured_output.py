"""Structured output in the engine: every output fits its constraint, on the bundled SmolLM2
and on a tiny random-weight model (where only the constraint can produce valid output), and
constraints change nothing else: preemption, batching, n>1, seeds, logprobs, padding rows."""

from __future__ import annotations

import json
import re
import threading

import jsonschema
import pytest

from common.sampling_params import SamplingParams
from common.structured_output.params import StructuredOutputsParams
from engine.outputs import ModelRunnerOutput
from engine.request import RequestStatus
from pagedserve.llm import LLM
from helpers import assert_no_leak, build_tiny_model

pytestmark = pytest.mark.heavy(53)  # seconds on the 2-core CI machine: scheduled first

# Nesting, arrays, enums, required fields and string patterns. Every string, array and number
# is bounded and no object takes extra keys, so even a random model must finish the document.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,11}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 16},
                           "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"], "additionalProperties": False,
        },
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": False,
}
CHOICES = ["positive", "negative", "neutral"]
PHONE = r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}"  # Rust regex \\d is any Unicode digit, as Python's is
ARITHMETIC = 'start: expr\nexpr: term (("+" | "-") term)*\nterm: /[0-9]{1,3}/ | "(" expr ")"'
TEMPERATURES = (0.0, 0.7, 1.0, 1.5)
SEEDS = range(6)
PADDED_VOCAB = 49152 + 64  # the bundled tokenizer's 49,152 tokens plus 64 padding rows


@pytest.fixture(scope="module")
def llm(bundled_path):
    return LLM(str(bundled_path), num_kv_blocks=512)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory, bundled_tokenizer):
    # The bundled tokenizer on a random model whose LM head has padding rows past it.
    return build_tiny_model("llama", tmp_path_factory.mktemp("tiny-structured"), bundled_tokenizer,
                            vocab_size=PADDED_VOCAB, bos_token_id=1, eos_token_id=2)


@pytest.fixture(scope="module")
def tiny(tiny_path):
    return LLM(str(tiny_path), dtype="float32", num_kv_blocks=512)


def _sweep(constraint: dict, max_tokens: int, n: int = 1) -> list[SamplingParams]:
    """Every temperature with several seeds (greedy once)."""
    return [SamplingParams(temperature=t, seed=s, max_tokens=max_tokens, n=n, structured_outputs=constraint)
            for t in TEMPERATURES for s in (SEEDS if t > 0 else [0])]


def _texts(llm: LLM, prompts, params: list[SamplingParams]) -> list[tuple[str, str]]:
    prompts = prompts if isinstance(prompts, list) else [prompts] * len(params)
    outs = llm.generate(prompts, params)
    assert_no_leak(llm)
    return [(c.text, c.finish_reason) for o in outs for c in o.outputs]


@pytest.mark.parametrize("which", ["bundled", "tiny"])
def test_json_schema_outputs_validate(which, request):
    llm = request.getfixturevalue("llm" if which == "bundled" else "tiny")
    prompt = "Reply with a JSON record of a person: name, age, role, tags and address."
    for text, reason in _texts(llm, prompt, _sweep({"json": PERSON}, max_tokens=160)):
        assert reason == "stop", f"unfinished: {text!r}"
        jsonschema.validate(json.loads(text), PERSON)


@pytest.mark.parametrize("which", ["bundled", "tiny"])
def test_choice_regex_grammar_and_json_object(which, request):
    llm = request.getfixturevalue("llm" if which == "bundled" else "tiny")
    for text, reason in _texts(llm, "Is this review good? 'Great phone.' Answer:", _sweep({"choice": CHOICES}, 8)):
        assert text in CHOICES and reason == "stop"
    for text, reason in _texts(llm, "Call me at", _sweep({"regex": PHONE}, 20)):
        assert re.fullmatch(PHONE, text) and reason == "stop", text
    for text, _ in _texts(llm, "An arithmetic expression:", _sweep({"grammar": ARITHMETIC}, 24)):
        # A random model may run out of tokens mid-expression; what it wrote is still a prefix
        # the grammar allows.
        assert re.fullmatch(r"[0-9()+-]+", text), text
    # Any object: unbounded, so a sample may run out of tokens; those that end are objects,
    # and the real model's greedy one ends.
    texts = _texts(llm, "Reply with a small JSON object:", _sweep({"json_object": True}, 64))
    assert texts[0][1] == "stop" or which == "tiny", texts[0]
    for text, reason in texts:
        if reason == "stop":
            assert isinstance(json.loads(text), dict)


def test_n_samples_each_get_their_own_matcher_and_seeds_reproduce(tiny):
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=160, structured_outputs={"json": PERSON})
    first = tiny.generate(["A person:"], params)[0].outputs
    again = tiny.generate(["A person:"], params)[0].outputs
    assert [c.text for c in first] == [c.text for c in again]
    assert len({c.text for c in first}) > 1  # independent samples, not one matcher shared
    for c in first:
        jsonschema.validate(json.loads(c.text), PERSON)
    assert_no_leak(tiny)


def test_greedy_with_a_constraint_survives_preemption(tiny_path, tiny):
    """A pool too small for the batch preempts requests mid-generation (chunked, prefix-cached):
    their matchers keep their state, so the output equals the unpressured run's."""
    prompts = [f"Person {i}, described as JSON:" + " filler" * (i * 7) for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=160, structured_outputs={"json": PERSON})
    expected = [o.outputs[0].token_ids for o in tiny.generate(prompts, params)]
    small = LLM(str(tiny_path), dtype="float32", num_kv_blocks=24, max_num_batched_tokens=48,
                enable_prefix_caching=True)
    got = [o.outputs[0].token_ids for o in small.generate(prompts, params)]
    assert small.engine.scheduler.num_preemptions > 0
    assert got == expected
    assert_no_leak(small)


def test_unconstrained_rows_are_unaffected_by_constrained_neighbours(llm):
    plain = [SamplingParams(temperature=0, max_tokens=24),
             SamplingParams(temperature=0.9, seed=3, max_tokens=24)]
    prompts = ["The capital of France is", "Once upon a time"]
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, plain)]
    constrained = [SamplingParams(temperature=t, seed=1, max_tokens=24, structured_outputs=c)
                   for t, c in ((0, {"json": PERSON}), (1.0, {"regex": PHONE}), (0.5, {"choice": CHOICES}))]
    mixed = llm.generate(prompts + ["JSON:", "Phone:", "Label:"], plain + constrained)
    assert [o.outputs[0].token_ids for o in mixed[:2]] == alone
    assert_no_leak(llm)


def test_logprobs_reflect_the_constraint(llm, bundled_tokenizer):
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=5, structured_outputs={"choice": ["yes", "no"]})
    out = llm.generate(["Is water wet? Answer:"], params)[0].outputs[0]
    first = out.logprobs[0]
    allowed_starts = {t for t in first if bundled_tokenizer.decode([t]) in ("y", "ye", "yes", "n", "no")}
    assert set(first) == allowed_starts, {bundled_tokenizer.decode([t]): lp for t, lp in first.items()}
    assert abs(sum(2.718281828 ** lp for lp in first.values()) - 1.0) < 1e-3  # all the mass is allowed
    assert out.text in ("yes", "no")


def test_padding_rows_of_the_lm_head_are_never_sampled(tiny):
    assert tiny.engine.model_runner.sampler.num_tokens == 49152 < tiny.engine.vocab_size
    outs = tiny.generate(["Hello"], SamplingParams(n=8, temperature=5.0, seed=0, max_tokens=64, ignore_eos=True))
    assert max(t for c in outs[0].outputs for t in c.token_ids) < 49152
    assert_no_leak(tiny)


def test_compiles_never_block_the_step_loop(tiny):
    """While a grammar compiles, the request waits in WAITING_FOR_GRAMMAR and others run."""
    core = tiny.engine
    gate = threading.Event()
    core.structured_output._executor.submit(gate.wait)  # hold the compile worker
    schema = {**PERSON, "title": "a schema this engine has not compiled yet"}
    core.add_request("constrained", [1, 2, 3], SamplingParams(temperature=0, max_tokens=160,
                                                              structured_outputs={"json": schema}))
    core.add_request("plain", [1, 2, 3], SamplingParams(temperature=0, max_tokens=3))
    try:
        produced = [o for _ in range(4) for o in core.step()]
        assert {o.request_id for o in produced} == {"plain"} and produced[-1].finished
        assert core.scheduler.requests["constrained"].status == RequestStatus.WAITING_FOR_GRAMMAR
        assert core.stats().num_waiting == 1  # it counts as waiting (metrics, leak checks)
    finally:
        gate.set()
    text = []
    while core.has_unfinished_requests():
        text += [t for o in core.step() for t in o.new_token_ids]
    jsonschema.validate(json.loads(tiny.tokenizer.decode(text, skip_special_tokens=True)), schema)


def test_compiled_grammars_are_cached_by_canonical_spec(tiny):
    manager = tiny.engine.structured_output

    def grammar(schema):
        return manager.request(SamplingParams(structured_outputs={"json": schema}).structured_outputs).grammar
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "integer"}}}
    assert grammar(schema) is grammar(json.dumps(schema, indent=2))  # spacing is not the spec
    # Property order is: the output follows it.
    reordered = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}
    assert grammar(reordered) is not grammar(schema)


def test_properties_come_out_in_the_schema_order(tiny):
    schema = {"type": "object", "additionalProperties": False, "required": ["zeta", "alpha"],
              "properties": {"zeta": {"type": "integer", "minimum": 0, "maximum": 9},
                             "alpha": {"type": "boolean"}}}
    for text, reason in _texts(tiny, "x", _sweep({"json": schema}, 40)):
        assert reason == "stop" and list(json.loads(text)) == ["zeta", "alpha"], text


def test_aborting_a_request_waiting_for_its_grammar(tiny):
    core = tiny.engine
    gate = threading.Event()
    core.structured_output._executor.submit(gate.wait)
    core.add_request("gone", [1, 2], SamplingParams(max_tokens=4, structured_outputs={"regex": "[ab]{1,9}"}))
    core.abort_requests(["gone"])
    gate.set()
    assert core.step() == [] and not core.has_unfinished_requests()


def test_a_grammar_that_fails_in_the_engine_ends_its_request_invalid(tiny):
    """The frontend's check normally stops it first; the engine trusts no socket."""
    core = tiny.engine
    core.add_request("bad", [1, 2], SamplingParams(max_tokens=4, structured_outputs={"regex": "a(b"}))
    outputs = []
    while core.has_unfinished_requests():
        outputs += core.step()
    [out] = outputs
    assert out.finish_reason == "invalid" and "unclosed group" in out.error and out.new_token_ids == []


def test_a_token_its_mask_forbade_is_the_engines_fault_not_the_callers(tiny):
    """A token outside the grammar's mask can only come from an engine fault: "error" (500),
    never "invalid" (400), whatever the grammar."""
    core = tiny.engine
    core.add_request("r", [1, 2, 3], SamplingParams(max_tokens=8, structured_outputs={"choice": ["yes"]}))
    while core.scheduler.requests["r"].status != RequestStatus.RUNNING:
        sched = core.scheduler.schedule()
    bad = tiny.tokenizer.encode("no", add_special_tokens=False)[0]
    [out] = core.scheduler.update_from_output(sched, ModelRunnerOutput(["r"], [[bad]], [[None]]))
    assert out.finish_reason == "error" and "rejected sampled token" in out.error
    assert_no_leak(tiny)


# The bundled tokenizer has no token holding the byte 0xF1, which starts U+40000's UTF-8.
UNWRITABLE = "\U00040000"


def _run_alone(core, request_id: str, params: SamplingParams) -> list:
    core.add_request(request_id, [1, 2, 3], params)
    outputs = []
    while core.has_unfinished_requests():
        outputs += core.step()
    return outputs


def test_a_grammar_the_vocabulary_cannot_begin_is_refused_when_it_compiles(llm):
    """Also the second time, when its compile is cached and the request ends as it is added:
    its output must still go out (it once waited forever for a step that never came)."""
    for request_id in ("first", "cached"):
        params = SamplingParams(max_tokens=8, structured_outputs={"regex": UNWRITABLE})
        [out] = _run_alone(llm.engine, request_id, params)
        assert out.finish_reason == "invalid" and out.new_token_ids == [], out
        assert out.error.startswith("structured_outputs.regex: ") and "vocabulary" in out.error, out.error
    assert_no_leak(llm)


@pytest.mark.parametrize("constraint", [
    {"regex": "a" + UNWRITABLE},  # llguidance's mask allows 0x80's token, which its parser refuses
    {"regex": f"a[{UNWRITABLE}\U00080000]"},  # its mask allows nothing but eos (before: "stop", text "a")
    {"json": {"type": "object", "properties": {"k": {"const": UNWRITABLE}}, "required": ["k"]}},
], ids=["forced-bytes", "empty-mask", "json-const"])
def test_a_grammar_the_vocabulary_cannot_finish_ends_its_request_invalid(tiny, constraint):
    """Caught on the way: the request ends "invalid" (the caller's 400) naming its field, frees
    its blocks, and the engine serves the next one."""
    for temperature in (0.0, 1.0):
        params = SamplingParams(max_tokens=16, temperature=temperature, seed=1, structured_outputs=constraint)
        outputs = _run_alone(tiny.engine, "r", params)
        assert outputs[-1].finish_reason == "invalid", outputs
        assert sum(len(o.new_token_ids) for o in outputs) >= 1  # it failed after a token, not at compile
        kind = next(iter(constraint))
        assert outputs[-1].error.startswith(f"structured_outputs.{kind}: "), outputs[-1].error
        assert "vocabulary" in outputs[-1].error, outputs[-1].error
        assert_no_leak(tiny)
    [out] = tiny.generate(["x"], SamplingParams(max_tokens=4, structured_outputs={"regex": "ab"}))
    assert out.outputs[0].text == "ab"


def test_a_grammar_after_the_reasoning_is_checked_from_its_own_first_token(tiny):
    """The check replays the grammar from where it began (after starts_after): a token its
    mask allowed and it then refused is the grammar's fault, named with the tokens it took."""
    core, encode = tiny.engine, lambda text: tiny.tokenizer.encode(text, add_special_tokens=False)
    end = encode("</answer>")
    constraint = StructuredOutputsParams(regex="a" + UNWRITABLE, starts_after=tuple(end))
    core.add_request("r", [1, 2, 3], SamplingParams(max_tokens=8, structured_outputs=constraint))
    while core.scheduler.requests["r"].status != RequestStatus.RUNNING:
        sched = core.scheduler.schedule()
    for token in [*encode("x"), *end, *encode("a")]:  # free, the end of the reasoning, the grammar's first
        [out] = core.scheduler.update_from_output(sched, ModelRunnerOutput(["r"], [[token]], [[None]]))
        assert out.finish_reason is None
        sched = core.scheduler.schedule()
    [allowed] = core.scheduler.requests["r"].structured.matcher.allowed_tokens()  # one, which it refuses
    [out] = core.scheduler.update_from_output(sched, ModelRunnerOutput(["r"], [[allowed]], [[None]]))
    assert out.finish_reason == "invalid" and "1 token into it" in out.error, out.error
    assert_no_leak(tiny)


def test_offline_api_reports_a_failed_request(tiny):
    with pytest.raises(ValueError, match="structured_outputs.regex"):
        tiny.generate(["x"], SamplingParams(structured_outputs={"regex": "a(b"}))
    with pytest.raises(ValueError, match="structured_outputs.regex: .*vocabulary"):
        tiny.generate(["x"], SamplingParams(structured_outputs={"regex": "a" + UNWRITABLE}))
    with pytest.raises(ValueError, match="exactly one"):
        SamplingParams(structured_outputs={"regex": "a", "choice": ["b"]})
    with pytest.raises(ValueError, match="Unimplemented keys"):
        tiny.generate(["x"], SamplingParams(structured_outputs={"json": {"dependentSchemas": {"a": {}}}}))


ORDER_TOOL_PARAMS = {
    "type": "object", "additionalProperties": False, "required": ["items", "shipping"],
    "properties": {
        "items": {"type": "array", "minItems": 1, "maxItems": 2, "items": {
            "type": "object", "additionalProperties": False, "required": ["sku", "qty"],
            "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"},
                           "qty": {"type": "integer", "minimum": 1, "maximum": 9}}}},
        "shipping": {"enum": ["standard", "express"]},
        "note": {"type": "string", "maxLength": 10},
    },
}
CITY_TOOL_PARAMS = {"type": "object", "additionalProperties": False, "required": ["city"],
                    "properties": {"city": {"type": "string", "maxLength": 12}}}


@pytest.mark.parametrize("which", ["bundled", "tiny"])
@pytest.mark.parametrize("mode", ["required", "named"])
def test_forced_tool_calls_have_arguments_that_validate(which, mode, request):
    """tool_choice required / named, as the HTTP APIs build them: the grammar forces Hermes
    blocks whose arguments fit each tool's schema, and the parser reads them back."""
    from frontend.tool_calls.hermes import CallArguments, CallStart, parse
    from frontend.tool_calls.tools import Tool, ToolChoice, ToolUse
    llm = request.getfixturevalue("llm" if which == "bundled" else "tiny")
    tools = (Tool("place_order", "Order items", ORDER_TOOL_PARAMS), Tool("weather", None, CITY_TOOL_PARAMS))
    use = ToolUse(tools, ToolChoice("named", "place_order") if mode == "named" else ToolChoice("required"))
    schemas = {t.name: t.parameters for t in tools}
    for text, reason in _texts(llm, "Order two AB12 mugs, express.", _sweep(use.constraint(), 200)):
        # "required" allows parallel calls, and a small model may repeat one until max_tokens:
        # then every call it completed still counts (a cut-off block is text, not a call).
        assert reason == "stop" or mode == "required", text
        events = parse(text)
        names = [e.name for e in events if isinstance(e, CallStart)]
        assert names and (mode == "required" or names == ["place_order"]), text
        arguments = ["".join(e.text for e in events if isinstance(e, CallArguments) and e.index == i)
                     for i in range(len(names))]
        for name, args in zip(names, arguments):
            jsonschema.validate(json.loads(args), schemas[name])


def test_prepare_builds_the_grammar_tokenizer_before_any_request(bundled_tokenizer):
    """A served engine calls prepare() before its sockets (engine/main.py): the library's
    tokenizer, a GIL-holding stretch, is built then, not on the first constrained request."""
    from engine.structured_output.manager import StructuredOutputManager
    manager = StructuredOutputManager(bundled_tokenizer, 49152, (2,))
    calls = []
    make = manager._make_backend
    manager._make_backend = lambda: calls.append(threading.current_thread()) or make()
    manager.prepare()
    assert calls == [threading.current_thread()] and manager._backend.done()
    grammar = manager.request(StructuredOutputsParams(regex="[ab]+")).grammar
    assert grammar.result(timeout=30).matcher().accepts(bundled_tokenizer.encode("a", add_special_tokens=False)[0])
    assert len(calls) == 1  # the request found it built
    manager.shutdown()
