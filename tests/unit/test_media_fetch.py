"""frontend/multimodal/fetch.py against a real HTTP server on this machine: what is fetched
(an allowed host, same-host redirects), and every way a fetch is refused, each an
InvalidRequest naming the part: a host not allowed (before any connection), another host
after a redirect, a stall, too many bytes (declared or not), a lying Content-Length, a 404."""

from __future__ import annotations

import asyncio
import io
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from PIL import Image

from common.errors import InvalidRequest
from frontend.multimodal.fetch import MAX_REDIRECTS, MediaFetcher
from frontend.multimodal.images import ImageLimits
from frontend.multimodal.parts import ImageRef

PART = "messages[0].content[1].image_url"
LIMIT = 4096


def png(size: tuple[int, int] = (12, 8)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, (200, 30, 60)).save(buffer, "PNG")
    return buffer.getvalue()


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: Server

    def do_GET(self):
        self.server.paths.append(self.path)
        route = self.path.split("?")[0]
        if route == "/cat.png":
            self._send(200, png())
        elif route == "/stall":
            self.server.release.wait(5)
        elif route.startswith("/hop/"):  # /hop/N redirects N times, then to the image
            left = int(route.rsplit("/", 1)[1])
            self._redirect(f"/hop/{left - 1}" if left > 1 else "/cat.png")
        elif route == "/elsewhere":
            self._redirect(f"http://localhost:{self.server.server_port}/cat.png")
        elif route == "/big":  # declares its size, over the limit
            self._send(200, b"\0" * (LIMIT + 1))
        elif route == "/undeclared":  # no Content-Length: the body ends when the connection does
            self.send_response(200)
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(png() + b"\0" * (2 * LIMIT))
            self.close_connection = True
        elif route == "/lie":  # says 20 bytes, sends the whole image
            self.send_response(200)
            self.send_header("Content-Length", "20")
            self.end_headers()
            self.wfile.write(png())
        elif route == "/short":  # says more than it sends, then hangs up
            self.send_response(200)
            self.send_header("Content-Length", str(LIMIT))
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(png()[:50])
            self.close_connection = True
        else:
            self._send(404, b"no such thing")

    def _send(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _redirect(self, location: str) -> None:
        self.send_response(302)
        self.send_header("Location", location)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


class Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.paths: list[str] = []
        self.release = threading.Event()  # lets a stalled handler go

    def handle_error(self, request, client_address) -> None:
        pass  # a client that gave up (the stall, the limits) is expected here


@pytest.fixture(scope="module")
def server():
    s = Server()
    thread = threading.Thread(target=s.serve_forever, daemon=True)
    thread.start()
    yield s
    s.release.set()
    s.shutdown()
    s.server_close()


def url(server: Server, path: str, host: str = "127.0.0.1") -> str:
    return f"http://{host}:{server.server_port}{path}"


def fetcher(domains=("127.0.0.1",), timeout_s: float = 0.5) -> MediaFetcher:
    return MediaFetcher(frozenset(domains), timeout_s, ImageLimits(max_bytes=LIMIT))


def refused(server: Server, path: str, match: str, **kwargs) -> str:
    with pytest.raises(InvalidRequest, match=match) as error:
        asyncio.run(fetcher(**kwargs).fetch(url(server, path), PART))
    assert str(error.value).startswith(f"{PART}: ")
    return str(error.value)


def test_an_allowed_host_is_fetched_and_decoded(server):
    image = asyncio.run(fetcher().load(ImageRef(PART, url=url(server, "/cat.png"))))
    assert image.format == "PNG" and image.size == (12, 8)
    assert image.getpixel((3, 3)) == (200, 30, 60)  # the pixels are loaded


def test_no_flag_refuses_every_url_without_connecting(server):
    before = len(server.paths)
    message = refused(server, "/cat.png", "fetches no image URLs", domains=())
    assert "data URL" in message and "--allowed-media-domains 127.0.0.1" in message
    refused(server, "/cat.png", "not fetched from 127.0.0.1", domains=("localhost", "example.com"))
    assert len(server.paths) == before  # nothing was sent


def test_hosts_match_exactly(server):
    with pytest.raises(InvalidRequest, match="not fetched from localhost"):
        asyncio.run(fetcher().fetch(url(server, "/cat.png", host="localhost"), PART))
    for bad in ("ftp://127.0.0.1/cat.png", "http:///cat.png", "http://[::1/x"):
        with pytest.raises(InvalidRequest, match="not a valid http"):
            asyncio.run(fetcher().fetch(bad, PART))


def test_redirects_are_followed_on_the_same_host_only(server):
    assert asyncio.run(fetcher().fetch(url(server, "/hop/2"), PART)) == png()
    refused(server, "/elsewhere", r"redirects to another host \(localhost\)")
    refused(server, f"/hop/{MAX_REDIRECTS + 1}", f"more than {MAX_REDIRECTS} times")


def test_a_stall_times_out(server):
    message = refused(server, "/stall", r"took more than 0.5 s \(--media-fetch-timeout-s\)")
    assert "127.0.0.1" in message


def test_too_many_bytes_are_refused_declared_or_not(server):
    refused(server, "/big", f"over {LIMIT:,} bytes")
    refused(server, "/undeclared", f"over {LIMIT:,} bytes")


def test_a_lying_content_length_never_yields_an_image(server):
    with pytest.raises(InvalidRequest, match="broken|not an image") as error:  # 20 bytes of a PNG
        asyncio.run(fetcher().load(ImageRef(PART, url=url(server, "/lie"))))
    assert str(error.value).startswith(PART)
    refused(server, "/short", "could not fetch the image from 127.0.0.1")


def test_an_http_error_names_the_status(server):
    refused(server, "/missing.png", "got HTTP 404 Not Found")


def test_a_closed_port_is_a_bad_request():
    with pytest.raises(InvalidRequest, match="could not fetch the image from 127.0.0.1"):
        asyncio.run(fetcher().fetch("http://127.0.0.1:9/cat.png", PART))


def test_the_flags_reach_the_http_context():
    import argparse

    from frontend.http.context import HttpContext
    from frontend.main import http_options_from_args
    from pagedserve.serve import add_arguments, engine_command

    argv = ["--allowed-media-domains", "img.example.com", "cdn.example.com", "--media-fetch-timeout-s", "2.5",
            "--max-num-seqs", "8"]
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(argv)
    ctx = HttpContext(None, None, options=http_options_from_args(args))
    assert ctx.media.allowed_domains == {"img.example.com", "cdn.example.com"} and ctx.media.timeout_s == 2.5
    cmd = engine_command(args, argv, "tcp://127.0.0.1:6000")  # the frontend's flags stay with the frontend
    assert not {"--allowed-media-domains", "--media-fetch-timeout-s", "img.example.com"} & set(cmd)
    assert cmd[cmd.index("--max-num-seqs") + 1] == "8"
    default = parser.parse_args([])
    assert HttpContext(None, None, options=http_options_from_args(default)).media.allowed_domains == frozenset()
