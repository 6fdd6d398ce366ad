"""A conversation's items: what a request's `input` holds, what a response's `output` holds
(the SDKs send earlier output items back as input), and how they become chat messages.

    message               {role user|system|developer|assistant, content: text or parts}
    function_call         an assistant's call {call_id, name, arguments}
    function_call_output  the caller's answer {call_id, output}
    reasoning             an assistant's thinking {content: [{type: reasoning_text, text}]}

An assistant's reasoning, text and calls in a row are one assistant turn (one chat message
with tool_calls); each function_call_output is a tool message, as anthropic_api.py maps its
blocks. Anything malformed is a 400 naming its place, e.g. `input[2].call_id`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from common.errors import InvalidRequest
from frontend.multimodal import parts as mm
from frontend.tool_calls import arguments as call_arguments

_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = {"input_text": "text", "output_text": "text", "refusal": "refusal", "reasoning_text": "text"}
_DETAILS = ("auto", "low", "high", "original")
_WITH_IMAGES = f"{', '.join(_TEXT_PARTS)} or input_image"


@dataclass(frozen=True)
class Message:
    role: str
    text: str  # its text parts joined
    # A user message with images: its parts in order (multimodal/parts.py), each image an
    # ImageRef until load_item_images loads it; empty: the message is `text`.
    parts: tuple[dict, ...] = ()


@dataclass(frozen=True)
class FunctionCall:
    call_id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class CallOutput:
    call_id: str
    output: str


@dataclass(frozen=True)
class Thought:
    text: str


Item = Message | FunctionCall | CallOutput | Thought


def parse_input(value, earlier: list[Item]) -> list[Item]:
    """A request's `input` as items; `earlier` is the conversation it continues (its calls
    are what a function_call_output may answer)."""
    if isinstance(value, str):
        return [Message("user", value)]
    if value is None and earlier:
        return []  # previous_response_id alone: the model takes the next turn
    if not isinstance(value, list):
        raise InvalidRequest("input: must be a string or a list of items")
    items = [parse_item(item, f"input[{i}]") for i, item in enumerate(value)]
    calls = {i.call_id for i in earlier if isinstance(i, FunctionCall)}
    for i, item in enumerate(items):
        if isinstance(item, FunctionCall):
            calls.add(item.call_id)
        elif isinstance(item, CallOutput) and item.call_id not in calls:
            raise InvalidRequest(f"input[{i}].call_id: no function_call with call_id {item.call_id!r} came before "
                                 "it in this conversation")
    if not earlier + items:
        raise InvalidRequest("input: must hold at least one item")
    return items


def parse_item(item, where: str) -> Item:
    """One input (or earlier output) item."""
    if not isinstance(item, dict):
        raise InvalidRequest(f"{where}: must be an object, got {type(item).__name__}")
    kind = item.get("type", "message" if "role" in item else None)  # the SDKs' "easy" messages have no type
    if kind == "message":
        role = item.get("role")
        if role not in _ROLES:
            raise InvalidRequest(f"{where}.role: must be one of {', '.join(_ROLES)}, got {role!r}")
        return _message(role, item.get("content"), f"{where}.content")
    if kind == "function_call":
        call = FunctionCall(*(_string(item, key, where) for key in ("call_id", "name", "arguments")))
        call_arguments.check(call.arguments, f"{where}.arguments")
        return call
    if kind == "function_call_output":
        output = item.get("output")
        text = output if isinstance(output, str) else _text(output, f"{where}.output")
        return CallOutput(_string(item, "call_id", where), text)
    if kind == "reasoning":
        content = item.get("content")
        return Thought("" if content is None else _text(content, f"{where}.content"))
    if kind == "item_reference":
        raise InvalidRequest(f"{where}.type: item_reference is not supported; send the item itself, or "
                             "previous_response_id")
    if not isinstance(kind, str):
        raise InvalidRequest(f"{where}.type: missing; an item is a message, function_call, "
                             "function_call_output or reasoning")
    raise InvalidRequest(f"{where}.type: {kind!r} is not supported here; items may be message, function_call, "
                         "function_call_output or reasoning")


def _string(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if key == "arguments" and not isinstance(value, str):
        raise InvalidRequest(f"{where}.arguments: must be a string (the arguments as JSON text)")
    if key != "arguments" and not (isinstance(value, str) and value):
        raise InvalidRequest(f"{where}.{key}: must be a non-empty string")
    return value


def _message(role: str, content, where: str) -> Message:
    """A message item; a user message may hold input_image parts (an image_url: a data URL or an
    http(s) URL; a file_id is refused)."""
    if not isinstance(content, list) or not any(map(_is_image, content)):
        return Message(role, _text(content, where))
    parts = [mm.image_part(_image_ref(p, f"{where}[{i}]")) if _is_image(p)
             else mm.text_part(_part_text(p, f"{where}[{i}]", _WITH_IMAGES)) for i, p in enumerate(content)]
    mm.only_in_user(parts, role, where)
    return Message(role, "".join(p["text"] for p in parts if not mm.is_image(p)), tuple(parts))


def _is_image(part) -> bool:
    return isinstance(part, dict) and part.get("type") == "input_image"


def _image_ref(part: dict, where: str) -> mm.ImageRef:
    detail = part.get("detail")
    if detail is not None and detail not in _DETAILS:
        raise InvalidRequest(f"{where}.detail: must be one of {', '.join(_DETAILS)}, got {detail!r}")
    if part.get("file_id") is not None:
        raise InvalidRequest(f"{where}.file_id: images by file_id are not supported; send image_url (a data URL "
                             "or an http(s) URL)")
    return mm.url_ref(part.get("image_url"), f"{where}.image_url")


async def load_item_images(items: list[Item], load, check=None) -> list[Item]:
    """The items with their messages' images loaded (MediaFetcher.load), all concurrently; a
    conversation is stored loaded, so previous_response_id does not load them again. `check`:
    as load_images'."""
    pending = [i for i, item in enumerate(items) if isinstance(item, Message) and item.parts]
    if not pending:
        return items
    loaded = await mm.load_images([{"content": list(items[i].parts)} for i in pending], load, check)
    items = list(items)
    for i, m in zip(pending, loaded):
        items[i] = replace(items[i], parts=tuple(m["content"]))
    return items


def _text(content, where: str) -> str:
    """Text content: a string, or text parts joined (files can't be read here; images only in
    a user message: _message)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest(f"{where}: must be a string or a list of content parts")
    return "".join(_part_text(part, f"{where}[{i}]") for i, part in enumerate(content))


def _part_text(part, where: str, kinds: str = f"{', '.join(_TEXT_PARTS)} (text only)") -> str:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind not in _TEXT_PARTS:
        raise InvalidRequest(f"{where}.type: {kind!r} is not supported; parts may be {kinds}")
    text = part.get(_TEXT_PARTS[kind])
    if not isinstance(text, str):
        raise InvalidRequest(f"{where}.{_TEXT_PARTS[kind]}: must be a string")
    return text


def chat_messages(items: list[Item], instructions: str | None) -> list[dict]:
    """The conversation as chat messages, `instructions` first as the system message.
    developer is the Responses API's name for what chat templates call system."""
    messages = [{"role": "system", "content": instructions}] if instructions else []
    turn: dict | None = None  # the assistant turn being gathered
    for item in items:
        if isinstance(item, Message) and item.role != "assistant":
            turn = None
            messages.append({"role": "system" if item.role == "developer" else item.role,
                             "content": list(item.parts) if item.parts else item.text})
        elif isinstance(item, CallOutput):
            turn = None
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
        else:
            if turn is None:
                turn = {"role": "assistant", "content": ""}
                messages.append(turn)
            if isinstance(item, Message):
                turn["content"] += item.text
            elif isinstance(item, Thought):
                if item.text:  # templates that show earlier thinking read it here, as chat clients send it
                    turn["reasoning_content"] = turn.get("reasoning_content", "") + item.text
            else:
                turn.setdefault("tool_calls", []).append(
                    {"id": item.call_id, "type": "function",
                     "function": {"name": item.name, "arguments": item.arguments}})
    return messages
