"""Images over every API of a real `pagedserve serve` of a tiny random-weight Qwen2.5-VL: the
`openai` SDK (chat image_url data URLs, streamed and not; Responses input_image), the
`anthropic` SDK (base64 image blocks), a gRPC client (image bytes in chat parts), each
greedy answer equal to the offline `LLM.chat`'s on the same conversation. Bad images (broken,
huge, empty, wrong type, too many, URLs that are not allowed, stall or redirect away) get a
4xx / INVALID_ARGUMENT naming the part, never a 5xx, and leave no KV block in use."""

from __future__ import annotations

import base64
import http.server
import io
import socketserver
import struct
import threading
import time
import zlib

import grpc
import httpx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from PIL import Image

from common.v1 import generation_pb2 as gen
from grpc_client import collect
from http_client import kv_free_after  # noqa: F401 - shared fixture
from http_client import anthropic_client, model_name, openai_client, post
from vl_models import IMAGES, build_tiny_qwen2_5_vl, conversation

pytestmark = pytest.mark.heavy(45)

MAX_TOKENS = 6
MAX_IMAGES = 3


def png(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def data_url(image: Image.Image) -> str:
    return "data:image/png;base64," + base64.b64encode(png(image)).decode()


class _Media(http.server.BaseHTTPRequestHandler):
    """/ok: a PNG; /stall: answers too late; /away: redirects to another host; else 404."""

    def do_GET(self):  # noqa: N802 - http.server's name
        if self.path == "/stall":
            time.sleep(3)
        if self.path == "/away":
            self.send_response(302)
            self.send_header("Location", f"http://localhost:{self.server.server_address[1]}/ok")
            self.end_headers()
            return
        if self.path != "/ok":
            self.send_error(404)
            return
        body = png(IMAGES[0])
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def media():
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Media)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.fixture(scope="module")
def folder(tmp_path_factory, bundled_tokenizer):
    """The tiny model, taking images as large as the real ones (Qwen2.5-VL's max_pixels)."""
    import json
    folder = build_tiny_qwen2_5_vl(tmp_path_factory.mktemp("qwen2_5_vl_serve"), bundled_tokenizer)
    config = folder / "preprocessor_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "max_pixels": 12845056}))
    return folder


@pytest.fixture(scope="module")
def frontend(procs, folder):
    engine_address = f"tcp://127.0.0.1:{procs.free_port()}"
    with procs.serving("--model", str(folder), "--dtype", "float32", "--num-kv-blocks", "128",
                       "--num-threads", "1", "--allowed-media-domains", "127.0.0.1",
                       "--media-fetch-timeout-s", "1", "--limit-mm-per-prompt", f"image={MAX_IMAGES}",
                       "--engine-address", engine_address, timeout_s=300) as fe:
        fe.vl_engine_address = engine_address
        yield fe


@pytest.fixture(scope="module")
def expected(folder):
    """The offline LLM's greedy answers: what every API must give (with each prompt's length,
    its images' tokens included)."""
    from pagedserve import LLM, SamplingParams
    llm = LLM(str(folder), dtype="float32", num_kv_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS)
    one, two = llm.chat([conversation("Describe it.", IMAGES[:1]), conversation("Compare.", IMAGES[1:])], params)
    return one.outputs[0].text, two.outputs[0].text, len(two.prompt_token_ids)


def openai_parts(text: str, images: list[Image.Image]) -> list[dict]:
    return [*({"type": "image_url", "image_url": {"url": data_url(im)}} for im in images),
            {"type": "text", "text": text}]


GREEDY = dict(temperature=0, max_tokens=MAX_TOKENS, extra_body={"min_tokens": MAX_TOKENS})


def test_openai_chat_with_data_urls_streamed_and_not(frontend, expected):
    client = openai_client(frontend)
    model = model_name(frontend)
    answer = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": openai_parts("Describe it.", IMAGES[:1])}], **GREEDY)
    assert answer.choices[0].message.content == expected[0]
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": openai_parts("Compare.", IMAGES[1:])}], stream=True,
        stream_options={"include_usage": True}, **GREEDY)
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected[1]
    assert chunks[-1].usage.prompt_tokens == expected[2] > 60  # usage counts every image's tokens


def test_a_1024_pixel_image_crosses_to_the_engine(frontend):
    """25.8 MB of float32 pixels in one AddRequest: within what the engine's socket takes."""
    big = Image.fromarray(np.random.default_rng(5).integers(0, 256, (1024, 1024, 3), dtype=np.uint8))
    answer = openai_client(frontend).chat.completions.create(
        model=model_name(frontend), messages=[{"role": "user", "content": openai_parts("What is it?", [big])}],
        max_tokens=2)
    assert answer.usage.prompt_tokens > 1369  # 74 x 74 patches, merged 2 x 2


def test_openai_responses_input_image(frontend, expected):
    response = openai_client(frontend).responses.create(
        model=model_name(frontend), temperature=0, max_output_tokens=MAX_TOKENS, extra_body={"min_tokens": MAX_TOKENS},
        input=[{"role": "user", "content": [{"type": "input_image", "image_url": data_url(IMAGES[0]), "detail": "auto"},
                                            {"type": "input_text", "text": "Describe it."}]}])
    assert response.output_text == expected[0]


def test_anthropic_base64_image_blocks_streamed_and_not(frontend, expected):
    client = anthropic_client(frontend)
    blocks = [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                           "data": base64.b64encode(png(im)).decode()}} for im in IMAGES[1:]]
    messages = [{"role": "user", "content": [*blocks, {"type": "text", "text": "Compare."}]}]
    kwargs = dict(model=model_name(frontend), max_tokens=MAX_TOKENS, messages=messages,
                  extra_body={"temperature": 0, "min_tokens": MAX_TOKENS})  # not create()'s parameter in this SDK
    assert client.messages.create(**kwargs).content[0].text == expected[1]
    with client.messages.stream(**kwargs) as stream:
        assert "".join(stream.text_stream) == expected[1]


def test_grpc_image_bytes_in_chat_parts(frontend, expected):
    message = gen.ChatMessage(role="user", parts=[gen.ContentPart(image=gen.ImageData(data=png(IMAGES[0]))),
                                                  gen.ContentPart(text="Describe it.")])
    request = gen.GenerateRequest(chat=gen.Chat(messages=[message]), sampling=gen.SamplingParams(
        temperature=0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS))
    assert collect(list(frontend.generation.Generate(request, timeout=60))).texts[0] == expected[0]


def test_a_fetched_image_url_is_the_same_image(frontend, media, expected):
    answer = openai_client(frontend).chat.completions.create(
        model=model_name(frontend), messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": f"{media}/ok"}}, {"type": "text", "text": "Describe it."}]}],
        **GREEDY)
    assert answer.choices[0].message.content == expected[0]


def _huge_png() -> bytes:
    """A valid PNG header that claims 100,000 x 100,000 pixels (its data is never read)."""
    header = struct.pack(">IIBBBBB", 100_000, 100_000, 8, 2, 0, 0, 0)
    chunk = b"IHDR" + header
    return b"\x89PNG\r\n\x1a\n" + struct.pack(">I", len(header)) + chunk + struct.pack(">I", zlib.crc32(chunk))


BAD_URLS = {
    "truncated": "data:image/png;base64," + base64.b64encode(png(IMAGES[0])[:200]).decode(),
    "huge": "data:image/png;base64," + base64.b64encode(_huge_png()).decode(),
    "empty": "data:image/png;base64,",
    "not base64": "data:image/png;base64,%%%",
    "wrong type": "data:text/plain;base64," + base64.b64encode(b"hello").decode(),
    "not an image": "data:image/png;base64," + base64.b64encode(b"GIF89a but not really").decode(),
    "host not allowed": "http://example.com/cat.png",
    "stalls": "{media}/stall",
    "redirects away": "{media}/away",
    "missing": "{media}/nothing-here-404",
    "ftp": "ftp://127.0.0.1/cat.png",
}


@pytest.mark.parametrize("case", list(BAD_URLS))
def test_bad_images_get_a_400_naming_the_part(frontend, media, case):
    url = BAD_URLS[case].format(media=media)
    body = {"model": model_name(frontend), "max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "Look:"}, {"type": "image_url", "image_url": {"url": url}}]}]}
    r = post(frontend, "/v1/chat/completions", body)
    assert r.status_code == 400, r.text
    assert "messages[0].content[1].image_url" in r.json()["error"]["message"]


def _with_header(data: bytes, kind: str) -> bytes:
    """Random bytes behind a real format's signature, so the decoder gets past its first check."""
    return {"png": b"\x89PNG\r\n\x1a\n", "jpeg": b"\xff\xd8\xff\xe0", "gif": b"GIF89a", "raw": b""}[kind] + data


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.binary(max_size=300), kind=st.sampled_from(["png", "jpeg", "gif", "raw"]),
       mime=st.sampled_from(["image/png", "image/jpeg", "image/gif", "image/webp", "text/html", "", "image/svg+xml"]),
       api=st.sampled_from(["openai", "anthropic", "grpc"]))
def test_fuzzed_image_bytes_get_4xx_never_5xx(frontend, data, kind, mime, api):
    raw = _with_header(data, kind)
    b64 = base64.b64encode(raw).decode()
    model = model_name(frontend)
    if api == "grpc":
        message = gen.ChatMessage(role="user", parts=[gen.ContentPart(image=gen.ImageData(data=raw))])
        with pytest.raises(grpc.RpcError) as e:
            list(frontend.generation.Generate(gen.GenerateRequest(chat=gen.Chat(messages=[message])), timeout=30))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        return
    if api == "openai":
        part = {"type": "image_url", "image_url": {"url": f"data:{mime};base64,{b64}"}}
        r = post(frontend, "/v1/chat/completions", {"model": model, "max_tokens": 1,
                                                     "messages": [{"role": "user", "content": [part]}]})
    else:
        block = {"type": "image", "source": {"type": "base64", "media_type": mime, "data": b64}}
        r = post(frontend, "/v1/messages", {"model": model, "max_tokens": 1,
                                            "messages": [{"role": "user", "content": [block]}]})
    assert r.status_code == 400, r.text


def test_too_many_images_and_misplaced_images_are_refused(frontend):
    model = model_name(frontend)
    many = {"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": openai_parts(
        "All of them.", [IMAGES[0]] * (MAX_IMAGES + 1))}]}
    r = post(frontend, "/v1/chat/completions", many)
    assert r.status_code == 400 and "--limit-mm-per-prompt" in r.json()["error"]["message"]
    assistant = {"model": model, "max_tokens": 2, "messages": [
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": openai_parts("Mine", IMAGES[:1])}]}
    assert post(frontend, "/v1/chat/completions", assistant).status_code == 400
    message = gen.ChatMessage(role="user", parts=[gen.ContentPart(image=gen.ImageData(data=b"\x89PNG broken"))])
    with pytest.raises(grpc.RpcError) as e:
        list(frontend.generation.Generate(gen.GenerateRequest(chat=gen.Chat(messages=[message])), timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "parts[0].image" in e.value.details()


def test_a_repeated_image_is_served_from_the_prefix_cache(frontend):
    client = openai_client(frontend)
    model = model_name(frontend)
    ask = [{"role": "user", "content": openai_parts("What is in the picture?", IMAGES[2:])}]
    client.chat.completions.create(model=model, messages=ask, max_tokens=1)
    again = client.chat.completions.create(model=model, messages=ask, max_tokens=1)
    assert again.usage.prompt_tokens_details.cached_tokens >= 48
    assert httpx.get(f"{frontend.http_url}/health", timeout=10).status_code == 200


def test_the_frontend_preprocesses_images_without_torch(frontend, procs, tmp_path, expected):
    """A second frontend on the same engine, its modules recorded (test_frontend_light's hook):
    it decodes, preprocesses and expands an image with transformers' numpy paths, no torch."""
    import json
    import os
    import signal
    import subprocess
    import sys

    from test_frontend_light import HEAVY, RECORD_MODULES, ROOT
    modules_file = tmp_path / "modules.json"
    proc = subprocess.Popen(
        [sys.executable, "-c", RECORD_MODULES, str(modules_file), "frontend", "--engine-address",
         frontend.vl_engine_address, "--grpc-port", "0", "--http-port", "0"], cwd=ROOT, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    light = procs.Frontend(proc, *procs.read_addresses(proc))
    try:
        light.wait_serving()
        answer = openai_client(light).chat.completions.create(
            model=model_name(light), messages=[{"role": "user", "content": openai_parts("Describe it.", IMAGES[:1])}],
            **GREEDY)
        assert answer.choices[0].message.content == expected[0]
    finally:
        light.channel.close()
        code = procs.stop(proc, signal.SIGTERM)
    assert code == 0, procs.log_tail(proc)
    modules = set(json.loads(modules_file.read_text()))
    assert "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl" in modules
    assert [m for m in modules if any(m == h or m.startswith(h + ".") for h in HEAVY)] == []
