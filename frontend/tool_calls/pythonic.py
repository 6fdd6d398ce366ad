"""Pythonic tool calls: a Python list of calls with keyword arguments of literal values,

    [get_weather(city="Paris", days=[1, 2]), get_time()]

as Llama 3.2's and Llama 4's pythonic templates ask for them ('[func_name1(params_name1=
params_value1, params_name2=params_value2...), func_name2(params)]'), and ToolACE and others
write them. Python's `ast` reads each call; its values may be strings, numbers, booleans,
None, lists (tuples too) and dicts with string keys, and go out as JSON (None as null).
Anything else (a variable, an expression, a positional argument) makes the list text again.

The arguments are not JSON on the wire, so a call is announced with all of its arguments at
once, at its closing parenthesis: a list's earlier calls go out while later ones are written.
A list may begin at any `[`; brackets in prose (`[1]`, `[a link](...)`) are text again at
their first character that cannot be part of a call.
"""

from __future__ import annotations

import ast
import json
import math
import re
from dataclasses import dataclass

from frontend.tool_calls.json_scan import COMPLETE, INCOMPLETE, INVALID
from frontend.tool_calls.stream import Block, CallStream, Malformed, expect

_WORD = re.compile(r"\w*")
_OPENING = {")": "(", "]": "[", "}": "{"}


class _Parens:
    """Finds the `)` that ends a call's arguments, past strings and nested brackets. `state`
    is INCOMPLETE, COMPLETE (the `)` was read) or INVALID (a bracket that does not match, a
    comment, a line break in a one-quote string)."""

    def __init__(self) -> None:
        self.state = INCOMPLETE
        self._stack = ["("]
        self._quote = ""  # the open string's quote: ', ", ''' or """
        self._escape = False
        self._run = 0  # in a triple-quoted string: how many of its quotes came in a row

    def feed(self, text: str) -> int:
        """Read what belongs to the arguments; returns how many characters did."""
        i = 0
        while i < len(text) and self.state == INCOMPLETE:
            c = text[i]
            if self._quote:
                self._string_char(c)
            elif c in "'\"":
                if text.startswith(c * 3, i):
                    self._quote = c * 3
                    i += 3
                    continue
                if len(text) - i < 3 and (c * 3).startswith(text[i:]):
                    break  # one or two quotes at the end: a triple quote may be beginning
                self._quote = c
            elif c in "([{":
                self._stack.append(c)
            elif c in _OPENING:
                if self._stack.pop() != _OPENING[c]:
                    self.state = INVALID
                elif not self._stack:
                    self.state = COMPLETE
            elif c == "#":
                self.state = INVALID  # a comment could hide anything
            if self.state == INVALID:
                break  # the bad character is not read
            i += 1
        return i

    def _string_char(self, c: str) -> None:
        if self._escape:
            self._escape, self._run = False, 0
        elif c == "\\":
            self._escape, self._run = True, 0
        elif len(self._quote) == 1:
            if c == self._quote:
                self._quote = ""
            elif c == "\n":
                self.state = INVALID  # a one-quote string ends on its line
        else:
            self._run = self._run + 1 if c == self._quote[0] else 0
            if self._run == 3:
                self._quote, self._run = "", 0


@dataclass
class _Block(Block):
    stage: str = "name"  # name | arguments | next
    text: str = ""  # the current call's text, from its name on
    parens: _Parens | None = None


class PythonicParser(CallStream):
    STARTS = ("[",)

    def _open(self, marker: str) -> Block:
        return _Block()

    def _step_block(self, block: _Block) -> bool:
        if block.stage == "name":
            return self._step_name(block)
        if block.stage == "arguments":
            return self._step_arguments(block)
        # After a call: `,` and the next one, or `]`.
        if not self._skip_ws():
            return False
        c = self._buffer[0]
        expect(c in ",]")
        self._consume(1)
        if c == ",":
            block.stage, block.closable = "name", False
        else:
            self._end_block()
        return True

    def _step_name(self, block: _Block) -> bool:
        if not block.text and not self._skip_ws():
            return False
        n = _WORD.match(self._buffer).end()
        block.text += self._buffer[:n]
        self._consume(n)
        if not self._buffer:
            return False
        expect(block.text.isidentifier() and self._buffer[0] == "(")
        self._consume(1)
        block.text += "("
        block.stage, block.parens = "arguments", _Parens()
        return True

    def _step_arguments(self, block: _Block) -> bool:
        taken = block.parens.feed(self._buffer)
        block.text += self._buffer[:taken]
        self._consume(taken)
        expect(block.parens.state != INVALID)
        if block.parens.state != COMPLETE:
            return False
        name, arguments = _call(block.text)
        self._announce(name)
        self._send(json.dumps(arguments, ensure_ascii=False))
        self._call_done()
        block.stage, block.text, block.parens = "next", "", None
        return True


def _call(text: str) -> tuple[str, dict]:
    """(name, arguments) of `name(key=literal, ...)`; Malformed if it is anything else."""
    try:
        call = ast.parse(text, mode="eval").body
        expect(isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and not call.args)
        expect(all(k.arg is not None for k in call.keywords))  # no **spread
        return call.func.id, {k.arg: _literal(k.value) for k in call.keywords}
    except (SyntaxError, ValueError, RecursionError):  # ValueError: a NUL character
        raise Malformed from None


def _literal(node: ast.expr):
    """A JSON value from a Python literal; Malformed for anything else."""
    if isinstance(node, ast.Constant):
        value = node.value
        expect(value is None or isinstance(value, (str, int)) or isinstance(value, float) and math.isfinite(value))
        return value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):  # -1 is an operator and 1
        expect(isinstance(node.operand, ast.Constant) and type(node.operand.value) in (int, float))
        value = _literal(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(item) for item in node.elts]
    expect(isinstance(node, ast.Dict))
    expect(all(isinstance(k, ast.Constant) and isinstance(k.value, str) for k in node.keys))  # a None key: **spread
    return {k.value: _literal(v) for k, v in zip(node.keys, node.values)}
