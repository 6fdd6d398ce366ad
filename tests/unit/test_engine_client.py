"""The frontend's engine client against a real ZeroMQ socket that the test answers as an
engine would."""

from __future__ import annotations

import asyncio

import zmq
import zmq.asyncio

from common.v1 import engine_ipc_pb2 as ipc
from frontend.engine_client import EngineClient, Inbox
from helpers import free_port


def test_a_failing_handler_does_not_stop_the_client_reading():
    """An exception while handling one message (here a state callback) is logged, and the next
    messages are still read: a client whose receive loop died would say Hello forever, a stray
    that an engine sees as a new frontend every heartbeat."""
    calls = []

    def on_state(connected: bool) -> None:
        calls.append(connected)
        raise RuntimeError("a bug in a callback")

    async def run() -> int:
        address = f"tcp://127.0.0.1:{free_port()}"
        ctx = zmq.asyncio.Context()
        engine = ctx.socket(zmq.ROUTER)
        engine.bind(address)
        client = EngineClient(address, "fe-1", heartbeat_s=0.05, on_state=on_state)
        await client.start()
        try:
            identity, payload = await asyncio.wait_for(engine.recv_multipart(), 10)
            assert ipc.EngineRequest.FromString(payload).WhichOneof("kind") == "hello"
            welcome = ipc.Welcome(engine_id="e", model_name="m", max_model_len=64, block_size=16,
                                  vocab_size=100, eos_token_ids=[2], kv_blocks_total=8)
            await engine.send_multipart([identity, ipc.EngineResponse(welcome=welcome).SerializeToString()])
            pong = ipc.Pong(engine_id="e", stats=ipc.EngineStats(num_running=7))
            await engine.send_multipart([identity, ipc.EngineResponse(pong=pong).SerializeToString()])
            for _ in range(200):
                if client.stats.num_running == 7:
                    break
                await asyncio.sleep(0.01)
            return client.stats.num_running
        finally:
            await client.close()
            engine.close(linger=0)
            ctx.term()

    assert asyncio.run(run()) == 7  # the Pong after the failed Welcome callback was read
    assert calls == [True]


def test_an_inbox_hands_over_everything_that_came_at_once_in_order():
    async def run():
        inbox = Inbox()
        inbox.put("a")
        inbox.put("b")
        assert await inbox.take() == ["a", "b"]
        reader = asyncio.ensure_future(inbox.take())
        await asyncio.sleep(0)  # the reader waits now
        inbox.put("c")
        inbox.put("d")
        assert await reader == ["c", "d"]
        assert await inbox.take(timeout_s=0.01) == []  # nothing came in time
        inbox.put("e")  # after a timeout, a put is not lost
        assert await inbox.take(timeout_s=0.01) == ["e"]

    asyncio.run(run())


def test_plain_tokens_reach_their_streams_as_token_and_cached_pairs():
    async def run():
        client = EngineClient("tcp://127.0.0.1:1", "fe-1")
        a, b = client.open_stream("a"), client.open_stream("b")
        batch = ipc.OutputBatch(
            outputs=[ipc.RequestOutput(request_id="b", new_token_ids=[7], finish_reason="length")],
            token_request_ids=["a", "b", "gone"], token_ids=[5, 6, 9], token_num_cached_tokens=[16, 0, 0])
        client._dispatch(ipc.EngineResponse(outputs=batch))
        await client.close()
        return a.items, b.items

    a, b = asyncio.run(run())
    assert a == [(5, 16)]
    assert [type(i) for i in b] == [ipc.RequestOutput, tuple] and b[1] == (6, 0)  # in the engine's order
