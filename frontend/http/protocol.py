"""Request bodies of the HTTP API: OpenAI's shapes with vLLM's extras, and Anthropic's.

Types are checked here (pydantic); ranges by `SamplingParams`, so both APIs and gRPC give
the same messages. Unknown fields are allowed and logged at debug level, as vLLM does. A field
the API defines as an enum is declared with the API's values (those of the `openai` and
`anthropic` SDKs' types), even where nothing here acts on it: a value outside them is a 400
naming the field, as OpenAI and Anthropic answer, never a silent ignore.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt


ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]
Verbosity = Literal["low", "medium", "high"]
PromptCacheRetention = Literal["in_memory", "24h"]


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")

    def unknown_fields(self) -> list[str]:
        return sorted(self.model_extra or {})


class StreamOptions(BaseModel):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False


class StructuredOutputsRequest(BaseModel):
    """vLLM's `structured_outputs` extra: set exactly one (engine StructuredOutputsParams)."""

    model_config = ConfigDict(extra="forbid")  # vLLM's other options would be silently ignored

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    json_object: StrictBool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class _Sampling(_Request):
    """The sampling fields both OpenAI endpoints share."""

    model: str | None = None
    n: StrictInt = 1
    temperature: float | None = None
    top_p: float | None = None
    seed: StrictInt | None = None
    stop: str | list[str] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    best_of: StrictInt | None = None
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None  # checked by hand: params.py says what is wrong
    # vLLM's extras
    structured_outputs: StructuredOutputsRequest | None = None
    top_k: StrictInt | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: StrictBool = False
    min_tokens: StrictInt = 0
    stop_token_ids: list[StrictInt] | None = None
    skip_special_tokens: StrictBool = True
    include_stop_str_in_output: StrictBool = False
    prompt_logprobs: StrictInt | None = None
    bad_words: list[str] | None = None
    allowed_token_ids: list[StrictInt] | None = None
    priority: StrictInt = 0
    request_id: str | None = None
    disable_speculation: StrictBool = False  # ours: opt out of the engine's speculative decoding


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    max_tokens: StrictInt | None = 16  # OpenAI's default
    echo: StrictBool = False
    logprobs: StrictInt | None = None
    suffix: str | None = None
    add_special_tokens: StrictBool = True


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ImageUrl(BaseModel):
    url: str  # a data URL, or an http(s) URL on a host of --allowed-media-domains
    detail: Literal["auto", "low", "high", "original"] | None = None  # accepted, not acted on


class ImageUrlPart(BaseModel):
    """OpenAI's image part; `image_url` may be the URL itself (the older form clients still send)."""

    type: Literal["image_url"]
    image_url: ImageUrl | str


ChatPart = Annotated[TextPart | ImageUrlPart, Field(discriminator="type")]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id, ...: passed to the template

    role: str
    content: str | list[ChatPart] | None = None


class FunctionDefinition(BaseModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of type object; None: no arguments
    strict: StrictBool | None = None  # accepted; required/named calls are always enforced


class ChatTool(BaseModel):
    type: Literal["function"]  # OpenAI's "custom" tools take free text: not supported
    function: FunctionDefinition


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage]
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None
    tools: list[ChatTool] | None = None
    tool_choice: Any = None  # checked by hand: params.py says what is wrong
    parallel_tool_calls: StrictBool = True
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: StrictBool = False
    # To the chat template (and harmony's prompt) as reasoning_effort: params.chat_template_kwargs.
    reasoning_effort: ReasoningEffort | None = None
    # OpenAI's, not acted on here (ignored): only their values are checked
    service_tier: Literal["auto", "default", "flex", "scale", "priority", "fast"] | None = None
    modalities: list[Literal["text", "audio"]] | None = None
    verbosity: Verbosity | None = None
    prompt_cache_retention: PromptCacheRetention | None = None


class CacheControl(BaseModel):
    """Anthropic's prompt-caching breakpoint: accepted and not acted on (the engine's prefix
    cache needs none); only its values are checked."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] = "5m"


class AnthropicText(TextPart):
    cache_control: CacheControl | None = None


class Base64Source(BaseModel):
    type: Literal["base64"]
    media_type: Literal["image/jpeg", "image/png", "image/gif", "image/webp"]
    data: str


class UrlSource(BaseModel):
    type: Literal["url"]
    url: str  # an http(s) URL on a host of --allowed-media-domains


class FileSource(BaseModel):
    """Anthropic's Files API image: refused by name (this server keeps no such files)."""

    type: Literal["file"]
    file_id: str


class ImageBlock(BaseModel):
    """An image in a user message."""

    type: Literal["image"]
    source: Annotated[Base64Source | UrlSource | FileSource, Field(discriminator="type")]
    cache_control: CacheControl | None = None


class ToolUseBlock(BaseModel):
    """An assistant's earlier call."""

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlock(BaseModel):
    """The caller's answer to a call, in a user message."""

    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[Annotated[AnthropicText | ImageBlock, Field(discriminator="type")]] = ""
    is_error: StrictBool = False
    cache_control: CacheControl | None = None


class ThinkingBlock(BaseModel):
    """An assistant's earlier thinking, sent back: its text goes to the template as the
    message's reasoning_content (Qwen3's reads it); the signature is not checked (ours are empty)."""

    type: Literal["thinking"]
    thinking: str
    signature: str = ""


class RedactedThinkingBlock(BaseModel):
    """Anthropic's encrypted thinking: opaque here, dropped (this server never writes one)."""

    type: Literal["redacted_thinking"]
    data: str


ContentBlock = Annotated[AnthropicText | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock
                         | RedactedThinkingBlock, Field(discriminator="type")]


class AnthropicMessage(BaseModel):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class AnthropicTool(BaseModel):
    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None  # Anthropic's server tools (web search, ...) run on its side
    cache_control: CacheControl | None = None


class AnthropicToolChoice(BaseModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: StrictBool = False


class AnthropicThinking(BaseModel):
    """Anthropic's `thinking`: the chat template's enable_thinking (params.py). budget_tokens is
    checked as Anthropic checks it, and not enforced beyond max_tokens (which counts thinking)."""

    type: Literal["enabled", "adaptive", "disabled"]
    budget_tokens: StrictInt | None = None
    display: Literal["summarized", "omitted"] | None = None  # omitted: thinking blocks come back empty


class AnthropicOutputConfig(BaseModel):
    model_config = ConfigDict(extra="allow")

    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None  # not acted on
    format: Any = None  # not supported, and ignored: use vLLM's structured_outputs


class MessagesRequest(_Request):
    model: str
    max_tokens: StrictInt
    messages: list[AnthropicMessage]
    system: str | list[AnthropicText] | None = None
    stop_sequences: list[str] | None = None
    stream: StrictBool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: StrictInt | None = None
    metadata: dict[str, Any] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: AnthropicThinking | None = None
    disable_speculation: StrictBool = False  # ours, as on the OpenAI routes
    structured_outputs: StructuredOutputsRequest | None = None  # vLLM's, as on the OpenAI routes
    # Anthropic's, not acted on here (ignored): only their values are checked
    service_tier: Literal["auto", "standard_only"] | None = None
    speed: Literal["standard", "fast"] | None = None
    output_config: AnthropicOutputConfig | None = None
    cache_control: CacheControl | None = None


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool = True
    add_generation_prompt: StrictBool = True


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[StrictInt] = Field(default_factory=list)


class LoadLoraAdapterRequest(_Request):
    """vLLM's POST /v1/load_lora_adapter."""

    lora_name: str
    lora_path: str


class UnloadLoraAdapterRequest(_Request):
    """vLLM's POST /v1/unload_lora_adapter (its lora_int_id is accepted and ignored)."""

    lora_name: str


class EmbeddingRequest(_Request):
    """OpenAI's POST /v1/embeddings, with vLLM's truncate_prompt_tokens and priority."""

    input: str | list[StrictInt] | list[str] | list[list[StrictInt]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = None
    user: str | None = None
    truncate_prompt_tokens: StrictInt | None = None
    priority: StrictInt = 0


class ScoreRequest(_Request):
    """vLLM's POST /score: text_1 against each text_2, or pair by pair."""

    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    truncate_prompt_tokens: StrictInt | None = None
    priority: StrictInt = 0


class RerankRequest(_Request):
    """Cohere's and Jina's POST /v1/rerank (as vLLM serves it)."""

    model: str | None = None
    query: str
    documents: list[str]
    top_n: StrictInt | None = None
    return_documents: StrictBool = True
    truncate_prompt_tokens: StrictInt | None = None
    priority: StrictInt = 0
