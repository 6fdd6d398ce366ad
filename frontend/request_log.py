"""One structured log line per generation request, gRPC or HTTP, written when it ends
(logfmt: key=value; `code` is the gRPC status name or the HTTP status).

    request_id=abc code=OK finish_reason=length prompt_tokens=12 cached_tokens=0
    completion_tokens=64 ttft_ms=31.2 e2e_ms=880.4 n=1

Times are measured here in the frontend, from the call's arrival. The prompt is logged only
with --log-prompts: prompts may hold what operators must not keep.
"""

from __future__ import annotations

import json
import logging
import time

log = logging.getLogger("pagedserve.requests")


class RequestLog:
    def __init__(self, log_prompts: bool) -> None:
        self.log_prompts = log_prompts
        self.start = time.monotonic()
        self.fields: dict[str, object] = {}

    def write(self, code: str, generation=None, prompt: object = None) -> None:
        """`generation`: the admitted request, if it got that far; `prompt` as the caller sent it."""
        fields = {"request_id": generation.request_id} if generation is not None else {}
        fields.update(self.fields, code=code)
        if generation is not None:
            fields.update(generation.summary())
            if generation.first_token_time is not None:
                fields["ttft_ms"] = round((generation.first_token_time - self.start) * 1000, 1)
        fields["e2e_ms"] = round((time.monotonic() - self.start) * 1000, 1)
        if self.log_prompts and prompt is not None:
            fields["prompt"] = prompt
        log.info(" ".join(f"{k}={_value(v)}" for k, v in fields.items()))


def _value(v: object) -> str:
    text = v if isinstance(v, str) else json.dumps(v) if isinstance(v, (list, dict)) else str(v)
    if text and all(c.isalnum() or c in "._:-/@+=" for c in text):
        return text
    return json.dumps(text, ensure_ascii=False)  # quoted, with escapes: one line, parseable
