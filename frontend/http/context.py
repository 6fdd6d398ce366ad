"""What the HTTP routes share, and body parsing."""

from __future__ import annotations

import json
import logging
import re
import sys
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from functools import lru_cache

from fastapi import Request
from pydantic import BaseModel

from frontend.async_llm import AsyncLLM
from frontend.http.errors import bad_request
from frontend.http.options import AUTO, HARMONY, HttpOptions
from frontend.metrics import FrontendMetrics
from frontend.multimodal.fetch import MediaFetcher
from frontend.output_events import Event
from frontend.reasoning import parsers as reasoning_parsers
from frontend.sample_parser import SampleParser, parse_sample
from frontend.tool_calls import parsers as tool_parsers
from frontend.tool_calls.tools import ToolUse

log = logging.getLogger("pagedserve.http")
MAX_BODY_BYTES = 32 * 1024 * 1024


@dataclass
class HttpContext:
    llm: AsyncLLM
    metrics: FrontendMetrics
    served_names: list[str] = field(default_factory=list)  # empty: the engine's model name
    api_key: str | None = None
    allow_runtime_lora: bool = False  # admin LoRA routes without --api-key (a trusted network)
    options: HttpOptions = field(default_factory=HttpOptions)
    media: MediaFetcher = field(init=False)  # loads the images of a request's messages

    def __post_init__(self) -> None:
        self.token_text = lru_cache(maxsize=65536)(self._token_text)
        self.media = MediaFetcher(frozenset(self.options.allowed_media_domains), self.options.media_fetch_timeout_s)

    def model_names(self) -> list[str]:
        if self.served_names:
            return self.served_names
        welcome = self.llm.welcome
        return [welcome.model_name] if welcome is not None else []

    def resolve_model(self, model: str | None) -> str:
        """The LoRA adapter a body's `model` names, "" for the base model; NotFound (404) if
        neither. Before the first engine there is nothing to check against: 503."""
        return self.llm.require_engine().resolve_model(model, self.model_names())

    def sample_parser(self, tools: ToolUse | None) -> SampleParser:
        """A new parser for one sample of a request with these tools (see `parser_names`)."""
        return SampleParser(*self.parser_names(tools), _functions(tools), self.llm.input.harmony)

    def parse_sample(self, text: str, tools: ToolUse | None, token_ids=()) -> list[Event]:
        """A whole sample's events (frontend.sample_parser.parse_sample) for a request with these tools."""
        return parse_sample(text, *self.parser_names(tools), _functions(tools), self.llm.input.harmony, token_ids)

    def parser_names(self, tools: ToolUse | None) -> tuple[str | None, str | None]:
        """(reasoning parser, tool-call parser) for a request; None: that part is not parsed.
        Forced calls are written in our grammar's format, whatever the model's family, except
        by a model that speaks harmony (gpt-oss): harmony's own call message, and harmony as
        both parsers under auto (its output is read by harmony whatever the names)."""
        template = self.llm.tokenizer.chat_template
        harmony = self.llm.input.harmony is not None
        reasoning = self.options.reasoning_parser
        if reasoning == AUTO:
            reasoning = HARMONY if harmony else reasoning_parsers.choose(template)
        elif reasoning == "none":
            reasoning = None
        if tools is None or not tools.parses:
            return reasoning, None
        if tools.forced and not harmony:
            return reasoning, tool_parsers.FORCED
        name = self.options.tool_call_parser
        if name == AUTO:
            name = HARMONY if harmony else tool_parsers.choose(template)
        return reasoning, name

    def _token_text(self, token_id: int) -> str:
        """A token's own text, as OpenAI's logprobs show it (a byte-level piece of a character
        decodes to U+FFFD, as in vLLM)."""
        return self.llm.tokenizer.decode([token_id])

    async def counted(self, stream: AsyncIterator[str]) -> AsyncIterator[str]:
        gauge = self.metrics.active_streams.labels("http")
        gauge.inc()
        try:
            async for item in stream:
                yield item
        finally:
            gauge.dec()

    async def counted_call(self, work: Awaitable):
        gauge = self.metrics.active_streams.labels("http")
        gauge.inc()
        try:
            return await work
        finally:
            gauge.dec()

    @property
    def served_name(self) -> str:
        names = self.model_names()
        return names[0] if names else ""


def _functions(tools: ToolUse | None) -> tuple:
    """The request's tools, which some tool-call parsers read (qwen3_coder: its parameters' types)."""
    return () if tools is None else tools.tools


async def parse_body(request: Request, model: type[BaseModel]):
    """The JSON body as `model`, or a 400 naming what is wrong (never FastAPI's 422)."""
    raw = await request.body()
    if len(raw) > MAX_BODY_BYTES:
        raise bad_request(f"body: {len(raw)} bytes is more than the {MAX_BODY_BYTES} allowed")
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad_request(f"body: not valid JSON ({e})", "body") from None
    except RecursionError:
        raise bad_request("body: JSON nested too deeply", "body") from None
    except ValueError:  # valid JSON, but a number longer than Python's int() reads
        raise bad_request(f"body: a number has more than {sys.get_int_max_str_digits()} digits", "body") from None
    if not isinstance(data, dict):
        raise bad_request("body: must be a JSON object", "body")
    where = _lone_surrogate(data)
    if where is not None:
        raise bad_request(f"{where}: holds an unpaired UTF-16 surrogate (U+D800 to U+DFFF); "
                          "strings must be valid Unicode", where)
    parsed = model.model_validate(data)  # a ValidationError becomes a 400 in the error handler
    unknown = parsed.unknown_fields() if hasattr(parsed, "unknown_fields") else []
    if unknown:
        log.debug("ignored unknown fields in %s: %s", request.url.path, ", ".join(unknown))
    return parsed


_SURROGATE = re.compile("[\ud800-\udfff]")


def _lone_surrogate(data: dict) -> str | None:
    """A field whose string (or key) holds a lone surrogate: json.loads lets one through
    (a \\ud800 escape, or its bytes: it decodes with surrogatepass), and no tokenizer or
    protobuf can encode it. A loop, not recursion: bodies may nest deep."""
    stack: list[tuple[str, object]] = [("", data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            if _SURROGATE.search(value):
                return path or "body"
            continue
        items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
        for key, item in items:
            if isinstance(key, str) and _SURROGATE.search(key):
                return path or "body"  # not the key itself: the error message could not hold it
            stack.append((f"{path}.{key}" if path else str(key), item))
    return None
