"""Image parts on every API, down to the one normalized form (frontend/multimodal/parts.py):
OpenAI chat, Anthropic messages, Responses items, gRPC's ChatMessage, the offline LLM's
messages, and a run-batch line through the real app. Text-only messages come out exactly as
before; every bad part is an InvalidRequest naming it."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import random
import struct
import zlib
from types import SimpleNamespace

import httpx
import pytest
from PIL import Image
from prometheus_client import CollectorRegistry
from pydantic import ValidationError

from common.errors import InvalidRequest
from common.v1 import generation_pb2 as gen
from common.validation import PromptLimits
from frontend import servicers
from frontend.batch.runner import BatchRunner
from frontend.http import anthropic_api, openai_api
from frontend.http.app import build_app
from frontend.http.context import HttpContext
from frontend.http.options import HttpOptions
from frontend.http.protocol import AnthropicMessage, ChatCompletionRequest, ChatMessage
from frontend.http.responses import items
from frontend.input_processor import InputProcessor
from frontend.metrics import FrontendMetrics
from frontend.multimodal import parts
from frontend.multimodal.fetch import MediaFetcher
from frontend.multimodal.images import ImageLimits

CTX = SimpleNamespace(media=MediaFetcher())
METRICS = FrontendMetrics(CollectorRegistry())


def png(size: tuple[int, int] = (6, 4), color=(10, 20, 30)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, "PNG")
    return buffer.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def data_url(data: bytes | None = None, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{b64(png() if data is None else data)}"


def png_header(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height, and no pixels."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", b""))


def truncated() -> bytes:
    buffer = io.BytesIO()
    Image.frombytes("L", (8, 8), random.Random(0).randbytes(64)).save(buffer, "PNG")
    return buffer.getvalue()[:-40]  # into its pixels


# Bad image files, each with what its error says (after the part's name).
BAD_FILES = [
    (truncated(), "broken|not an image"),
    (png_header(0, 0), "empty|not an image"),  # zero-size
    (png_header(100_000, 100_000), "pixels"),  # a huge header, refused before decoding
    (b"GIF89a" + b"\0" * 3, "not an image"),
    (b"", "not an image"),
]


def assert_image(part: dict, size=(6, 4), color=(10, 20, 30)) -> None:
    assert part["type"] == "image" and isinstance(part["image"], Image.Image)
    assert part["image"].size == size and part["image"].convert("RGB").getpixel((0, 0)) == color


def refused(convert, where: str, match: str | None = None) -> str:
    with pytest.raises(InvalidRequest, match=match) as error:
        convert()
    assert str(error.value).startswith(f"{where}: "), str(error.value)
    return str(error.value)


# -- the shared helpers -----------------------------------------------------------------------------

def test_collapse_and_count():
    text = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert parts.collapse(text) == "ab" and parts.collapse([]) == ""
    image = {"type": "image", "image": Image.new("RGB", (1, 1))}
    assert parts.collapse([*text, image]) == [*text, image]
    messages = [{"role": "user", "content": "x"}, {"role": "user", "content": [image, *text, image]}]
    assert parts.count_images(messages) == 2


def test_load_images_loads_all_concurrently_and_cancels_the_rest_on_a_failure():
    started, cancelled = [], []

    async def load(ref: parts.ImageRef):
        started.append(ref.part)
        if ref.part == "bad":
            raise InvalidRequest("bad: no")
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            cancelled.append(ref.part)
            raise

    def image(part: str) -> dict:
        return {"type": "image", "image": parts.ImageRef(part, url="x")}

    messages = [{"role": "user", "content": [image("a"), image("bad")]}, {"role": "user", "content": [image("c")]}]

    async def run():
        with pytest.raises(InvalidRequest, match="bad: no"):
            await asyncio.wait_for(parts.load_images(messages, load), 5)
        await asyncio.sleep(0)

    asyncio.run(run())
    assert started == ["a", "bad", "c"] and sorted(cancelled) == ["a", "c"]


# -- OpenAI chat ----------------------------------------------------------------------------------

def openai(*messages: dict) -> list[dict]:
    body = ChatCompletionRequest.model_validate({"messages": list(messages)})
    return asyncio.run(openai_api.chat_messages(CTX, body.messages))


def test_openai_text_only_is_as_before():
    got = openai({"role": "system", "content": "Be brief."}, {"role": "user", "content": [
        {"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]}, {"role": "assistant", "content": None},
        {"role": "user", "content": [], "name": "bob"})
    assert got == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
                   {"role": "assistant", "content": ""}, {"name": "bob", "role": "user", "content": ""}]


def test_openai_image_parts_in_order_both_forms():
    [message] = openai({"role": "user", "content": [
        {"type": "text", "text": "Compare"}, {"type": "image_url", "image_url": {"url": data_url(), "detail": "low"}},
        {"type": "text", "text": "with"}, {"type": "image_url", "image_url": data_url(png((3, 5), (1, 2, 3)))}]})
    first, image, middle, legacy = message["content"]
    assert first == {"type": "text", "text": "Compare"} and middle == {"type": "text", "text": "with"}
    assert_image(image)
    assert_image(legacy, (3, 5), (1, 2, 3))


@pytest.mark.parametrize("url,match", [
    ("data:image/png;base64,not base64!", "not valid base64"),
    (data_url(mime="text/plain"), "media type 'text/plain'"),
    ("ftp://example.com/cat.png", "not an image URL"),
    ("https://example.com/cat.png", "--allowed-media-domains example.com"),
    *[(data_url(data), match) for data, match in BAD_FILES],
])
def test_openai_bad_image_parts_are_named(url, match):
    content = [{"type": "text", "text": "Look:"}, {"type": "image_url", "image_url": {"url": url}}]
    refused(lambda: openai({"role": "user", "content": content}), "messages[0].content[1].image_url.url", match)
    content[1]["image_url"] = url  # the legacy form
    refused(lambda: openai({"role": "user", "content": content}), "messages[0].content[1].image_url", match)


def test_openai_refusals_by_the_schema_or_the_role():
    image = {"type": "image_url", "image_url": {"url": data_url()}}
    refused(lambda: openai({"role": "assistant", "content": [image]}), "messages[0].content", "user messages only")
    refused(lambda: openai({"role": "user", "content": [{"type": "image_url", "image_url": " "}]}),
            "messages[0].content[0].image_url", "data URL")
    for part in ({"type": "image_url", "image_url": {"url": data_url(), "detail": "ultra"}},
                 {"type": "input_audio", "input_audio": {}}):
        with pytest.raises(ValidationError):
            ChatMessage.model_validate({"role": "user", "content": [part]})


# -- Anthropic messages ---------------------------------------------------------------------------

def anthropic(message: dict, i: int = 0) -> list[dict]:
    messages = anthropic_api._chat_messages(AnthropicMessage.model_validate(message), i)
    return asyncio.run(parts.load_images(messages, CTX.media.load))


def test_anthropic_text_only_is_as_before():
    assert anthropic({"role": "user", "content": "Hi"}) == [{"role": "user", "content": "Hi"}]
    got = anthropic({"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "42"}]},
        {"type": "text", "text": "So?"}]})
    assert got == [{"role": "tool", "tool_call_id": "t1", "content": "42"}, {"role": "user", "content": "So?"}]


def test_anthropic_base64_images_in_order():
    [message] = anthropic({"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64(png())}},
        {"type": "text", "text": "What is it?", "cache_control": {"type": "ephemeral"}}]})
    image, text = message["content"]
    assert_image(image)
    assert text == {"type": "text", "text": "What is it?"}


@pytest.mark.parametrize("source,where,match", [
    ({"type": "base64", "media_type": "image/png", "data": "%%%"}, "source.data", "not valid base64"),
    ({"type": "base64", "media_type": "image/jpeg", "data": b64(truncated())}, "source.data", "broken|not an image"),
    ({"type": "base64", "media_type": "image/png", "data": b64(png_header(100_000, 100_000))}, "source.data",
     "pixels"),
    ({"type": "url", "url": "https://example.com/a.png"}, "source.url", "fetches no image URLs"),
    ({"type": "file", "file_id": "file_1"}, "source", "not supported"),
])
def test_anthropic_bad_images_are_named(source, where, match):
    message = {"role": "user", "content": [{"type": "text", "text": "See"}, {"type": "image", "source": source}]}
    refused(lambda: anthropic(message, 2), f"messages[2].content[1].{where}", match)


def test_anthropic_refusals():
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64(png())}}
    refused(lambda: anthropic({"role": "assistant", "content": [image]}), "messages[0].content", "user messages only")
    result = {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "text", "text": "x"}, image]}
    refused(lambda: anthropic({"role": "user", "content": [result]}), "messages[0].content[0].content[1]",
            "tool_result")
    with pytest.raises(ValidationError, match="media_type"):  # the API's enum, as Anthropic checks it
        AnthropicMessage.model_validate({"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "text/plain", "data": b64(png())}}]})


# -- Responses ------------------------------------------------------------------------------------

def responses(content, role: str = "user") -> list[dict]:
    parsed = items.parse_input([{"role": role, "content": content}], [])
    return items.chat_messages(asyncio.run(items.load_item_images(parsed, CTX.media.load)), "Be brief.")


def test_responses_input_image_in_order_and_text_unchanged():
    assert responses([{"type": "input_text", "text": "Hi"}]) == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    _, message = responses([{"type": "input_text", "text": "What"},
                            {"type": "input_image", "image_url": data_url(), "detail": "auto"}])
    text, image = message["content"]
    assert text == {"type": "text", "text": "What"}
    assert_image(image)


def test_responses_items_keep_loaded_images():
    [item] = items.parse_input([{"role": "user", "content": [{"type": "input_image", "image_url": data_url()}]}],
                               [])
    assert isinstance(item, items.Message) and isinstance(item.parts[0]["image"], parts.ImageRef)
    [loaded] = asyncio.run(items.load_item_images([item], CTX.media.load))
    assert isinstance(loaded.parts[0]["image"], Image.Image) and loaded.text == ""
    assert asyncio.run(items.load_item_images([loaded], CTX.media.load)) == [loaded]  # nothing left to load


@pytest.mark.parametrize("part,where,match", [
    ({"type": "input_image", "file_id": "file_1", "detail": "auto"}, "input[0].content[1].file_id", "not supported"),
    ({"type": "input_image", "image_url": data_url(), "detail": "huge"}, "input[0].content[1].detail", "one of"),
    ({"type": "input_image"}, "input[0].content[1].image_url", "data URL"),
    ({"type": "input_image", "image_url": data_url(truncated())}, "input[0].content[1].image_url", "broken|not an"),
    ({"type": "input_image", "image_url": "data:image/png;base64,@@"}, "input[0].content[1].image_url", "base64"),
])
def test_responses_bad_images_are_named(part, where, match):
    refused(lambda: responses([{"type": "input_text", "text": "See"}, part]), where, match)


def test_responses_refusals():
    image = {"type": "input_image", "image_url": data_url()}
    refused(lambda: responses([image], "system"), "input[0].content", "user messages only")
    message = refused(lambda: responses([image, {"type": "input_file", "file_id": "f"}]), "input[0].content[1].type")
    assert "input_image" in message
    refused(lambda: items.parse_input([{"type": "function_call_output", "call_id": "c", "output": [image]}],
                                      [items.Message("user", "x")]), "input[0].output[0].type", "text only")


# -- gRPC -----------------------------------------------------------------------------------------

def test_grpc_content_as_before_and_parts_normalized():
    chat = gen.Chat(messages=[
        gen.ChatMessage(role="system", content="Be brief."),
        gen.ChatMessage(role="user", parts=[gen.ContentPart(text="What is "),
                                           gen.ContentPart(image=gen.ImageData(data=png()))]),
        gen.ChatMessage(role="user", parts=[gen.ContentPart(text="a"), gen.ContentPart(text="b")])])
    system, user, text_only = servicers.chat_messages(chat)
    assert system == {"role": "system", "content": "Be brief."} and text_only == {"role": "user", "content": "ab"}
    assert user["content"][0] == {"type": "text", "text": "What is "}
    assert_image(user["content"][1])
    # the request log shows the image's size, not its bytes
    logged = servicers._prompt_for_log(gen.GenerateRequest(chat=chat))
    assert logged[1] == {"role": "user", "content": ["What is ", f"<image: {len(png())} bytes>"]}


@pytest.mark.parametrize("data,match", BAD_FILES)
def test_grpc_bad_image_bytes_are_named(data, match):
    chat = gen.Chat(messages=[gen.ChatMessage(role="user", parts=[
        gen.ContentPart(text="x"), gen.ContentPart(image=gen.ImageData(data=data))])])
    refused(lambda: servicers.chat_messages(chat), "chat.messages[0].parts[1].image", match)


def test_grpc_refusals():
    image = gen.ContentPart(image=gen.ImageData(data=png()))
    cases = [(gen.ChatMessage(role="user", content="x", parts=[image]), "chat.messages[0].content", "must be empty"),
             (gen.ChatMessage(role="user", parts=[gen.ContentPart()]), "chat.messages[0].parts[0]", "text or image"),
             (gen.ChatMessage(role="assistant", parts=[image]), "chat.messages[0].parts", "user messages only")]
    for message, where, match in cases:
        refused(lambda m=message: servicers.chat_messages(gen.Chat(messages=[m])), where, match)


def test_grpc_text_chat_prompt_is_as_before_and_images_reach_the_processor(bundled_tokenizer):
    processor = InputProcessor(bundled_tokenizer, PromptLimits(bundled_tokenizer.vocab_size, 2048, 128, 16))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    chat = gen.Chat(messages=[gen.ChatMessage(role=m["role"], content=m["content"]) for m in messages])
    assert servicers.prompt_from_request(processor, gen.GenerateRequest(chat=chat)) == (
        processor.tokenize_chat(messages), [])
    chat.messages[1].content = ""
    chat.messages[1].parts.extend([gen.ContentPart(text="Hi"), gen.ContentPart(image=gen.ImageData(data=png()))])
    with pytest.raises(InvalidRequest, match="text only"):  # decoded, then refused by this text-only model
        servicers.prompt_from_request(processor, gen.GenerateRequest(chat=chat))


def test_a_text_model_and_the_image_limit_refuse_before_any_image_is_loaded(bundled_tokenizer):
    processor = InputProcessor(bundled_tokenizer, PromptLimits(bundled_tokenizer.vocab_size, 2048, 128, 16))
    processor.check_images(0)  # text is fine
    fetched = []

    async def load(ref):
        fetched.append(ref)
        raise AssertionError("loaded")
    messages = [{"role": "user", "content": [parts.image_part(parts.ImageRef("m[0].c[0]", url=data_url()))]}]
    with pytest.raises(InvalidRequest, match="takes text only"):
        asyncio.run(parts.load_images(messages, load, processor.check_images))
    processor.multimodal, processor.max_images = object(), 1  # a vision model taking one image per prompt
    with pytest.raises(InvalidRequest, match="2 images is more than the 1 .*--limit-mm-per-prompt"):
        asyncio.run(parts.load_images(messages * 2, load, processor.check_images))
    assert not fetched


def test_limit_mm_per_prompt_takes_vllms_forms():
    import argparse

    from frontend.multimodal import image_limit
    assert image_limit("image=3") == 3 and image_limit('{"image": 0}') == 0
    for bad in ("video=2", "image=x", '{"image": -1}', "3"):
        with pytest.raises(argparse.ArgumentTypeError):
            image_limit(bad)


# -- the offline LLM ------------------------------------------------------------------------------

def test_offline_messages_every_form(tmp_path):
    path = tmp_path / "cat.png"
    path.write_bytes(png())
    text = {"role": "system", "content": "Be brief."}
    messages = [text, {"role": "user", "content": [
        {"type": "text", "text": "Four:"}, {"type": "image", "image": Image.new("RGB", (6, 4), (10, 20, 30))},
        {"type": "image", "image": path}, {"type": "image", "image": str(path)},
        {"type": "image_url", "image_url": {"url": data_url()}}, {"type": "image_url", "image_url": data_url()},
        {"type": "image", "image": data_url()}]},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    system, user, joined = parts.offline_messages(messages)
    assert system is text and joined == {"role": "user", "content": "ab"}
    assert user["content"][0] == {"type": "text", "text": "Four:"}
    for part in user["content"][1:]:
        assert_image(part)


@pytest.mark.parametrize("part,where,match", [
    ({"type": "image", "image": "https://example.com/a.png"}, "image", "not fetched here"),
    ({"type": "image_url", "image_url": {"url": "http://example.com/a.png"}}, "image_url", "not fetched here"),
    ({"type": "image", "image": "/no/such/file.png"}, "image", "cannot read"),
    ({"type": "image", "image": 42}, "image", "PIL image, a path or a data URL"),
    ({"type": "image", "image": Image.new("RGB", (20, 20))}, "image", "over 100 pixels"),
    ({"type": "video", "video": "x"}, "", "a part is"),
    ({"type": "image_url", "image_url": data_url(truncated())}, "image_url", "broken|not an image"),
])
def test_offline_bad_parts_are_named(part, where, match):
    messages = [{"role": "user", "content": [{"type": "text", "text": "x"}, part]}]
    name = "messages[0].content[1]" + (f".{where}" if where else "")
    refused(lambda: parts.offline_messages(messages, ImageLimits(max_pixels=100)), name, match)


# -- the HTTP routes and a run-batch line ---------------------------------------------------------

class _Recorder:
    """An engine-less processor: records the messages a route hands on, then refuses."""

    def __init__(self) -> None:
        self.seen: list[list[dict]] = []
        self.limits = SimpleNamespace(max_model_len=64)

    def resolve_model(self, model, names) -> str:
        return ""

    def chat_with_tools(self, messages, tools=None, **kwargs):
        self.seen.append(messages)
        raise InvalidRequest("messages: recorded")

    tokenize_chat = chat_prompt = chat_with_tools

    async def chat_prompt_async(self, messages, **kwargs):
        return self.chat_prompt(messages, **kwargs)

    def check_images(self, count: int, field: str = "messages") -> None:
        pass


def _app(recorder: _Recorder, data_dir):
    llm = SimpleNamespace(require_engine=lambda: recorder, require_ready=lambda **_: recorder, welcome=None,
                          input=SimpleNamespace(harmony=None), max_concurrent_streams=8)
    return build_app(HttpContext(llm, METRICS, ["m"], options=HttpOptions(data_dir=str(data_dir))))


def test_every_http_route_hands_on_loaded_images(tmp_path):
    recorder = _Recorder()
    user = {"role": "user", "content": [{"type": "text", "text": "Hi"},
                                        {"type": "image_url", "image_url": {"url": data_url()}}]}
    bodies = [("/v1/chat/completions", {"model": "m", "messages": [user]}),
              ("/tokenize", {"model": "m", "messages": [user]}),
              ("/v1/messages", {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": [
                  {"type": "text", "text": "Hi"},
                  {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64(png())}}]}]}),
              ("/v1/responses", {"model": "m", "input": [{"role": "user", "content": [
                  {"type": "input_text", "text": "Hi"}, {"type": "input_image", "image_url": data_url()}]}]})]

    async def run():
        transport = httpx.ASGITransport(app=_app(recorder, tmp_path))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            return [await c.post(path, json=body) for path, body in bodies]

    for r in asyncio.run(run()):
        assert r.status_code == 400 and "recorded" in r.text, r.text
    assert len(recorder.seen) == 4
    for messages in recorder.seen:
        text, image = messages[-1]["content"]
        assert text == {"type": "text", "text": "Hi"}
        assert_image(image)


def test_a_run_batch_chat_line_with_a_data_url(tmp_path):
    recorder = _Recorder()
    image = {"type": "image_url", "image_url": {"url": data_url()}}
    lines = [json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
                         "body": {"model": "m", "messages": [{"role": "user", "content": [image]}]}}),
             json.dumps({"custom_id": "b", "method": "POST", "url": "/v1/chat/completions",
                         "body": {"model": "m", "messages": [{"role": "user", "content": [
                             {"type": "image_url", "image_url": {"url": "data:image/png;base64,@@"}}]}]}})]
    results = []
    asyncio.run(BatchRunner(_app(recorder, tmp_path), asyncio.Semaphore(2)).run(lines, results.append))
    by_id = {r.record["custom_id"]: r.record for r in results}
    assert_image(recorder.seen[0][0]["content"][0])
    assert "recorded" in json.dumps(by_id["a"])  # the line reached the processor, its image loaded
    assert "messages[0].content[0].image_url.url" in json.dumps(by_id["b"])
