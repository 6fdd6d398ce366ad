"""Each HTTP API's fields -> engine `SamplingParams`: one mapping per API, here."""

from __future__ import annotations

from engine.errors import InvalidRequest
from engine.sampling_params import SamplingParams
from frontend.http.protocol import ChatCompletionRequest, CompletionRequest, MessagesRequest, _Sampling


def completion_params(req: CompletionRequest) -> SamplingParams:
    _refuse_unsupported(req)
    if req.suffix:
        raise InvalidRequest("suffix: not supported (no fill-in-the-middle); remove it")
    # With echo, the prompt's logprobs come back too (lm-evaluation-harness's loglikelihood).
    prompt_logprobs = req.prompt_logprobs
    if req.echo and req.logprobs is not None and prompt_logprobs is None:
        prompt_logprobs = req.logprobs
    return _params(req, max_tokens=req.max_tokens, logprobs=req.logprobs, prompt_logprobs=prompt_logprobs)


def chat_params(req: ChatCompletionRequest) -> SamplingParams:
    _refuse_unsupported(req)
    if req.tools:
        raise InvalidRequest("tools: tool calling is not supported yet (it arrives with structured "
                             "output); remove tools")
    if req.tool_choice not in (None, "none"):
        raise InvalidRequest("tool_choice: tool calling is not supported yet; remove tool_choice")
    if req.top_logprobs is not None and not req.logprobs:
        raise InvalidRequest("top_logprobs: needs logprobs set to true")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    return _params(req, max_tokens=max_tokens, logprobs=logprobs, prompt_logprobs=req.prompt_logprobs)


def messages_params(req: MessagesRequest) -> SamplingParams:
    if req.tools:
        raise InvalidRequest("tools: tool use is not supported yet; remove tools")
    return SamplingParams(
        max_tokens=req.max_tokens, stop=req.stop_sequences or [],
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k or 0)


def _refuse_unsupported(req: _Sampling) -> None:
    """Fields we can't honour yet get a 400 that says so, never a silent ignore."""
    if req.best_of not in (None, 1):
        raise InvalidRequest(f"best_of: only 1 is supported, got {req.best_of}")
    if req.response_format is not None and req.response_format.get("type") != "text":
        raise InvalidRequest("response_format: structured output is not supported yet; remove it")
    if req.logit_bias:
        raise InvalidRequest("logit_bias: not supported; remove it")


def _params(req: _Sampling, **kwargs) -> SamplingParams:
    return SamplingParams(
        n=req.n, temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p, seed=req.seed, stop=req.stop or [],
        presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
        top_k=req.top_k or 0, min_p=req.min_p or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        ignore_eos=req.ignore_eos, min_tokens=req.min_tokens, stop_token_ids=req.stop_token_ids or [],
        skip_special_tokens=req.skip_special_tokens, include_stop_str_in_output=req.include_stop_str_in_output,
        **kwargs)
