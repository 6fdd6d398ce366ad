"""pagedserve's engine: paged KV cache, continuous batching, our own model code.

    from engine import LLM, SamplingParams
    llm = LLM()  # the bundled SmolLM2-135M-Instruct
    print(llm.generate("The capital of France is", SamplingParams(temperature=0))[0].outputs[0].text)
"""

from engine.config import EngineConfig
from engine.llm import LLM, CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "EngineConfig", "RequestOutput", "CompletionOutput"]
