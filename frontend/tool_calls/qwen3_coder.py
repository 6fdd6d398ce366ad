"""Qwen3-Coder tool calls, XML-like, each parameter's value as raw text:

    <tool_call>
    <function=write_file>
    <parameter=path>
    notes.txt
    </parameter>
    <parameter=lines>
    3
    </parameter>
    </function>
    </tool_call>

Several calls are several blocks. As vLLM's qwen3_coder parser does, a value loses one newline
at each end and becomes JSON by its parameter's type in the request's tool schema: a string
stays the text as written; a number, boolean, null, object or array is the text read as JSON
(`True`/`False` too, as the template writes booleans back), falling back to the text where it
does not read as JSON; an undeclared parameter, or one whose schema names no type, is a
string. A value ends at `</parameter>`, or where the next `<parameter=`
or `</function>` begins when the model left that out; a `<function=...>` without the
`<tool_call>` around it is read too.

A call is announced at its first parameter, and its arguments go out a parameter at a time:
`{"path": "notes.txt"`, then `, "lines": 3`, then `}`. A call a stream announced that goes no
further ends with `}`: its arguments stay a whole JSON object of the parameters read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from frontend.tool_calls import arguments as call_arguments
from frontend.tool_calls.stream import WS, Block, CallStream, expect, first_marker, partial_marker_len

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FUNCTION, FUNCTION_END = "<function=", "</function>"
PARAMETER, PARAMETER_END = "<parameter=", "</parameter>"
_VALUE_ENDS = (PARAMETER_END, PARAMETER, FUNCTION_END)


@dataclass
class _Block(Block):
    wrapped: bool = True  # opened by <tool_call> (a closing tag may follow the function)
    stage: str = "function"  # function | name | body | key | value | after
    name: str = ""
    key: str = ""
    value: str = ""
    keys: set[str] = field(default_factory=set)  # the current call's parameters so far


class Qwen3CoderParser(CallStream):
    STARTS = (OPEN, FUNCTION)

    def __init__(self, tools: tuple = ()) -> None:
        super().__init__(tools)
        self._properties = {t.name: _properties(t.parameters) for t in tools}

    def _open(self, marker: str) -> Block:
        return _Block() if marker == OPEN else _Block(wrapped=False, stage="name")

    def _close_arguments(self, block: _Block) -> str:
        return "}"  # the parameters sent so far are whole: the object only needs closing

    def _step_block(self, block: _Block) -> bool:
        stage = block.stage
        if stage == "function":  # after <tool_call>: whitespace, then <function=
            if not self._skip_ws() or self._literal((FUNCTION,)) is None:
                return False
            block.stage = "name"
            return True
        if stage in ("name", "key"):
            return self._step_tag_name(block)
        if stage == "body":
            return self._step_body(block)
        if stage == "value":
            return self._step_value(block)
        return self._step_after(block)

    def _step_tag_name(self, block: _Block) -> bool:
        """A function's or parameter's name, up to the `>` that ends its tag."""
        at = self._buffer.find(">")
        name = self._buffer if at < 0 else self._buffer[:at]
        expect(not any(c in name for c in "<" + WS))
        self._consume(len(name))
        if block.stage == "name":
            block.name += name
        else:
            block.key += name
        if at < 0:
            return False
        self._consume(1)
        if block.stage == "name":
            expect(bool(block.name))
            block.stage = "body"
        else:
            expect(bool(block.key) and block.key not in block.keys)
            block.keys.add(block.key)
            block.stage, block.value = "value", ""
        return True

    def _step_body(self, block: _Block) -> bool:
        """Between parameters: the next one, or the function's end."""
        if not self._skip_ws():
            return False
        found = self._literal((PARAMETER, FUNCTION_END))
        if found == PARAMETER:
            if block.index is None:
                self._announce(block.name)
                self._send("{")
            block.stage, block.key = "key", ""
        elif found == FUNCTION_END:
            if block.index is None:
                self._announce(block.name)
                self._send("{}")
            else:
                self._send("}")
            self._call_done()
            block.stage, block.name, block.keys = "after", "", set()
        return found is not None

    def _step_value(self, block: _Block) -> bool:
        at, end = first_marker(self._buffer, _VALUE_ENDS)
        if end is None:  # all of it is the value, but a tail that may begin an end
            n = len(self._buffer) - partial_marker_len(self._buffer, _VALUE_ENDS)
            block.value += self._buffer[:n]
            self._consume(n)
            return False
        block.value += self._buffer[:at]
        self._consume(at + len(end) if end == PARAMETER_END else at)
        separator = ", " if len(block.keys) > 1 else ""  # `keys` holds this one already
        value = self._typed(block.name, block.key, _trim_newline(block.value))
        self._send(f"{separator}{json.dumps(block.key, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}")
        block.stage = "body"
        return True

    def _step_after(self, block: _Block) -> bool:
        """After a function: the closing tag, or a next function in the same block, or the end."""
        stripped = self._buffer.lstrip(WS)
        if block.wrapped and stripped.startswith(CLOSE):
            self._buffer = stripped[len(CLOSE):]
        elif block.wrapped and stripped.startswith(FUNCTION):
            self._consume(len(self._buffer) - len(stripped) + len(FUNCTION))
            block.stage, block.closable = "name", False
            return True
        elif block.wrapped and (CLOSE.startswith(stripped) or FUNCTION.startswith(stripped)):
            return False  # it may still come
        self._end_block()
        return True

    def _typed(self, function: str, key: str, text: str):
        """A parameter's value as its schema's type makes it (see the module's docstring)."""
        kinds = _types(self._properties.get(function, {}).get(key)) - {"string"}
        if not kinds:
            return text
        if "boolean" in kinds and text.strip() in ("True", "False"):
            return text.strip() == "True"
        try:
            value = json.loads(text, parse_constant=_refuse)
            call_arguments.check_depth({key: value})  # as it will sit in the arguments
            return value
        except (ValueError, RecursionError):  # RecursionError: nested too deep to read
            return text


def _properties(schema: dict) -> dict:
    properties = schema.get("properties")
    return properties if isinstance(properties, dict) else {}


def _types(schema) -> set[str]:
    """The JSON types a schema allows: its `type`, and its `anyOf`/`oneOf` members'."""
    if not isinstance(schema, dict):
        return set()
    declared = schema.get("type")
    declared = [declared] if isinstance(declared, str) else declared if isinstance(declared, list) else []
    kinds = {t for t in declared if isinstance(t, str)}
    for key in ("anyOf", "oneOf"):
        for member in schema.get(key) or []:
            kinds |= _types(member)
    return kinds


def _refuse(constant: str):
    raise ValueError(f"{constant} is no JSON value")  # json.loads would take NaN and Infinity


def _trim_newline(text: str) -> str:
    """The value as the template writes it, a newline after the tag and one before the end."""
    text = text[1:] if text.startswith("\n") else text
    return text[:-1] if text.endswith("\n") else text
