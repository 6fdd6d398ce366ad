"""The frontend's side of multi-LoRA without engines: naming an adapter (input processor),
what each engine client learns of its engine's adapters, routing only to engines that have
one, and the admin load/unload fan-out with its error mapping. Engines are faked at the
client's `_send`: each LoadLora/UnloadLora gets the LoraResult the test programs."""

from __future__ import annotations

import asyncio

import pytest

from common.errors import InvalidRequest, Unavailable
from common.v1 import engine_ipc_pb2 as ipc
from common.validation import PromptLimits
from frontend.engine_pool import EnginePool, EngineState
from frontend.input_processor import InputProcessor, NotFound
from frontend.lora import load_lora, unload_lora
from frontend.router import RoundRobin, prompt_block_hashes

A, B = "tcp://127.0.0.1:1", "tcp://127.0.0.1:2"
Kind = ipc.LoraResult.Kind


def welcome(engine_id: str, adapters=(), **facts) -> ipc.Welcome:
    base = dict(model_name="m", max_model_len=1024, block_size=4, vocab_size=100, eos_token_ids=[2],
                kv_blocks_total=64, lora_enabled=True, max_lora_rank=8)
    return ipc.Welcome(engine_id=engine_id, lora_adapters=[ipc.LoraAdapter(name=n, path=f"/a/{n}", rank=4)
                                                           for n in adapters], **{**base, **facts})


class FakeEngine:
    """Answers the client's LoRA operations with `kinds` (one per operation; when they run out,
    as an engine would: CONFLICT for a name it has, NOT_FOUND for one it lacks), keeping its
    adapter list as a real engine would; `silent`: never answers."""

    def __init__(self, pool: EnginePool, address: str, w: ipc.Welcome, kinds=(), silent=False) -> None:
        self.client = pool.engines[address].client
        self.adapters = {a.name: a for a in w.lora_adapters}
        self.kinds, self.silent, self.sent = list(kinds), silent, []
        self.lacks = set()  # adapters it refuses AddRequests for, though the frontend thinks it has them
        self.client._send = self._send
        self.client._on_welcome(w)

    async def _send(self, msg: ipc.EngineRequest) -> None:
        self.sent.append(msg)
        kind = msg.WhichOneof("kind")
        if kind == "add" and msg.add.lora_name in self.lacks:
            error = ipc.RequestError(request_id=msg.add.request_id, kind=ipc.RequestError.KIND_NOT_FOUND,
                                     message=f"LoRA adapter '{msg.add.lora_name}' is not loaded")
            asyncio.get_running_loop().call_soon(self.client._dispatch, ipc.EngineResponse(error=error))
        if kind not in ("load_lora", "unload_lora") or self.silent:
            return
        op = getattr(msg, kind)
        result = self.kinds.pop(0) if self.kinds else self._kind(kind, op.name)
        if result == Kind.KIND_OK and kind == "load_lora":
            self.adapters[op.name] = ipc.LoraAdapter(name=op.name, path=op.path, rank=4)
        elif result == Kind.KIND_OK:
            self.adapters.pop(op.name, None)
        answer = ipc.LoraResult(op_id=op.op_id, kind=result, message=f"engine says {result}",
                                adapters=list(self.adapters.values()))
        asyncio.get_running_loop().call_soon(self.client._dispatch, ipc.EngineResponse(lora_result=answer))

    def _kind(self, kind: str, name: str) -> int:
        if kind == "load_lora":
            return Kind.KIND_CONFLICT if name in self.adapters else Kind.KIND_OK
        return Kind.KIND_OK if name in self.adapters else Kind.KIND_NOT_FOUND

    def ops(self, kind: str) -> list[str]:
        return [getattr(m, kind).name for m in self.sent if m.WhichOneof("kind") == kind]


async def two_engines(wa: ipc.Welcome, wb: ipc.Welcome, **fakes) -> tuple[EnginePool, FakeEngine, FakeEngine]:
    pool = EnginePool(RoundRobin(), "fe")
    await pool.start([A, B])
    return pool, FakeEngine(pool, A, wa, **fakes.get("a", {})), FakeEngine(pool, B, wb, **fakes.get("b", {}))


def test_input_processor_resolves_model_and_lora_name():
    processor = InputProcessor(None, PromptLimits(100, 64, 16, 4), lambda: {"sql", "chat"})
    assert processor.resolve_model(None, ["base", "alias"]) == ""
    assert processor.resolve_model("alias", ["base", "alias"]) == ""
    assert processor.resolve_model("sql", ["base"]) == "sql"
    with pytest.raises(NotFound, match="The model `nope` does not exist") as e:
        processor.resolve_model("nope", ["base"])
    assert e.value.param == "model" and isinstance(e.value, InvalidRequest)
    assert processor.check_lora("") == "" and processor.check_lora("chat") == "chat"
    with pytest.raises(NotFound, match="lora_name: the LoRA adapter `base` does not exist"):
        processor.check_lora("base")  # gRPC names the base model with "", not its name


def test_client_learns_adapters_from_welcome_pong_result_and_errors():
    async def run():
        pool, a, _ = await two_engines(welcome("a", ["sql"]), welcome("b"))
        client = a.client
        assert set(client.lora_adapters) == {"sql"} and client.lora_adapters["sql"].path == "/a/sql"
        client._dispatch(ipc.EngineResponse(pong=ipc.Pong(engine_id="a", lora_names=["sql", "chat"])))
        assert client.lora_adapters["sql"].path == "/a/sql" and set(client.lora_adapters) == {"sql", "chat"}
        client._dispatch(ipc.EngineResponse(pong=ipc.Pong(engine_id="a", lora_names=["chat"])))
        assert set(client.lora_adapters) == {"chat"}
        inbox = client.open_stream("r1")
        client._dispatch(ipc.EngineResponse(error=ipc.RequestError(
            request_id="r1", kind=ipc.RequestError.KIND_NOT_FOUND, message="no adapter x")))
        [error] = inbox.items
        assert isinstance(error, NotFound)
        future = await client.operation(ipc.EngineRequest(load_lora=ipc.LoadLora(op_id="op", name="x", path="/x")))
        client._lose("test")
        with pytest.raises(Unavailable):
            await future
        await pool.close()

    asyncio.run(run())


def test_routing_only_to_engines_with_the_adapter_and_hashes_keyed_by_it():
    async def run():
        pool, _, _ = await two_engines(welcome("a", ["sql"]), welcome("b", ["sql", "chat"]))
        assert {pool.route([1, 2, 3], lora_name="chat").address for _ in range(4)} == {B}
        assert {pool.route([1, 2, 3], lora_name="sql").address for _ in range(4)} == {A, B}
        assert pool.route([1], exclude={B}, lora_name="chat") is None
        assert pool.route([1], lora_name="other") is None
        assert sorted(pool.lora_adapters()) == ["chat", "sql"]
        await pool.close()

    asyncio.run(run())



def test_router_hashes_blocks_as_the_engine_keys_them():
    """The cache-aware router predicts the engine's prefix cache: same tokens and adapter, same
    block hashes as the engine's own (engine.core keys a request's blocks by its adapter)."""
    from common.prefix_hash import hash_block
    from common.prefix_hash import block_extra_keys

    async def run():
        pool, a, _ = await two_engines(welcome("a", ["sql"]), welcome("b", ["sql"]))
        routed = []

        class Recorder(RoundRobin):
            needs_block_hashes = True

            def choose(self, views, hashes):
                routed.append(hashes)
                return super().choose(views, hashes)

        pool.policy = Recorder()
        pool.route(list(range(9)), lora_name="sql")
        pool.route(list(range(9)))
        await pool.close()
        return routed

    pool_sql, pool_base = asyncio.run(run())
    keys = block_extra_keys("sql", "/a/sql")
    first = hash_block(None, [0, 1, 2, 3], keys)
    assert pool_sql == [first, hash_block(first, [4, 5, 6, 7], keys)]
    assert pool_base == prompt_block_hashes(list(range(9)), 4) and not set(pool_base) & set(pool_sql)


def test_an_engine_lacking_the_adapter_passes_the_request_on_then_not_found(bundled_tokenizer):
    """The frontend's list can be a heartbeat old: an engine's KIND_NOT_FOUND moves the request
    to another engine with the adapter; when none has it, the caller gets NotFound (404)."""
    from common.sampling_params import SamplingParams
    from frontend.async_llm import AsyncLLM

    async def run():
        pool, a, b = await two_engines(welcome("a", ["sql"]), welcome("b", ["sql"]))
        llm = AsyncLLM(pool, 8)
        # (a real tokenizer: a request's detokenizer reads the prompt's last characters)
        llm.input = InputProcessor(bundled_tokenizer, PromptLimits(100, 1024, 64, 4),
                                   lambda: pool.lora_adapters().keys())
        a.lacks = b.lacks = {"sql"}
        gen = llm.admit([5, 6, 7], SamplingParams(max_tokens=2), lora_name="sql")
        with pytest.raises(NotFound, match="'sql' is not loaded"):
            async for _ in llm.generate(gen):
                pass
        adds = [m.add.lora_name for e in (a, b) for m in e.sent if m.WhichOneof("kind") == "add"]
        retries = [e.num_retries for e in pool.engines.values()]
        await pool.close()
        return adds, retries

    adds, retries = asyncio.run(run())
    assert adds == ["sql", "sql"]  # each engine tried once
    assert sum(r.get("not_found", 0) for r in retries) == 1


def test_pool_refuses_an_engine_without_lora_beside_one_with_it():
    async def run():
        pool, _, b = await two_engines(welcome("a"), welcome("b", lora_enabled=False))
        assert pool.engines[B].state is EngineState.REFUSED and "lora_enabled" in pool.engines[B].refused
        await pool.close()

    asyncio.run(run())


def test_load_goes_to_every_engine_and_a_joining_engine_gets_it_too():
    async def run():
        pool, a, b = await two_engines(welcome("a"), welcome("b"))
        await load_lora(pool, "sql", "/ad/sql", ["m"])
        assert a.ops("load_lora") == b.ops("load_lora") == ["sql"]
        assert pool.runtime_loras == {"sql": "/ad/sql"} and pool.lora_adapters()["sql"].path == "/ad/sql"
        b.client._lose("restart")  # it comes back without the adapter: the pool loads it again
        b.adapters = {}
        b.client._on_welcome(welcome("b2"))
        await asyncio.sleep(0.01)
        assert b.ops("load_lora") == ["sql", "sql"] and "sql" in b.client.lora_adapters
        await unload_lora(pool, "sql")
        assert a.ops("unload_lora") == ["sql"] and pool.runtime_loras == {} and pool.lora_adapters() == {}
        await pool.close()

    asyncio.run(run())


@pytest.mark.parametrize("kinds_a, kinds_b, error, message", [
    ([Kind.KIND_INVALID], [Kind.KIND_OK], InvalidRequest, "engine says 1"),  # rank > --max-lora-rank
    ([Kind.KIND_CONFLICT], [Kind.KIND_CONFLICT], InvalidRequest, "has already been loaded"),
    ([Kind.KIND_NOT_FOUND], [Kind.KIND_NOT_FOUND], NotFound, "engine says 2"),  # no such path
    ([Kind.KIND_CONFLICT], [Kind.KIND_OK], None, None),  # now every engine has it
])
def test_load_outcomes(kinds_a, kinds_b, error, message):
    async def run():
        pool, a, b = await two_engines(welcome("a"), welcome("b"), a={"kinds": kinds_a}, b={"kinds": kinds_b})
        if error is None:
            await load_lora(pool, "sql", "/ad/sql", ["m"])
            assert pool.runtime_loras == {"sql": "/ad/sql"}
        else:
            with pytest.raises(error, match=message):
                await load_lora(pool, "sql", "/ad/sql", ["m"])
            assert pool.runtime_loras == {}
        await asyncio.sleep(0.01)
        await pool.close()
        return a, b

    a, b = asyncio.run(run())
    if kinds_a == [Kind.KIND_INVALID]:  # the engine that did load it unloads it again
        assert b.ops("unload_lora") == ["sql"] and "sql" not in b.adapters and a.ops("unload_lora") == []


def test_unload_in_use_is_refused():
    async def run():
        pool, a, b = await two_engines(welcome("a", ["sql"]), welcome("b", ["sql"]), a={"kinds": [Kind.KIND_CONFLICT]})
        with pytest.raises(InvalidRequest, match="engine says 3"):
            await unload_lora(pool, "sql")
        assert "sql" in a.client.lora_adapters and "sql" not in b.client.lora_adapters
        assert {pool.route([1], lora_name="sql").address for _ in range(3)} == {A}  # only where it still is
        await pool.close()

    asyncio.run(run())


def test_unload_unknown_is_not_found_and_bad_requests_say_why():
    async def run():
        pool, a, _ = await two_engines(welcome("a"), welcome("b"), a={"kinds": [Kind.KIND_NOT_FOUND]},
                                       b={"kinds": [Kind.KIND_NOT_FOUND]})
        with pytest.raises(NotFound, match="cannot be found"):
            await unload_lora(pool, "nope")
        with pytest.raises(InvalidRequest, match="base model's name"):
            await load_lora(pool, "m", "/ad", ["m"])
        with pytest.raises(InvalidRequest, match="lora_path"):
            await load_lora(pool, "sql", "", ["m"])
        with pytest.raises(InvalidRequest, match="lora_name"):
            await load_lora(pool, "bad name", "/ad", ["m"])
        assert a.ops("load_lora") == []
        await pool.close()

    asyncio.run(run())


def test_not_enabled_and_silent_engines():
    async def run():
        pool = EnginePool(RoundRobin(), "fe")
        await pool.start([A])
        FakeEngine(pool, A, welcome("a", lora_enabled=False))
        with pytest.raises(InvalidRequest, match="LoRA is not enabled"):
            await load_lora(pool, "sql", "/ad", ["m"])
        await pool.close()
        pool, _, _ = await two_engines(welcome("a"), welcome("b"), b={"silent": True})
        with pytest.raises(Unavailable, match=f"no answer from engine {B}"):
            await load_lora(pool, "sql", "/ad", ["m"], timeout_s=0.05)
        await asyncio.sleep(0)  # done callbacks run on the next turn of the loop
        assert pool.engines[B].client._operations == {}  # the abandoned wait is dropped
        await pool.close()

    asyncio.run(run())


def test_serve_passes_the_engine_lora_flags_and_keeps_the_admin_flag():
    import argparse

    from pagedserve.serve import add_arguments, engine_command
    argv = ["--lora-modules", "a=/ad/a", "b=/ad/b", "--allow-runtime-lora", "--max-lora-rank", "8",
            "--max-loras", "2", "--api-key", "k"]
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(argv)
    assert args.allow_runtime_lora and args.lora_modules == ["a=/ad/a", "b=/ad/b"]
    cmd = engine_command(args, argv)
    assert cmd[cmd.index("--lora-modules"):][:3] == ["--lora-modules", "a=/ad/a", "b=/ad/b"]
    assert "--max-lora-rank" in cmd and "--max-loras" in cmd
    assert "--allow-runtime-lora" not in cmd and "--api-key" not in cmd  # the frontend's own
