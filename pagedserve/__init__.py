"""pagedserve: the command line (`pagedserve serve|engine|frontend|bench|...`, pagedserve/cli.py)
and the offline API, as vLLM's:

    from pagedserve import LLM, SamplingParams
    llm = LLM()  # the bundled SmolLM2-135M-Instruct
    print(llm.generate("The capital of France is", SamplingParams(temperature=0))[0].outputs[0].text)

The offline API pulls in torch and transformers, so it is imported on first use: a frontend
process, a health check or `--help` never loads them (docs/architecture.md).
"""

from __future__ import annotations

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "EngineConfig", "EmbeddingOutput",
           "ScoringOutput"]


def __getattr__(name: str):
    if name == "SamplingParams":
        from common.sampling_params import SamplingParams
        return SamplingParams
    if name == "EngineConfig":
        from engine.config import EngineConfig
        return EngineConfig
    if name in ("LLM", "RequestOutput", "CompletionOutput"):
        from pagedserve import llm
        return getattr(llm, name)
    if name in ("EmbeddingOutput", "ScoringOutput"):
        from pagedserve import pooling
        return getattr(pooling, name)
    raise AttributeError(f"module 'pagedserve' has no attribute {name!r}")
