"""The body of POST /v1/responses. Types are checked here, and the values of the API's enums
(protocol.py); the shapes of `input`, `tools`, `tool_choice` and `text.format` by hand
(items.py, sampling.py), so a 400 names the exact place, e.g. `input[2].call_id`. The SDK
sends null for an optional field it was given as None."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, StrictBool, StrictInt, with_config
from typing_extensions import TypedDict

from common.errors import InvalidRequest
from frontend.http.protocol import (PromptCacheRetention, ReasoningEffort, StructuredOutputsRequest, Verbosity,
                                    _Request)

Includable = Literal["file_search_call.results", "web_search_call.results", "web_search_call.action.sources",
                     "message.input_image.image_url", "computer_call_output.output.image_url",
                     "code_interpreter_call.outputs", "reasoning.encrypted_content", "message.output_text.logprobs"]
Summary = Literal["auto", "concise", "detailed"]

# OpenAI fields we cannot honour: set, they get a 400 rather than a silent ignore.
_UNSUPPORTED = {
    "conversation": "the Conversations API is not served here; chain responses with previous_response_id",
    "prompt": "stored prompt templates are not served here; send instructions and input",
    "context_management": "not supported",
    "top_logprobs": "logprobs are not supported on /v1/responses; use /v1/chat/completions",
    "max_tool_calls": "not supported (it limits built-in tools, which are not served here)",
}


@with_config(ConfigDict(extra="allow"))
class ReasoningConfig(TypedDict, total=False):
    """`reasoning`, kept as the dict it came as (the response echoes it)."""

    effort: ReasoningEffort | None  # to the chat template (sampling.py)
    summary: Summary | None  # accepted: the thinking comes back whole, as reasoning_text
    generate_summary: Summary | None
    context: Literal["auto", "current_turn", "all_turns"] | None


@with_config(ConfigDict(extra="allow"))
class TextConfig(TypedDict, total=False):
    """`text`, kept as the dict it came as (the response echoes it)."""

    format: Any  # sampling.text_format
    verbosity: Verbosity | None  # accepted, not acted on


class ResponsesRequest(_Request):
    model: str | None = None
    input: Any = None  # a string or a list of items: items.parse_input
    instructions: str | None = None
    max_output_tokens: StrictInt | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: Any = None  # sampling.responses_tool_use
    tool_choice: Any = None
    parallel_tool_calls: StrictBool | None = None  # None: true
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    store: StrictBool | None = None  # None: true
    previous_response_id: str | None = None
    background: StrictBool | None = None
    stream: StrictBool | None = None
    include: list[Includable] | None = None  # accepted; nothing here has extra output to include
    truncation: Literal["auto", "disabled"] | None = None  # "disabled" only: a conversation too long is a 400
    structured_outputs: StructuredOutputsRequest | None = None  # vLLM's, as on the other routes
    # not acted on here (ignored): only their values are checked
    service_tier: Literal["auto", "default", "flex", "scale", "priority", "fast", "ultrafast"] | None = None
    prompt_cache_retention: PromptCacheRetention | None = None

    def check(self) -> None:
        """What pydantic's types can't say."""
        for name, why in _UNSUPPORTED.items():
            if (self.model_extra or {}).get(name) is not None:
                raise InvalidRequest(f"{name}: {why}")
        if self.truncation == "auto":
            raise InvalidRequest('truncation: only "disabled" is supported, not "auto" (a conversation longer '
                                 "than the model's context is a 400)")
        if self.background and not self.keeps:
            raise InvalidRequest("background: a background response must be stored; set store to true")
        if self.background and self.stream:
            raise InvalidRequest("background: streaming a background response is not supported; "
                                 "poll GET /v1/responses/{id} instead")
        if self.metadata is not None and len(self.metadata) > 16:
            raise InvalidRequest(f"metadata: at most 16 keys, got {len(self.metadata)}")

    @property
    def keeps(self) -> bool:
        return self.store is not False
