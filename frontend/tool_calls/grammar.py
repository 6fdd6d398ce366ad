"""The grammar that forces tool calls (tool_choice "required" or a named tool): Hermes blocks

    <tool_call>
    {"name": "NAME", "arguments": {...}}
    </tool_call>

one or more of them (several separated by a newline), written in llguidance's Lark syntax
with each call's JSON constrained by `%json`: the name is a constant and the arguments follow
that tool's parameters schema. The output then reads back through the same Hermes parser as
free text does, so streaming works alike.

A harmony model (gpt-oss) calls in its own message instead, which `<|call|>` ends (a stop
token: one call a turn, as the format has it):

    <|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>

The grammar holds the output from its first token, so the call comes without an analysis
message first: the client has decided that a call comes, and the schema holds its arguments.
"""

from __future__ import annotations

import json

# Compact JSON, as for response_format: one setting for every JSON the engine constrains.
from common.structured_output.llguidance_backend import JSON_OPTIONS
_ARGUMENTS_DEF = "__arguments__"


def forced_calls_grammar(tools, one: bool) -> str:
    """Lark text: one call of any of `tools` (one), or one or more."""
    bodies = [f"body_{i}: %json {json.dumps(call_schema(t.name, t.parameters), ensure_ascii=False)}"
              for i, t in enumerate(tools)]
    repeat = "" if one else ' ("\\n" call)*'
    return "\n".join([f"start: call{repeat}",
                      'call: "<tool_call>\\n" body "\\n</tool_call>"',
                      "body: " + " | ".join(f"body_{i}" for i in range(len(tools))),
                      *bodies])


def harmony_call_grammar(tools) -> str:
    """Lark text: one harmony call message of any of `tools` (special tokens as <|name|>)."""
    calls = [f'call_{i}: <|channel|> "commentary to=functions.{t.name} " <|constrain|> "json" <|message|> '
             f'%json {json.dumps(_with_options(t.parameters), ensure_ascii=False)} <|call|>'
             for i, t in enumerate(tools)]
    return "\n".join(["start: " + " | ".join(f"call_{i}" for i in range(len(tools))), *calls])


def _with_options(schema: dict) -> dict:
    return {**schema, "x-guidance": JSON_OPTIONS}


def call_schema(name: str, parameters: dict) -> dict:
    """{"name": NAME, "arguments": <parameters>}, both required, nothing else. The parameters
    go under `$defs` and their own `$defs` beside them, so their `$ref`s still resolve: a
    `#/$defs/X` is unchanged, and any other `#...` is rewritten to point into the moved copy."""
    parameters = dict(parameters)
    defs = {**parameters.pop("definitions", {}), **parameters.pop("$defs", {})}
    moved_defs = {key: _rewrite_refs(value) for key, value in defs.items()}
    return {
        "type": "object",
        "properties": {"name": {"const": name}, "arguments": {"$ref": f"#/$defs/{_ARGUMENTS_DEF}"}},
        "required": ["name", "arguments"],
        "additionalProperties": False,
        "$defs": {**moved_defs, _ARGUMENTS_DEF: _rewrite_refs(parameters)},
        "x-guidance": JSON_OPTIONS,
    }


def _rewrite_refs(schema):
    if isinstance(schema, list):
        return [_rewrite_refs(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: _rewrite_refs(value) for key, value in schema.items()}
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
        pointer = ref[1:]
        if pointer.startswith("/definitions/"):
            out["$ref"] = "#/$defs/" + pointer[len("/definitions/"):]
        elif not pointer.startswith("/$defs/"):
            out["$ref"] = f"#/$defs/{_ARGUMENTS_DEF}{pointer}"
    return out
