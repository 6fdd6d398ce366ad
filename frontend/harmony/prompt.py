"""A chat conversation as a harmony prompt, rendered by openai-harmony (its token ids).

The messages are the APIs' common form (frontend.input_processor): role, content, and an
assistant's `reasoning_content` and `tool_calls`, a tool result's `tool_call_id` or `name`.
As OpenAI's harmony guide (and gpt-oss's own chat template) lays them out:

    system message     model identity, knowledge cutoff, today's date, `Reasoning: EFFORT`
    developer message  the request's system and developer texts as instructions, its tools
                       as the `functions` namespace (shown unless tool_choice is none)
    user               as is
    assistant          reasoning_content -> analysis; content -> final; each tool call ->
                       commentary to=functions.NAME, `<|constrain|>json`, its arguments; the
                       content beside calls is a commentary preamble
    tool               from functions.NAME to the assistant, on commentary

openai-harmony drops an earlier turn's analysis once a final answer follows it, and keeps it
after a call (the model goes on reasoning from there), as the format requires.
"""

from __future__ import annotations

import datetime
import json

from openai_harmony import (Author, Conversation, DeveloperContent, HarmonyEncoding, Message, ReasoningEffort,
                            Role, SystemContent, ToolDescription)

from common.errors import InvalidRequest

EFFORTS = {"low": ReasoningEffort.LOW, "medium": ReasoningEffort.MEDIUM, "high": ReasoningEffort.HIGH}
DEFAULT_EFFORT = "medium"  # the format's, and gpt-oss's chat template's


def render(encoding: HarmonyEncoding, messages: list[dict], tools: list[dict] | None,
           reasoning_effort: str | None = None, add_generation_prompt: bool = True, field: str = "messages") -> list[int]:
    """The prompt's token ids. `tools`: the request's function tools in OpenAI's form
    ({"type": "function", "function": {name, description, parameters}}), None for none."""
    effort = reasoning_effort or DEFAULT_EFFORT
    if effort not in EFFORTS:
        raise InvalidRequest(f"reasoning_effort: {effort!r}: gpt-oss reasons at low, medium or high effort")
    system = (SystemContent.new().with_reasoning_effort(EFFORTS[effort])
              .with_conversation_start_date(datetime.date.today().isoformat()))
    conversation = [Message.from_role_and_content(Role.SYSTEM, system)]
    instructions = "\n\n".join(m["content"] for m in messages if m["role"] in ("system", "developer") and m["content"])
    if instructions or tools:
        developer = DeveloperContent.new()
        if instructions:
            developer = developer.with_instructions(instructions)
        if tools:
            developer = developer.with_function_tools([_tool(t) for t in tools])
        conversation.append(Message.from_role_and_content(Role.DEVELOPER, developer))
    names: dict[str, str] = {}  # tool_call_id -> the function it called
    for i, m in enumerate(messages):
        if m["role"] == "user":
            conversation.append(Message.from_role_and_content(Role.USER, m["content"]))
        elif m["role"] == "assistant":
            conversation += _assistant(m, names)
        elif m["role"] == "tool":
            name = m.get("name") or names.get(m.get("tool_call_id"))
            if not name:
                raise InvalidRequest(f"{field}[{i}]: a tool result needs the tool_call_id of an earlier call, "
                                     "or the function's name in `name`")
            conversation.append(Message.from_author_and_content(Author.new(Role.TOOL, f"functions.{name}"),
                                                                m["content"]).with_recipient("assistant")
                                .with_channel("commentary"))
    conversation_ = Conversation.from_messages(conversation)
    if add_generation_prompt:
        return encoding.render_conversation_for_completion(conversation_, Role.ASSISTANT)
    return encoding.render_conversation(conversation_)


def _assistant(m: dict, names: dict[str, str]) -> list[Message]:
    out = []
    if m.get("reasoning_content"):
        out.append(_said(m["reasoning_content"], "analysis"))
    calls = [c for c in m.get("tool_calls") or [] if isinstance(c, dict) and isinstance(c.get("function"), dict)]
    if m["content"]:
        out.append(_said(m["content"], "commentary" if calls else "final"))
    for call in calls:
        function = call["function"]
        names[call.get("id")] = function.get("name")
        arguments = function.get("arguments")
        text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        out.append(_said(text, "commentary").with_recipient(f"functions.{function.get('name')}")
                   .with_content_type("<|constrain|>json"))
    return out


def _said(text: str, channel: str) -> Message:
    return Message.from_role_and_content(Role.ASSISTANT, text).with_channel(channel)


def _tool(entry: dict) -> ToolDescription:
    function = entry.get("function", entry)
    return ToolDescription.new(function["name"], function.get("description") or "",
                               parameters=function.get("parameters"))
