"""The HTTP side of multi-LoRA without engines: who may load and unload adapters, how each
outcome maps to a status and body, /v1/models, and an unknown `model` -> 404. The app runs
in-process (httpx over ASGI) on a pool of faked engines (test_frontend_lora.FakeEngine)."""

from __future__ import annotations

import asyncio

import httpx

from common.validation import PromptLimits
from frontend.async_llm import AsyncLLM
from frontend.engine_pool import EnginePool
from frontend.http.app import build_app
from frontend.http.context import HttpContext
from frontend.input_processor import InputProcessor
from frontend.router import RoundRobin
from helpers import frontend_metrics
from tests.unit.test_frontend_lora import A, FakeEngine, Kind, welcome

KEY = {"Authorization": "Bearer k"}
_METRICS = frontend_metrics()


def serve(calls, api_key: str | None = "k", allow: bool = False, kinds=(), **facts):
    """Run `calls(client, engine)` against an app over one fake engine."""
    async def run():
        pool = EnginePool(RoundRobin(), "fe")
        await pool.start([A])
        engine = FakeEngine(pool, A, welcome("a", ["sql"], **facts), kinds=kinds)
        llm = AsyncLLM(pool, 8)
        llm.input = InputProcessor(None, PromptLimits(100, 1024, 64, 4), lambda: pool.lora_adapters().keys())
        app = build_app(HttpContext(llm, _METRICS, ["base"], api_key, allow))
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
                return await calls(client, engine)
        finally:
            await pool.close()
    return asyncio.run(run())


def test_admin_needs_the_key_or_the_flag():
    async def calls(client, engine):
        body = {"lora_name": "chat", "lora_path": "/ad/chat"}
        return [(await client.post("/v1/load_lora_adapter", json=body, headers=h)).status_code
                for h in ({}, {"Authorization": "Bearer wrong"}, KEY)]

    assert serve(calls) == [401, 401, 200]
    assert serve(calls, api_key=None) == [403, 403, 403]
    assert serve(calls, api_key=None, allow=True) == [200, 400, 400]  # then: already loaded


def test_load_then_listed_unload_then_gone():
    async def calls(client, engine):
        load = await client.post("/v1/load_lora_adapter", json={"lora_name": "chat", "lora_path": "/ad/chat"},
                                 headers=KEY)
        assert load.status_code == 200 and "chat" in load.text
        models = (await client.get("/v1/models", headers=KEY)).json()["data"]
        assert [(m["id"], m["root"], m["parent"]) for m in models] == [
            ("base", "m", None), ("chat", "/ad/chat", "base"), ("sql", "/a/sql", "base")]
        unload = await client.post("/v1/unload_lora_adapter", json={"lora_name": "chat"}, headers=KEY)
        assert unload.status_code == 200
        gone = await client.post("/v1/completions", json={"model": "chat", "prompt": "hi"}, headers=KEY)
        return gone

    gone = serve(calls)
    assert gone.status_code == 404
    assert gone.json()["error"]["message"].startswith("The model `chat` does not exist")
    assert gone.json()["error"]["type"] == "not_found_error" and gone.json()["error"]["code"] == "model_not_found"


def test_admin_error_mapping():
    async def calls(client, engine):
        post = client.post
        return [
            await post("/v1/load_lora_adapter", json={"lora_name": "big", "lora_path": "/ad/big"}, headers=KEY),
            await post("/v1/unload_lora_adapter", json={"lora_name": "nope"}, headers=KEY),
            await post("/v1/load_lora_adapter", json={"lora_name": "x"}, headers=KEY),
        ]

    invalid, unknown, no_path = serve(calls, kinds=[Kind.KIND_INVALID, Kind.KIND_NOT_FOUND])
    assert invalid.status_code == 400 and invalid.json()["error"]["message"] == "engine says 1"
    assert unknown.status_code == 404 and "cannot be found" in unknown.json()["error"]["message"]
    assert unknown.json()["error"]["type"] == "not_found_error"
    assert no_path.status_code == 400 and no_path.json()["error"]["param"] == "lora_path"


def test_lora_not_enabled_is_a_400_saying_so():
    async def calls(client, engine):
        return await client.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/x"}, headers=KEY)

    response = serve(calls, lora_enabled=False)
    assert response.status_code == 400 and "start the engine with --enable-lora" in response.json()["error"]["message"]


def test_anthropic_unknown_model_is_its_404():
    async def calls(client, engine):
        body = {"model": "nope", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
        return await client.post("/v1/messages", json=body, headers=KEY)

    response = serve(calls)
    assert response.status_code == 404 and response.json()["type"] == "error"
    assert response.json()["error"]["type"] == "not_found_error"
