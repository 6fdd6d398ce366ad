"""The Responses API's `tools`, `tool_choice`, `text.format` and sampling fields, mapped onto
the machinery chat completions use (frontend/tool_calls, params.py's constraint helpers)."""

from __future__ import annotations

from common.errors import InvalidRequest
from common.sampling_params import SamplingParams
from common.structured_output.params import StructuredOutputsParams
from frontend.http.params import (after_reasoning, forced_calls, keeps_markers, one_constraint, renamed,
                                  structured_outputs_extra)
from frontend.http.responses.request import ResponsesRequest
from frontend.tool_calls.tools import EMPTY_PARAMETERS, Tool, ToolChoice, ToolUse, tool_use

_CHOICE = 'tool_choice: must be "none", "auto", "required" or {"type": "function", "name": NAME}'


def responses_params(req: ResponsesRequest, tools: ToolUse | None, processor, reasoning: str | None = None,
                     prompt: list[int] = ()) -> SamplingParams:
    """A field the request leaves unset (None) takes the model's generation-config default, then
    SamplingParams' own (processor.sampling_params); max_output_tokens unset: up to the context.
    text.format and forced calls hold the answer after the reasoning, as on chat (`reasoning`:
    the request's reasoning parser, `prompt` its tokens: params.after_reasoning)."""
    constraints = (text_format(req.text) + structured_outputs_extra(req)
                   + forced_calls(processor, tools, "tools[{}].parameters"))
    constraint = one_constraint(processor, constraints)
    if req.structured_outputs is None:  # vLLM's structured_outputs holds the whole output, thinking too
        constraint = after_reasoning(constraint, processor, reasoning, prompt)
    try:
        return processor.sampling_params(max_tokens=req.max_output_tokens, temperature=req.temperature,
                                         top_p=req.top_p, structured_outputs=constraint,
                                         skip_special_tokens=not keeps_markers(processor, tools))
    except InvalidRequest as e:  # SamplingParams names its own field
        if str(e).startswith("max_tokens:"):
            raise InvalidRequest("max_output_tokens:" + str(e).removeprefix("max_tokens:")) from None
        raise


def responses_template_kwargs(req: ResponsesRequest) -> dict | None:
    """reasoning.effort for the chat template: "none" switches thinking off (Qwen3's
    enable_thinking), any other effort on, and templates that grade it read reasoning_effort
    (gpt-oss's); templates with neither ignore both. No effort: the template's default."""
    effort = (req.reasoning or {}).get("effort")  # one of the API's (request.py)
    if effort is None:
        return None
    return {"enable_thinking": effort != "none", "reasoning_effort": effort}


def responses_tool_use(req: ResponsesRequest) -> ToolUse | None:
    if req.tools is not None and not isinstance(req.tools, list):
        raise InvalidRequest("tools: must be a list of tools")
    tools = [_tool(t, f"tools[{i}]") for i, t in enumerate(req.tools or [])]
    mode, name = _tool_choice(req.tool_choice)
    return tool_use(tools, ToolChoice(mode, name, req.parallel_tool_calls is not False), field="tools")


def _tool(tool, where: str) -> Tool:
    """A function tool, {type: function, name, description, parameters, strict}: flat, unlike
    chat's. strict is accepted: a forced call always follows its schema, an auto one never."""
    kind = tool.get("type") if isinstance(tool, dict) else None
    if kind != "function":
        raise InvalidRequest(f"{where}.type: {kind!r} tools are not supported; only function tools run here "
                             "(built-in tools such as web_search, file_search, code_interpreter and mcp do not)")
    if "function" in tool and "name" not in tool:
        raise InvalidRequest(f"{where}: a Responses function tool is flat, {{type, name, description, parameters}}, "
                             "not chat's {type, function: {...}}")
    description, parameters = tool.get("description"), tool.get("parameters")
    if description is not None and not isinstance(description, str):
        raise InvalidRequest(f"{where}.description: must be a string")
    if parameters is not None and not isinstance(parameters, dict):
        raise InvalidRequest(f"{where}.parameters: must be a JSON schema object")
    return Tool(tool.get("name"), description, EMPTY_PARAMETERS if parameters is None else parameters)


def _tool_choice(choice) -> tuple[str, str | None]:
    if choice is None:
        return "auto", None
    if choice in ("none", "auto", "required"):
        return choice, None
    if not isinstance(choice, dict):
        raise InvalidRequest(_CHOICE)
    if choice.get("type") != "function":
        raise InvalidRequest(f"{_CHOICE}; {choice.get('type')!r} choices (built-in tools, allowed_tools) are not "
                             "supported")
    if not isinstance(choice.get("name"), str):
        raise InvalidRequest('tool_choice.name: {"type": "function"} needs the name of the function to call')
    return "named", choice["name"]


def text_format(text: dict | None) -> list[tuple[str, StructuredOutputsParams]]:
    """text.format as (field, constraint), as params.py's `_response_format` maps chat's
    response_format (whose schema sits one level deeper, in json_schema)."""
    fmt = (text or {}).get("format")
    if fmt is None:
        return []
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return []
    if kind == "json_object":
        return [("text.format", StructuredOutputsParams(json_object=True))]
    if kind != "json_schema":
        raise InvalidRequest(f"text.format.type: must be text, json_object or json_schema, got {kind!r}")
    schema = fmt.get("schema")
    if not isinstance(schema, dict):
        raise InvalidRequest("text.format.schema: must be a JSON schema object, got "
                             f"{'nothing' if schema is None else type(schema).__name__}")
    field = "text.format.schema"
    return [(field, renamed(field, lambda: StructuredOutputsParams(json=schema)))]
