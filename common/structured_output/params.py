"""What a request's output must match: vLLM's `StructuredOutputsParams`, one kind per request.

Torch-free and library-free: the frontend builds and validates these, the engine compiles
them. `key` is the canonical spec the engine caches compiled grammars by: compact, but in the
order given, as a schema's property order is the order the grammar writes them in.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

from common.errors import InvalidRequest

KINDS = ("json", "json_object", "regex", "choice", "grammar")
MAX_SPEC_CHARS = 256_000  # a schema or grammar larger than this is refused before compiling
MAX_CHOICES = 4096


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one field is set.

    json: a JSON Schema (a dict, or its JSON text); the output is one JSON value that
        validates against it, with an object's properties in the schema's order.
    json_object: any JSON object.
    regex: the whole output matches this regular expression (Rust `regex` syntax).
    choice: the output is exactly one of these strings.
    grammar: a context-free grammar in llguidance's Lark syntax (which also embeds JSON
        schemas with `%json {...}`).

    And, with any kind: starts_after, token ids that end the model's reasoning (`</think>`,
    as the frontend tokenized it). The grammar then applies only after them: the output is
    free until the prompt and output so far end with these tokens, or with their text written
    in other tokens (the grammar starts after the token that completes it), and the rest
    matches the grammar. Empty: the whole output matches. Not part of `key` (the grammar is
    the same).

    And param: the request's field that gave the constraint (an HTTP request's
    `response_format.json_schema.schema`), for the errors the engine finds later, which name
    `structured_outputs.KIND` (see `named`). The frontend's own: never sent to the engine.
    """

    json: str | dict | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    starts_after: tuple[int, ...] = ()
    param: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        set_kinds = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(set_kinds) != 1:
            raise InvalidRequest("structured_outputs: set exactly one of json, json_object, regex, choice, "
                                 f"grammar (got {', '.join(set_kinds) or 'none'})")
        if self.json is not None:
            object.__setattr__(self, "json", _canonical_json(self.json))
        if self.choice is not None:
            object.__setattr__(self, "choice", _choices(self.choice))
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidRequest(f"structured_outputs.{name}: must be a non-empty string")
        object.__setattr__(self, "starts_after", tuple(self.starts_after))
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.starts_after):
            raise InvalidRequest("structured_outputs.starts_after: must be a list of token ids")
        if len(self.spec) > MAX_SPEC_CHARS:
            raise InvalidRequest(f"structured_outputs.{self.kind}: {len(self.spec)} characters is more "
                                 f"than the {MAX_SPEC_CHARS} allowed")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def spec(self) -> str:
        """The constraint as text: the canonical JSON schema, the regex, the grammar, or the
        choices as a JSON list."""
        kind = self.kind
        if kind == "json_object":
            return ""
        if kind == "choice":
            return json.dumps(list(self.choice), ensure_ascii=False)
        return getattr(self, kind)

    @property
    def key(self) -> str:
        """Equal keys compile to the same grammar. A digest: caches keep thousands of keys, and
        a spec may be 256 KB."""
        return hashlib.sha256(f"{self.kind}\0{self.spec}".encode()).hexdigest()


def named(message: str, param: str) -> str:
    """An error about a constraint under the request's own field `param`: the
    `structured_outputs.KIND: ` the engine and the grammar library begin with replaced by
    `param: `, or `param: ` put before it. "": the message as it is."""
    if not param:
        return message
    if message.startswith("structured_outputs.") and ": " in message:
        message = message.split(": ", 1)[1]
    return f"{param}: {message}"


def _canonical_json(schema: str | dict) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise InvalidRequest(f"structured_outputs.json: not valid JSON ({e})") from None
    if not isinstance(schema, (dict, bool)):
        raise InvalidRequest("structured_outputs.json: a JSON schema must be an object")
    # Not sorted: the grammar writes properties in the schema's order, and a model answers
    # better in the order the schema's author chose (a name before the fields that use it).
    return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)


def _choices(choices) -> tuple[str, ...]:
    if isinstance(choices, str) or not all(isinstance(c, str) and c for c in choices):
        raise InvalidRequest("structured_outputs.choice: must be a list of non-empty strings")
    choices = tuple(choices)
    if not 1 <= len(choices) <= MAX_CHOICES:
        raise InvalidRequest(f"structured_outputs.choice: needs 1 to {MAX_CHOICES} strings, got {len(choices)}")
    return choices
