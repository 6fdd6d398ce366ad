"""A model's sampling defaults, and the one function every API builds its SamplingParams with.

The engine reads the defaults from the model's generation config (`--generation-config`,
engine/models/generation_config.py) and hands them to each frontend in its Welcome. A field
a request leaves unset takes the model's default, then SamplingParams' own, as vLLM does:
every API (OpenAI and Anthropic over HTTP, gRPC, the offline LLM) goes through
`sampling_params`, so none can forget one.
"""

from __future__ import annotations

from collections.abc import Mapping

from common.sampling_params import SamplingParams

# What a generation config may set (Hugging Face's max_new_tokens is max_tokens).
DEFAULTABLE = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_tokens")
NO_DEFAULTS: Mapping[str, float | int] = {}


def sampling_params(defaults: Mapping[str, float | int], **fields: object) -> SamplingParams:
    """SamplingParams of an API's `fields`. A DEFAULTABLE field that is absent or None was left
    unset by the request: it takes `defaults`' value, else SamplingParams' own default. Except
    that max_tokens given as None stays None, SamplingParams' "until eos or the model's length"."""
    for name in DEFAULTABLE:
        if fields.get(name) is not None:
            continue
        if name in defaults:
            fields[name] = defaults[name]
        elif name != "max_tokens":
            fields.pop(name, None)
    return SamplingParams(**fields)


def describe(defaults: Mapping[str, float | int]) -> str:
    """"temperature=0.6, top_p=0.9", for logs."""
    return ", ".join(f"{name}={defaults[name]:g}" if isinstance(defaults[name], float) else f"{name}={defaults[name]}"
                     for name in DEFAULTABLE if name in defaults)
