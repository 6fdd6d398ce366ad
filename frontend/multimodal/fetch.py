"""Images by http(s) URL (an OpenAI image_url, an Anthropic url source, a Responses
input_image), fetched for the HTTP API within what the operator allowed:

    --allowed-media-domains HOST ...   the hosts fetched from, matched exactly; none (the
                                       default): no URL is fetched, only data URLs are taken
    --media-fetch-timeout-s S          the whole fetch, redirects and body included

A fetch reads at most ImageLimits.max_bytes, counted as the body arrives (whatever its
Content-Length says), and follows at most MAX_REDIRECTS redirects, each to the same host.
Every failure is an InvalidRequest (400) naming the part: a server never errs because a
client named a bad URL.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx
from PIL import Image

from common.errors import InvalidRequest
from frontend.multimodal import images
from frontend.multimodal.images import ImageLimits
from frontend.multimodal.parts import ImageRef, decode

MAX_REDIRECTS = 3
DEFAULT_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class MediaFetcher:
    """Loads a request's images: fetched (http(s) URLs) or not, then decoded off the event loop."""

    allowed_domains: frozenset[str] = frozenset()
    timeout_s: float = DEFAULT_TIMEOUT_S
    limits: ImageLimits = field(default_factory=ImageLimits)

    def __post_init__(self) -> None:
        object.__setattr__(self, "allowed_domains", frozenset(d.lower() for d in self.allowed_domains))
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s: must be > 0, got {self.timeout_s}")

    async def load(self, ref: ImageRef) -> Image.Image:
        """The image `ref` names, decoded in a worker thread (a large one takes a while)."""
        if ref.remote:
            data = await self.fetch(ref.url, ref.part)
            return await asyncio.to_thread(images.from_bytes, data, ref.part, self.limits)
        return await asyncio.to_thread(decode, ref, self.limits)

    async def fetch(self, url: str, part: str) -> bytes:
        """The body at `url`, or an InvalidRequest naming `part` (nothing is sent to a host not allowed)."""
        host = self._allowed_host(url, part)
        try:
            async with asyncio.timeout(self.timeout_s):
                return await self._get(url.strip(), host, part)
        except (TimeoutError, httpx.TimeoutException):
            raise InvalidRequest(f"{part}: fetching the image from {host} took more than "
                                 f"{self.timeout_s:g} s (--media-fetch-timeout-s)") from None
        except (httpx.HTTPError, httpx.InvalidURL) as e:
            raise InvalidRequest(f"{part}: could not fetch the image from {host}: "
                                 f"{str(e) or type(e).__name__}") from None

    def _allowed_host(self, url: str, part: str) -> str:
        host = _host(url)
        if host is None:
            raise InvalidRequest(f"{part}: not a valid http(s) URL")
        if not self.allowed_domains:
            raise InvalidRequest(f"{part}: this server fetches no image URLs; send the image in a data URL "
                                 "(data:image/png;base64,...), or start the server with "
                                 f"--allowed-media-domains {host}")
        if host not in self.allowed_domains:
            raise InvalidRequest(f"{part}: images are not fetched from {host}; the server takes URLs on "
                                 f"{', '.join(sorted(self.allowed_domains))} (--allowed-media-domains)")
        return host

    async def _get(self, url: str, host: str, part: str) -> bytes:
        headers = {"Accept": "image/*", "Accept-Encoding": "identity"}  # no compression bomb to inflate
        async with httpx.AsyncClient(follow_redirects=False, timeout=self.timeout_s, headers=headers) as client:
            for _ in range(MAX_REDIRECTS + 1):
                async with client.stream("GET", url) as response:
                    if response.is_redirect:
                        url = str(response.url.join(response.headers["location"]))
                        target = _host(url)
                        if target != host:
                            raise InvalidRequest(f"{part}: the image URL redirects to another host ({target or url}); "
                                                 f"redirects are followed on {host} only")
                        continue
                    if not response.is_success:
                        raise InvalidRequest(f"{part}: fetching the image from {host} got HTTP "
                                             f"{response.status_code} {response.reason_phrase}".rstrip())
                    return await self._body(response, part)
        raise InvalidRequest(f"{part}: the image URL redirects more than {MAX_REDIRECTS} times")

    async def _body(self, response: httpx.Response, part: str) -> bytes:
        limit = self.limits.max_bytes
        length = response.headers.get("content-length", "")
        if length.isdigit() and int(length) > limit:
            raise InvalidRequest(f"{part}: the image is over {limit:,} bytes ({int(length):,})")
        chunks, size = [], 0
        async for chunk in response.aiter_bytes():
            size += len(chunk)
            if size > limit:  # the header said less, or nothing
                raise InvalidRequest(f"{part}: the image is over {limit:,} bytes")
            chunks.append(chunk)
        return b"".join(chunks)


def _host(url: str) -> str | None:
    """An http(s) URL's host, lower case; None if it is not one."""
    try:
        split = urlsplit(url.strip())
        host = split.hostname
    except ValueError:
        return None
    return host if split.scheme.lower() in ("http", "https") and host else None
