"""The HTTP API's own settings (`pagedserve serve|frontend` flags), kept apart from the
frontend's so the routes read one object."""

from __future__ import annotations

from dataclasses import dataclass

from frontend.harmony import NAME as HARMONY
from frontend.multimodal import DEFAULT_MAX_IMAGES

AUTO = "auto"


@dataclass
class HttpOptions:
    # The parser that finds tool calls in free text (tool_choice "auto"): a family's name from
    # frontend/tool_calls/parsers.py, or "auto": chosen from the model's chat template.
    tool_call_parser: str = AUTO
    # The parser that splits reasoning (<think>...</think>) from the answer: a name from
    # frontend/reasoning, "auto" (from the chat template, where that is unambiguous) or "none".
    reasoning_parser: str = AUTO
    # /v1/responses with store=true: responses kept in this frontend's memory, least recently
    # used dropped first, each for at most response_ttl_s.
    response_store_size: int = 1000
    response_ttl_s: float = 3600.0
    # /v1/files and /v1/batches keep their files here; None: a folder under the cache.
    data_dir: str | None = None
    # Image URLs (http, https) are fetched only from these hosts, matched exactly; none: only
    # data URLs are taken (frontend/multimodal/fetch.py). A fetch ends after media_fetch_timeout_s.
    allowed_media_domains: tuple[str, ...] = ()
    media_fetch_timeout_s: float = 10.0
    max_images: int = DEFAULT_MAX_IMAGES  # per prompt (--limit-mm-per-prompt), on every API

    @property
    def harmony(self) -> bool | None:
        """Chat in harmony: True where a parser names it by hand; None: where the model speaks it."""
        return True if HARMONY in (self.tool_call_parser, self.reasoning_parser) else None
