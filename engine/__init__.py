"""pagedserve's engine: paged KV cache, continuous batching, our own model code. The engine
process is engine/main.py; the offline API is `from pagedserve import LLM, SamplingParams`.

`from engine import LLM` still works for one release, with a DeprecationWarning.
"""

from common.sampling_params import SamplingParams
from engine.config import EngineConfig

__all__ = ["SamplingParams", "EngineConfig"]
_MOVED = {"LLM", "RequestOutput", "CompletionOutput"}  # to pagedserve (the entrypoints' layer)


def __getattr__(name: str):
    if name in _MOVED:
        import warnings
        warnings.warn(f"`from engine import {name}` is deprecated: use `from pagedserve import {name}`",
                      DeprecationWarning, stacklevel=2)
        import pagedserve.llm  # an upward import, for compatibility only (.importlinter ignores it)
        return getattr(pagedserve.llm, name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
