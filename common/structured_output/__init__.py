"""Structured output's torch-free half: what a constraint is (`params`), the grammar-library
interface (`backend`) and its llguidance implementation. The frontend validates constraints
with it; the engine compiles them and keeps a matcher per sample (engine/structured_output).
docs/api.md shows the APIs.
"""

from __future__ import annotations

from common.structured_output.backend import GrammarBackend
from common.structured_output.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams", "get_backend_class"]


def get_backend_class(name: str) -> type[GrammarBackend]:
    """The grammar backend called `name`; importing it loads its library."""
    if name == "llguidance":
        from common.structured_output.llguidance_backend import LLGuidanceBackend
        return LLGuidanceBackend
    raise ValueError(f"unknown structured output backend {name!r} (known: llguidance)")
