"""The frontend's side of sleep, wake and weight updates without engines: who may call the admin
routes, the fan-out's one outcome from two engines' answers, and what a request meets while
the pool sleeps (503 with Retry-After, in OpenAI's and Anthropic's error shapes). The app runs
in-process (httpx over ASGI); engines are faked at the client's `_send`."""

from __future__ import annotations

import asyncio

import httpx
from prometheus_client import CollectorRegistry

from common.v1 import engine_ipc_pb2 as ipc
from common.validation import PromptLimits
from frontend.async_llm import AsyncLLM
from frontend.engine_pool import EnginePool
from frontend.http.app import build_app
from frontend.http.context import HttpContext
from frontend.input_processor import InputProcessor
from frontend.router import RoundRobin
from helpers import frontend_metrics

A, B = "tcp://127.0.0.1:1", "tcp://127.0.0.1:2"
KEY = {"Authorization": "Bearer k"}
_METRICS = frontend_metrics()


class AdminFake:
    """An engine that answers AdminOps as a real one would (`refuse`: with this message
    instead; `silent`: never), keeping its sleep level."""

    def __init__(self, pool: EnginePool, address: str, refuse: str = "", silent: bool = False) -> None:
        self.client = pool.engines[address].client
        self.refuse, self.silent, self.level = refuse, silent, 0
        self.client._send = self._send
        self.client._on_welcome(ipc.Welcome(engine_id=address[-1], model_name="m", max_model_len=1024, block_size=4,
                                            vocab_size=100, eos_token_ids=[2], kv_blocks_total=64))

    async def _send(self, msg: ipc.EngineRequest) -> None:
        if msg.WhichOneof("kind") != "admin" or self.silent:
            return
        op = msg.admin
        if not self.refuse:
            self.level = {op.KIND_SLEEP: op.level, op.KIND_WAKE_UP: 0}.get(op.kind, self.level)
        result = ipc.AdminResult(op_id=op.op_id, ok=not self.refuse, message=self.refuse, sleep_level=self.level)
        asyncio.get_running_loop().call_soon(self.client._dispatch, ipc.EngineResponse(admin_result=result))


def serve(calls, api_key: str | None = "k", **fakes):
    """Run `calls(client)` against an app over two fake engines (`fakes`: AdminFake's options
    for "a" and "b")."""
    async def run():
        pool = EnginePool(RoundRobin(), "fe")
        await pool.start([A, B])
        for address, name in ((A, "a"), (B, "b")):
            AdminFake(pool, address, **fakes.get(name, {}))
        llm = AsyncLLM(pool, 8)
        llm.input = InputProcessor(None, PromptLimits(100, 1024, 64, 4), lambda: ())
        app = build_app(HttpContext(llm, _METRICS, ["base"], api_key))
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
                client.pool = pool
                return await calls(client)
        finally:
            await pool.close()
    return asyncio.run(run())


def test_the_admin_routes_need_the_key():
    async def calls(client):
        return [(await client.post("/sleep", headers=h)).status_code
                for h in ({}, {"Authorization": "Bearer wrong"}, KEY)]

    assert serve(calls) == [401, 401, 200]
    forbidden = serve(lambda client: client.get("/is_sleeping", headers=KEY), api_key=None)
    assert forbidden.status_code == 403 and forbidden.json()["error"]["type"] == "permission_error"


def test_asleep_new_requests_get_503_with_retry_after():
    async def calls(client):
        out = [await client.post("/sleep?level=2", headers=KEY), await client.get("/is_sleeping", headers=KEY),
               await client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2}, headers=KEY),
               await client.post("/v1/messages", headers=KEY, json={
                   "model": "base", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}),
               await client.get("/health")]
        registry = CollectorRegistry()
        _METRICS.watch_pool(client.pool, registry)
        assert registry.get_sample_value("pagedserve:engine_sleep_level", {"engine": A}) == 2
        out += [await client.post("/wake_up", headers=KEY), await client.get("/is_sleeping", headers=KEY)]
        return out

    slept, asleep, completion, message, health, woke, awake = serve(calls)
    assert slept.json() == asleep.json() == {"is_sleeping": True, "level": 2}
    assert completion.status_code == 503 and completion.headers["retry-after"] == "1"
    assert "asleep" in completion.json()["error"]["message"]
    assert completion.json()["error"]["type"] == "service_unavailable_error"
    assert message.status_code == 503 and message.json()["type"] == "error"  # Anthropic's shape
    assert health.status_code == 200  # asleep, not broken: a probe must not restart it
    assert woke.json() == awake.json() == {"is_sleeping": False, "level": 0}


def test_one_outcome_from_every_engine():
    async def calls(client):
        return [await client.post("/sleep?level=3", headers=KEY),
                await client.post("/update_weights", json={"model_path": "/w"}, headers=KEY),
                await client.post("/update_weights", json={}, headers=KEY)]

    bad_level, refused, no_path = serve(calls, b={"refuse": "model_path: '/w' does not exist on the engine"})
    assert bad_level.status_code == 400 and bad_level.json()["error"]["param"] == "level"
    assert refused.status_code == 400
    assert refused.json()["error"]["message"] == "model_path: '/w' does not exist on the engine (1 of 2 engines did it)"
    assert refused.json()["error"]["param"] == "model_path"
    assert no_path.status_code == 400 and "model_path" in no_path.json()["error"]["message"]


def test_a_silent_engine_is_503(monkeypatch):
    monkeypatch.setattr("frontend.sleep.ADMIN_TIMEOUT_S", 0.05)
    response = serve(lambda client: client.post("/sleep", headers=KEY), b={"silent": True})
    assert response.status_code == 503 and "no answer from engine" in response.json()["error"]["message"]
