"""Each HTTP API's fields -> engine `SamplingParams`: one mapping per API, here. Also what
constrains the output (response_format, vLLM's structured_outputs, forced tool calls) and
the tools, mapped onto frontend/tool_calls."""

from __future__ import annotations

import dataclasses

from common.errors import InvalidRequest
from common.sampling_params import SamplingParams
from common.structured_output.params import StructuredOutputsParams, named
from frontend.http.protocol import ChatCompletionRequest, CompletionRequest, MessagesRequest, _Sampling
from frontend.harmony import parser as harmony_parser
from frontend.reasoning import parsers as reasoning_parsers
from frontend.tool_calls.parsers import markers_are_special
from frontend.tool_calls.tools import EMPTY_PARAMETERS, Tool, ToolChoice, ToolUse, tool_use

_OLD_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend")
_PROMPT_TAIL_TOKENS = 16  # of a prompt, enough to hold an end tag and the whitespace after it


def completion_params(req: CompletionRequest, processor) -> SamplingParams:
    _refuse_unsupported(req)
    if req.suffix:
        raise InvalidRequest("suffix: not supported (no fill-in-the-middle); remove it")
    # With echo, the prompt's logprobs come back too (lm-evaluation-harness's loglikelihood).
    prompt_logprobs = req.prompt_logprobs
    if req.echo and req.logprobs is not None and prompt_logprobs is None:
        prompt_logprobs = req.logprobs
    constraint = one_constraint(processor, _output_constraints(req))
    # Unset, OpenAI's 16 is SamplingParams' own default, after the model's (common/sampling_defaults.py).
    max_tokens = {"max_tokens": req.max_tokens} if "max_tokens" in req.model_fields_set else {}
    return _params(req, processor, logprobs=req.logprobs, prompt_logprobs=prompt_logprobs,
                   structured_outputs=constraint, **max_tokens)


def chat_params(req: ChatCompletionRequest, tools: ToolUse | None, processor, reasoning: str | None = None,
                prompt: list[int] = ()) -> SamplingParams:
    """`reasoning`: the request's reasoning parser (None: none); `prompt`: its tokens (see after_reasoning)."""
    _refuse_unsupported(req)
    if req.top_logprobs is not None and not req.logprobs:
        raise InvalidRequest("top_logprobs: needs logprobs set to true")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    constraints = _output_constraints(req) + forced_calls(processor, tools, "tools[{}].function.parameters")
    constraint = one_constraint(processor, constraints)
    if req.structured_outputs is None:  # vLLM's structured_outputs constrains the whole output, thinking too
        constraint = after_reasoning(constraint, processor, reasoning, prompt)
    return _params(req, processor, max_tokens=max_tokens, logprobs=logprobs, prompt_logprobs=req.prompt_logprobs,
                   structured_outputs=constraint,
                   skip_special_tokens=req.skip_special_tokens and not keeps_markers(processor, tools))


def messages_params(req: MessagesRequest, tools: ToolUse | None, processor, reasoning: str | None = None,
                    prompt: list[int] = ()) -> SamplingParams:
    """As chat_params. vLLM's `structured_outputs` extra is taken here too (the SDKs send it in
    extra_body): it constrains the whole output, as on chat."""
    constraints = structured_outputs_extra(req) + forced_calls(processor, tools, "tools[{}].input_schema")
    constraint = one_constraint(processor, constraints)
    if req.structured_outputs is None:
        constraint = after_reasoning(constraint, processor, reasoning, prompt)
    return processor.sampling_params(
        max_tokens=req.max_tokens, stop=req.stop_sequences or [], temperature=req.temperature, top_p=req.top_p,
        top_k=req.top_k, structured_outputs=constraint,
        disable_speculation=req.disable_speculation,
        skip_special_tokens=not keeps_markers(processor, tools))


def chat_template_kwargs(req: ChatCompletionRequest) -> dict | None:
    """The request's chat_template_kwargs, with its reasoning_effort where it sets one (gpt-oss's
    template and harmony read it; others ignore it); a kwarg given by name wins."""
    if req.reasoning_effort is None:
        return req.chat_template_kwargs
    return {"reasoning_effort": req.reasoning_effort, **(req.chat_template_kwargs or {})}


def anthropic_template_kwargs(req: MessagesRequest) -> dict | None:
    """Anthropic's `thinking` as the chat template's enable_thinking (Qwen3's switch; templates
    without one ignore it); None: the template's default."""
    thinking = req.thinking
    if thinking is None:
        return None
    if thinking.type == "enabled":
        budget = thinking.budget_tokens
        if budget is None:
            raise InvalidRequest('thinking.budget_tokens: {"type": "enabled"} needs a thinking budget')
        if not 1024 <= budget < req.max_tokens:
            raise InvalidRequest(f"thinking.budget_tokens: must be at least 1024 and less than max_tokens "
                                 f"({req.max_tokens}), got {budget}")
    return {"enable_thinking": thinking.type != "disabled"}


def keeps_markers(processor, tools: ToolUse | None) -> bool:
    """Must the output keep special tokens, so the tool-call parser sees its markers?"""
    return tools is not None and tools.parses and markers_are_special(processor.tokenizer)


def openai_tool_use(req: ChatCompletionRequest) -> ToolUse | None:
    tools = [Tool(t.function.name, t.function.description,
                  EMPTY_PARAMETERS if t.function.parameters is None else t.function.parameters)
             for t in req.tools or []]
    choice = req.tool_choice
    if choice is None:
        mode, name = "auto", None
    elif choice in ("none", "auto", "required"):
        mode, name = choice, None
    elif isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict) \
            and isinstance(choice["function"].get("name"), str):
        mode, name = "named", choice["function"]["name"]
    else:
        raise InvalidRequest('tool_choice: must be "none", "auto", "required" or '
                             '{"type": "function", "function": {"name": NAME}}')
    return tool_use(tools, ToolChoice(mode, name, req.parallel_tool_calls), field="tools")


def anthropic_tool_use(req: MessagesRequest) -> ToolUse | None:
    tools = [Tool(t.name, t.description, t.input_schema) for t in req.tools or []]
    choice = req.tool_choice
    if choice is None:
        return tool_use(tools, ToolChoice("auto"))
    if choice.type == "tool" and choice.name is None:
        raise InvalidRequest('tool_choice.name: {"type": "tool"} needs the name of the tool to call')
    mode = {"any": "required", "tool": "named"}.get(choice.type, choice.type)
    return tool_use(tools, ToolChoice(mode, choice.name if mode == "named" else None,
                                      not choice.disable_parallel_tool_use))


def _refuse_unsupported(req: _Sampling) -> None:
    """Fields we can't honour get a 400 that says so, never a silent ignore."""
    if req.best_of not in (None, 1):
        raise InvalidRequest(f"best_of: only 1 is supported, got {req.best_of}")
    old = [name for name in _OLD_GUIDED if name in (req.model_extra or {})]
    if old:
        raise InvalidRequest(f"{old[0]}: vLLM's guided_* fields are replaced by structured_outputs "
                             '(e.g. {"structured_outputs": {"json": SCHEMA}}); use that')


def _output_constraints(req: _Sampling) -> list[tuple[str, StructuredOutputsParams]]:
    """(the field it came from, the constraint) for response_format and structured_outputs."""
    fmt = _response_format(req.response_format)
    return ([] if fmt is None else [fmt]) + structured_outputs_extra(req)


def structured_outputs_extra(req) -> list[tuple[str, StructuredOutputsParams]]:
    """vLLM's `structured_outputs` extra of a request of any route: it holds the whole output."""
    so = req.structured_outputs
    if so is None:
        return []
    fields = {"json": so.json_, "json_object": so.json_object or False, "regex": so.regex,
              "choice": None if so.choice is None else tuple(so.choice), "grammar": so.grammar}
    constraint = StructuredOutputsParams(**fields)  # its messages name structured_outputs.KIND
    return [(f"structured_outputs.{constraint.kind}", constraint)]


def after_reasoning(constraint: StructuredOutputsParams | None, processor, reasoning: str | None,
                    prompt: list[int]) -> StructuredOutputsParams | None:
    """The constraint, applied after the model's reasoning as vLLM applies response_format and
    forced tool calls (and Responses' text.format): with a reasoning parser (`reasoning`, its
    name) and a prompt that has not ended the reasoning itself, the grammar starts after the
    parser's end tag, as the tokenizer encodes it (the engine leaves the output free until
    then: engine/structured_output/manager.py). A prompt whose text ends with the tag (Qwen3's
    template with enable_thinking false writes `<think>\\n\\n</think>\\n\\n`) has no reasoning
    to wait for: the grammar starts at the first token. Give vLLM's structured_outputs extra
    as it is: it constrains the whole output, thinking included."""
    if constraint is None or reasoning is None:
        return constraint
    if processor.harmony is not None:  # harmony: a format holds the final channel's text; a
        if constraint.param == "tool_choice":  # forced call is a whole message (tool_calls/grammar.py)
            return constraint
        return dataclasses.replace(constraint, starts_after=harmony_parser.final_header(processor.harmony))
    tag = reasoning_parsers.end_tag(reasoning)
    tail = processor.tokenizer.decode(list(prompt[-_PROMPT_TAIL_TOKENS:]), skip_special_tokens=False)
    if tail.rstrip().endswith(tag):
        return constraint
    end = processor.tokenizer.encode(tag, add_special_tokens=False)
    return dataclasses.replace(constraint, starts_after=tuple(end))


def _response_format(fmt: dict | None) -> tuple[str, StructuredOutputsParams] | None:
    if fmt is None:
        return None
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return "response_format", StructuredOutputsParams(json_object=True)
    if kind != "json_schema":
        raise InvalidRequest(f"response_format.type: must be text, json_object or json_schema, got {kind!r}")
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise InvalidRequest('response_format.json_schema: must be an object {"name", "schema", ...}')
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise InvalidRequest("response_format.json_schema.schema: must be a JSON schema object, got "
                             f"{'nothing' if schema is None else type(schema).__name__}")
    field = "response_format.json_schema.schema"
    return field, renamed(field, lambda: StructuredOutputsParams(json=schema))


def forced_calls(processor, tools: ToolUse | None, field: str) -> list[tuple[str, StructuredOutputsParams]]:
    """The grammar of required or named calls, after each tool's schema alone is checked (so a
    bad one is named by its place, not as a line of a generated grammar)."""
    constraint = None if tools is None else tools.constraint(harmony=processor.harmony is not None)
    if constraint is None:
        return []
    for i, tool in enumerate(tools.tools):
        if tools.choice.mode == "required" or tool.name == tools.choice.name:
            _check(processor, StructuredOutputsParams(json=tool.parameters), field.format(i))
    return [("tool_choice", constraint)]


def one_constraint(processor, found: list[tuple[str, StructuredOutputsParams]]) -> StructuredOutputsParams | None:
    if len(found) > 1:
        where = [w.split(".")[0] for w, _ in found]
        raise InvalidRequest(f"{where[0]}: only one of a format (response_format, text.format), structured_outputs "
                             f"and a forced tool call (tool_choice required or named) may constrain the output, but "
                             f"{' and '.join(where)} both do; remove one")
    if not found:
        return None
    where, constraint = found[0]
    _check(processor, constraint, where)
    return dataclasses.replace(constraint, param=where)  # what the engine finds later names it too


def _check(processor, constraint: StructuredOutputsParams, field: str) -> None:
    """The grammar library's check, its message under the request's own field name."""
    renamed(field, lambda: processor.check_constraint(constraint))


def renamed(field: str, check):
    """`check()`, with an InvalidRequest's `structured_outputs.KIND:` replaced by `field:`."""
    try:
        return check()
    except InvalidRequest as e:
        raise InvalidRequest(named(str(e), field)) from None


def _params(req: _Sampling, processor, **kwargs) -> SamplingParams:
    """None is a field the request left unset: it takes the model's default (InputProcessor.sampling_params)."""
    return processor.sampling_params(
        n=req.n, temperature=req.temperature, top_p=req.top_p, seed=req.seed, stop=req.stop or [],
        presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
        top_k=req.top_k, min_p=req.min_p, repetition_penalty=req.repetition_penalty,
        logit_bias=req.logit_bias, bad_words=req.bad_words, allowed_token_ids=req.allowed_token_ids,
        ignore_eos=req.ignore_eos, min_tokens=req.min_tokens, stop_token_ids=req.stop_token_ids or [],
        include_stop_str_in_output=req.include_stop_str_in_output,
        disable_speculation=req.disable_speculation,
        **{"skip_special_tokens": req.skip_special_tokens, **kwargs})
