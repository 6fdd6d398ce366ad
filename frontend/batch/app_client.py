"""A batch's client of the frontend's own HTTP app: httpx over its ASGI transport (in-process,
no network hop), which can leave as a network client leaves.

Leaving is how a batch stops (cancelled, or the run interrupted): from then on the app's
`receive` says the client disconnected, so each route in flight aborts its generation in the
engine (unless_disconnected) and the app logs a 499, exactly as for a client that hung up.
Cancelling the lines' tasks instead would end them in the middle of the app, logged as 500s.
"""

from __future__ import annotations

import asyncio

import httpx
from starlette.types import ASGIApp, Message, Receive, Scope, Send

LEFT_STATUS = 499  # nginx's "client closed request", as the app logs it
_DISCONNECT: Message = {"type": "http.disconnect"}


class AppClient:
    def __init__(self, app: ASGIApp, headers: dict[str, str]) -> None:
        self.left = asyncio.Event()
        # raise_app_exceptions=False: a bug in a route is that line's 500, not the batch's end.
        transport = httpx.ASGITransport(self._leavable(app), raise_app_exceptions=False)
        self.http = httpx.AsyncClient(transport=transport, base_url="http://batch", headers=headers, timeout=None)

    async def post(self, url: str, body: bytes) -> httpx.Response:
        return await self.http.post(url, content=body)

    def leave(self) -> None:
        self.left.set()

    async def aclose(self) -> None:
        await self.http.aclose()

    def _leavable(self, app: ASGIApp) -> ASGIApp:
        left = self.left

        async def leavable(scope: Scope, receive: Receive, send: Send) -> None:
            started = False

            async def receive_unless_left() -> Message:
                if left.is_set():
                    return _DISCONNECT
                message, leaving = asyncio.ensure_future(receive()), asyncio.ensure_future(left.wait())
                try:
                    await asyncio.wait((message, leaving), return_when=asyncio.FIRST_COMPLETED)
                finally:
                    message.cancel()  # (no-op for the one that is done)
                    leaving.cancel()
                return message.result() if message.done() and not message.cancelled() else _DISCONNECT

            async def send_watched(message: Message) -> None:
                nonlocal started
                started = started or message["type"] == "http.response.start"
                await send(message)

            await app(scope, receive_unless_left, send_watched)
            if not started:  # the route gave up on us, as on any client that left; the transport wants an answer
                await send({"type": "http.response.start", "status": LEFT_STATUS, "headers": []})
                await send({"type": "http.response.body", "body": b""})

        return leavable
