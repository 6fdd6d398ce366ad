"""pagedserve's engine: paged KV cache, continuous batching, our own model code.

    from engine import LLM, SamplingParams
    llm = LLM()  # the bundled SmolLM2-135M-Instruct
    print(llm.generate("The capital of France is", SamplingParams(temperature=0))[0].outputs[0].text)
"""

from engine.config import EngineConfig
from engine.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "EngineConfig", "RequestOutput", "CompletionOutput"]
_LAZY = {"LLM", "RequestOutput", "CompletionOutput"}


def __getattr__(name: str):
    # The offline API pulls in torch and transformers; importing it lazily keeps light
    # commands (health checks, --help) fast.
    if name in _LAZY:
        from engine import llm
        return getattr(llm, name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
