"""A call's arguments as JSON, and how deep they may nest.

json.loads and json.dumps recurse once per level, and fail (RecursionError) near Python's
limit of 1,000 frames, at a depth that depends on how deep the stack already is. So arguments
nested deeper than MAX_DEPTH are refused wherever they come from, and every later read or
write of them (the prompt, the chat template's `tojson`, Anthropic's `input`) stays far from
that limit:

    a client's earlier call   a 400 naming its field (check)
    a model's call            no call: the JSON scanner stops there, and the text stays text
"""

from __future__ import annotations

import json

from common.errors import InvalidRequest

MAX_DEPTH = 256  # objects and arrays inside each other; deeper than any real call's


class NestedTooDeep(ValueError):
    def __init__(self) -> None:
        super().__init__(f"nested deeper than {MAX_DEPTH} levels (objects and arrays inside each other), "
                         "deeper than a call's arguments may")


def loads(text: str):
    """`text` read as JSON; ValueError when it is none, NestedTooDeep when it nests deeper
    than MAX_DEPTH (json.loads' RecursionError included)."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise NestedTooDeep() from None
    check_depth(value)
    return value


def check_depth(value) -> None:
    """NestedTooDeep if `value` (as json.loads makes it) nests deeper than MAX_DEPTH. A loop,
    not recursion: it may nest as deep as the request body could."""
    stack = [(value, 0)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        if children is None:
            continue
        if depth == MAX_DEPTH:
            raise NestedTooDeep()
        stack.extend((child, depth + 1) for child in children)


def check(arguments, field: str) -> None:
    """A client's earlier call's arguments (JSON text, or an object): InvalidRequest naming
    `field` when they nest deeper than MAX_DEPTH. Text that is no JSON passes: it is history,
    written into the prompt as given."""
    try:
        if isinstance(arguments, str):
            loads(arguments)
        else:
            check_depth(arguments)
    except NestedTooDeep as e:
        raise InvalidRequest(f"{field}: {e}") from None
    except ValueError:
        pass
