"""HTTP errors: the one mapping of the frontend's typed errors to status codes and bodies.

    InvalidRequest, a bad body      400  invalid_request_error
    missing or wrong API key        401  authentication_error
    unknown model, adapter or route 404  not_found_error (NotFound)
    admin route not allowed         403  permission_error
    EngineOverloaded                429  rate_limit_error (+ Retry-After)
    Unavailable (no engine, drain,  503  service_unavailable_error (+ Retry-After)
      asleep)
    RequestFailed                   500  internal_error, with its message (the engine's fault)
    the client left mid-body        499  (logged only: nginx's "client closed request")
    anything else (a bug)           500  internal_error, a generic message; the trace goes to the log

OpenAI's body is {"error": {"message", "type", "param", "code"}}; Anthropic's routes add its
{"type": "error"} wrapper around the same object, so either SDK reads it.
"""

from __future__ import annotations

import logging
import re

from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.requests import ClientDisconnect

from common.errors import EngineOverloaded, InvalidRequest, RequestFailed, Unavailable
from frontend.input_processor import NotFound

log = logging.getLogger("pagedserve.http")
RETRY_AFTER_S = 1
_FIELD = re.compile(r"^([A-Za-z_][\w.\[\]]*): ")


class HTTPError(Exception):
    def __init__(self, status: int, message: str, type_: str, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self, anthropic: bool = False) -> dict:
        error = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        return {"type": "error", "error": error} if anthropic else {"error": error}

    def response(self, anthropic: bool = False) -> JSONResponse:
        # A retry may succeed later: the queue drains, an engine connects or wakes up.
        headers = {"Retry-After": str(RETRY_AFTER_S)} if self.status in (429, 503) else None
        return JSONResponse(self.body(anthropic), status_code=self.status, headers=headers)


def bad_request(message: str, param: str | None = None) -> HTTPError:
    match = _FIELD.match(message)
    return HTTPError(400, message, "invalid_request_error", param or (match.group(1) if match else None))


def not_found(message: str, param: str | None = None) -> HTTPError:
    return HTTPError(404, message, "not_found_error", param, "model_not_found" if param == "model" else None)


def from_exception(e: BaseException) -> HTTPError:
    """The HTTPError an exception means; unknown ones are logged with their trace."""
    if isinstance(e, HTTPError):
        return e
    if isinstance(e, NotFound):
        return not_found(str(e), e.param)
    if isinstance(e, InvalidRequest):
        return bad_request(str(e))
    if isinstance(e, ValidationError):
        return bad_request(*_validation_message(e))
    if isinstance(e, EngineOverloaded):
        return HTTPError(429, str(e), "rate_limit_error")
    if isinstance(e, Unavailable):
        return HTTPError(503, str(e), "service_unavailable_error")
    if isinstance(e, RequestFailed):
        log.warning("request failed: %s", e)
        return HTTPError(500, str(e), "internal_error")
    if isinstance(e, ClientDisconnect):  # it left while we read its body: no one to answer
        return HTTPError(499, "client closed the request", "client_closed_request")
    log.error("internal error", exc_info=e)
    return HTTPError(500, "internal error; see the server log", "internal_error")


def _validation_message(e: ValidationError) -> tuple[str, str]:
    first = e.errors()[0]
    field = ".".join(str(p) for p in first["loc"]) or "body"
    return f"{field}: {first['msg']}", field
