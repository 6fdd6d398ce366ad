"""Tools in the prompt. A chat template that knows tools (it mentions `tools`) gets them, and
the conversation's earlier calls and results, as transformers' convention passes them. A
template that does not (the bundled SmolLM2's) gets them as plain text in Hermes format, so
multi-turn tool use works on any chat model:

    system:    the caller's system text, then the tool definitions inside <tools></tools> and
               how to call them (<tool_call>{"name": ..., "arguments": ...}</tool_call>)
    assistant: its text, then one <tool_call> block per earlier call
    tool:      becomes a user message of <tool_response> blocks (consecutive results together)
"""

from __future__ import annotations

import json

from common.errors import InvalidRequest
from frontend.tool_calls import arguments as call_arguments
from frontend.tool_calls.tools import ToolUse

_HOW_TO_CALL = (
    "For each function call, return a JSON object with the function's name and arguments "
    "inside <tool_call></tool_call> tags, like this:\n"
    '<tool_call>\n{"name": "<function name>", "arguments": {<arguments as a JSON object>}}\n</tool_call>')
_CHOICE_RULES = {
    "auto": "Call a function only when it helps to answer; otherwise answer in plain text.",
    "none": "Do not call any function in this reply: answer in plain text.",
    "required": "Call at least one function now.",
}


def chat_with_tools(template: str | None, messages: list[dict],
                    tool_use: ToolUse | None) -> tuple[list[dict], list[dict] | None]:
    """The messages, and the `tools` argument, for the chat template `template`."""
    if template is None:
        if tool_use is not None:
            raise InvalidRequest("tools: this model has no chat template to show tools in; remove tools, or "
                                 "send a plain prompt to /v1/completions")
        return messages, None
    if template_knows_tools(template):
        tools = None if tool_use is None else [t.template_entry() for t in tool_use.tools]
        return [_arguments_as_objects(m) for m in messages], tools
    if tool_use is None and not any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
        return messages, None
    return messages_as_text(messages, tool_use), None


def template_knows_tools(template: str) -> bool:
    return "tools" in template


def tools_prompt(tool_use: ToolUse) -> str:
    """The system text that shows the tools to a model whose template can't."""
    definitions = "\n".join(json.dumps(t.template_entry(), ensure_ascii=False) for t in tool_use.tools)
    choice = tool_use.choice
    rule = (f"Call the function {choice.name} now." if choice.mode == "named" else _CHOICE_RULES[choice.mode])
    return ("You can call functions. Their signatures are inside <tools></tools>:\n"
            f"<tools>\n{definitions}\n</tools>\n{_HOW_TO_CALL}\n{rule}")


def messages_as_text(messages: list[dict], tool_use: ToolUse | None) -> list[dict]:
    """The conversation with tools, calls and results written out as Hermes text."""
    out: list[dict] = []
    for m in messages:
        if m["role"] == "tool":
            response = f"<tool_response>\n{m['content']}\n</tool_response>"
            if out and out[-1].get("_tool_responses"):
                out[-1]["content"] += "\n" + response
            else:
                out.append({"role": "user", "content": response, "_tool_responses": True})
            continue
        calls = [call_text(c) for c in m.get("tool_calls") or [] if isinstance(c, dict)]
        m = {k: v for k, v in m.items() if k not in ("tool_calls", "tool_call_id")}
        if calls:
            m["content"] = "\n".join(([m["content"]] if m["content"] else []) + calls)
        out.append(m)
    for m in out:
        m.pop("_tool_responses", None)
    if tool_use is not None:
        out = _with_system(out, tools_prompt(tool_use))
    return out


def call_text(call: dict) -> str:
    """One earlier call ({"function": {"name", "arguments"}}, arguments a dict or JSON text)."""
    function = call.get("function")
    function = function if isinstance(function, dict) else {}
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = call_arguments.loads(arguments)
        except ValueError:
            pass  # written as given: it is history, not ours to judge (the routes refuse too deep by name)
    body = json.dumps({"name": function.get("name"), "arguments": arguments}, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"


def _arguments_as_objects(message: dict) -> dict:
    """OpenAI sends an earlier call's arguments as JSON text; templates (Qwen2.5's, ...) write
    them with `tojson`, so they want the object, as vLLM passes it."""
    calls = message.get("tool_calls")
    if not isinstance(calls, list):
        return message
    fixed = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict) and isinstance(function.get("arguments"), str):
            try:
                call = {**call, "function": {**function, "arguments": call_arguments.loads(function["arguments"])}}
            except ValueError:
                pass  # left as given
        fixed.append(call)
    return {**message, "tool_calls": fixed}


def _with_system(messages: list[dict], text: str) -> list[dict]:
    if messages and messages[0]["role"] in ("system", "developer"):
        first = {**messages[0], "content": f"{messages[0]['content']}\n\n{text}" if messages[0]["content"] else text}
        return [first, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]
