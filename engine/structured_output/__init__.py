"""Structured output: constraining generation to a JSON schema, regex, choice or grammar.

`params` is torch-free (the frontend uses it); `backend` is the grammar-library interface;
`manager` is the engine's compile cache and per-sample matchers. docs/api.md shows the APIs.
"""

from engine.structured_output.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
