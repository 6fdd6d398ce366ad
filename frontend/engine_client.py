"""EngineClient: the frontend's side of the ZeroMQ link to one engine.

It says Hello until the engine answers Welcome (the handshake: model facts, KV capacity),
then pings every `heartbeat_s`. The engine is lost when its connection closes (a crashed
engine's socket is closed by its kernel: seen at once, through a ZeroMQ socket monitor) or
when it is silent longer than `timeout_s` (a hung engine or a cut network): every in-flight
stream gets `EngineLost`, `connected` clears, and Hello resumes until an engine (the same or
a restarted one) answers. Outputs are routed to per-request inboxes (`Inbox`). One client links to one
engine; the engine pool (frontend/engine_pool.py) holds one per engine.

It also knows the engine's LoRA adapters: the handshake's list, then each LoraResult's and
each Pong's (so a load that another frontend asked for is learnt within a heartbeat).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from common.errors import EngineOverloaded, InvalidRequest, Unavailable
from common.v1 import engine_ipc_pb2 as ipc
from frontend.input_processor import NotFound

log = logging.getLogger("pagedserve.frontend")


class EngineLost(Unavailable):
    """The engine stopped answering; queued into each in-flight stream."""


class Inbox:
    """One request's items, in arrival order: its outputs and errors (from the engine client),
    an abort or time limit (from AsyncLLM). The reader takes all that came at once. A step
    delivers one output to each of hundreds of streams: an asyncio.Queue's put and get per
    item (a future per get, its getters' deque) were a quarter of the frontend's work per step."""

    __slots__ = ("items", "_waiter")

    def __init__(self) -> None:
        self.items: list = []
        self._waiter: asyncio.Future | None = None  # the reader's, while it waits

    def put(self, item) -> None:
        self.items.append(item)
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    async def take(self, timeout_s: float | None = None) -> list:
        """Everything put since the last take, waiting for the first; [] if `timeout_s`
        passes first."""
        if not self.items:
            waiter = self._waiter = asyncio.get_running_loop().create_future()
            try:
                await (waiter if timeout_s is None else asyncio.wait_for(waiter, timeout_s))
            except asyncio.TimeoutError:
                return []
            finally:
                self._waiter = None
        items, self.items = self.items, []
        return items


class EngineClient:
    def __init__(self, address: str, frontend_id: str, grpc_address: str = "",
                 heartbeat_s: float = 0.5, timeout_s: float = 3.0,
                 on_state: Callable[[bool], None] | None = None) -> None:
        self.address = address
        self.frontend_id = frontend_id
        self.grpc_address = grpc_address
        self.heartbeat_s, self.timeout_s = heartbeat_s, timeout_s
        self.on_state = on_state or (lambda connected: None)
        self.welcome: ipc.Welcome | None = None
        self.stats = ipc.EngineStats()
        self.num_added_since_stats = 0  # requests the latest stats cannot count yet
        self.draining = False  # the engine said it is shutting down (Pong.draining)
        self.said_bye = False  # to this (draining) engine: it forgot us
        self.peers: list = []  # frontends the engine knows, from the last Pong
        self.lora_adapters: dict[str, ipc.LoraAdapter] = {}  # the engine's adapters, by name
        self.sleep_level = 0  # the engine's (Pong, AdminResult): 0 awake; asleep, it gets no new requests
        self._operations: dict[str, asyncio.Future] = {}  # LoadLora/UnloadLora/AdminOp waiting, by op_id
        self.connected = asyncio.Event()
        self.streams: dict[str, Inbox] = {}
        self._last_heard = 0.0
        self._seq = 0
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.IDENTITY, frontend_id.encode())
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.IMMEDIATE, 1)  # never queue requests for an absent engine
        self._sock.setsockopt(zmq.IPV6, 1)  # an engine found by DNS may have an IPv6 address
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._sock.connect(self.address)
        self._tasks = [asyncio.create_task(self._recv_loop()), asyncio.create_task(self._heartbeat_loop()),
                       asyncio.create_task(self._monitor_loop(monitor))]

    async def close(self) -> None:
        if self.connected.is_set() and not self.said_bye:  # so the engine forgets us now, not after its timeout
            try:
                await self._send(ipc.EngineRequest(bye=ipc.Bye()))
            except EngineLost:
                pass
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._sock.disable_monitor()
        self._sock.close(linger=500)  # time for the Bye to leave
        self._ctx.term()

    async def wait_connected(self, timeout_s: float) -> bool:
        try:
            await asyncio.wait_for(self.connected.wait(), timeout_s)
            return True
        except asyncio.TimeoutError:
            return False

    # -- requests ------------------------------------------------------------------

    def open_stream(self, request_id: str) -> Inbox:
        inbox = self.streams[request_id] = Inbox()
        return inbox

    def close_stream(self, request_id: str) -> None:
        self.streams.pop(request_id, None)

    async def add(self, add: ipc.AddRequest) -> None:
        await self._send(ipc.EngineRequest(add=add))
        self.num_added_since_stats += 1

    async def operation(self, request: ipc.EngineRequest) -> asyncio.Future:
        """Send a LoadLora, UnloadLora or AdminOp; the future gets its LoraResult or AdminResult
        (or EngineLost)."""
        op = getattr(request, request.WhichOneof("kind"))
        future = asyncio.get_running_loop().create_future()
        self._operations[op.op_id] = future
        try:
            await self._send(request)
        except EngineLost:
            del self._operations[op.op_id]
            raise
        future.add_done_callback(lambda _: self._operations.pop(op.op_id, None))
        return future

    async def say_bye(self) -> None:
        """Tell a draining engine we have nothing more for it, so it may stop before its timeout.
        Then we stay silent (no pings, no silence check: it forgot us) until its connection
        closes, when Hello resumes for whatever engine comes back."""
        if self.connected.is_set() and not self.said_bye:
            await self._send(ipc.EngineRequest(bye=ipc.Bye()))
            self.said_bye = True

    async def abort(self, request_ids: list[str], stop_string: bool = False) -> None:
        """`stop_string`: a stop string ended them, so the engine counts them as stopped."""
        if request_ids and self.connected.is_set():
            abort = ipc.AbortRequests(request_ids=request_ids, stop_string=stop_string)
            await self._send(ipc.EngineRequest(abort=abort))

    async def _send(self, msg: ipc.EngineRequest) -> None:
        if not self.connected.is_set() and msg.WhichOneof("kind") not in ("hello", "ping"):
            raise EngineLost("no engine connected")
        try:
            await self._sock.send(msg.SerializeToString(), flags=zmq.NOBLOCK)
        except zmq.Again:
            raise EngineLost("engine not reachable") from None

    # -- background tasks ----------------------------------------------------------

    async def _recv_loop(self) -> None:
        while True:
            payload = await self._sock.recv()
            self._last_heard = time.monotonic()
            try:
                msg = ipc.EngineResponse.FromString(payload)
            except Exception:  # noqa: BLE001 - a bad frame must not kill the frontend
                log.warning("dropped an undecodable message from the engine")
                continue
            try:
                self._dispatch(msg)
            except Exception:  # noqa: BLE001 - a bug handling one message must not end the loop:
                # a client that stops reading keeps saying Hello, and never hears the Welcome.
                log.exception("failed to handle a %s message from the engine", msg.WhichOneof("kind"))

    def _dispatch(self, msg: ipc.EngineResponse) -> None:
        kind = msg.WhichOneof("kind")
        if kind == "welcome":
            self._on_welcome(msg.welcome)
        elif kind == "pong":
            if self.welcome is not None and msg.pong.engine_id != self.welcome.engine_id:
                self._lose("a new engine answers at this address")  # it never saw our Hello
                return
            self.stats, self.peers = msg.pong.stats, list(msg.pong.frontends)
            self._learn_lora_names(msg.pong.lora_names)
            self.num_added_since_stats, self.draining = 0, msg.pong.draining
            self.sleep_level = msg.pong.sleep_level
        elif kind == "outputs":
            self.stats, self.num_added_since_stats = msg.outputs.stats, 0
            # RequestOutputs (their stream converts them), then the plain tokens as
            # (token id, cached tokens) pairs.
            streams, batch = self.streams, msg.outputs
            for out in batch.outputs:
                inbox = streams.get(out.request_id)
                if inbox is not None:
                    inbox.put(out)
            for request_id, token_id, num_cached in zip(batch.token_request_ids, batch.token_ids,
                                                        batch.token_num_cached_tokens):
                inbox = streams.get(request_id)
                if inbox is not None:
                    inbox.put((token_id, num_cached))
        elif kind == "error":
            inbox = self.streams.get(msg.error.request_id)
            if inbox is not None:
                inbox.put(_ERROR_CLASSES.get(msg.error.kind, InvalidRequest)(msg.error.message))
        elif kind == "lora_result":
            self.lora_adapters = {a.name: a for a in msg.lora_result.adapters}
            future = self._operations.get(msg.lora_result.op_id)
            if future is not None and not future.done():
                future.set_result(msg.lora_result)
        elif kind == "admin_result":
            self.sleep_level = msg.admin_result.sleep_level
            future = self._operations.get(msg.admin_result.op_id)
            if future is not None and not future.done():
                future.set_result(msg.admin_result)

    def _learn_lora_names(self, names) -> None:
        """A Pong's list is the truth; it carries names only, so paths stay from what we know."""
        if set(names) != set(self.lora_adapters):
            self.lora_adapters = {n: self.lora_adapters.get(n) or ipc.LoraAdapter(name=n) for n in names}

    def _on_welcome(self, welcome: ipc.Welcome) -> None:
        if self.welcome is not None and welcome.engine_id != self.welcome.engine_id:
            self._fail_streams("the engine restarted")
            self.stats, self.num_added_since_stats = ipc.EngineStats(), 0  # the old engine's load
        self.welcome = welcome
        self.lora_adapters = {a.name: a for a in welcome.lora_adapters}
        if not self.connected.is_set():
            self.draining = False
            log.info("connected to engine %s at %s (%s)", welcome.engine_id, self.address, welcome.model_name)
            self.connected.set()
            self.on_state(True)

    async def _monitor_loop(self, monitor) -> None:
        try:
            while True:
                event = parse_monitor_message(await monitor.recv_multipart())
                if event["event"] == zmq.EVENT_DISCONNECTED and self.connected.is_set():
                    self._lose("the engine closed its connection")
        finally:
            monitor.close(linger=0)

    async def _heartbeat_loop(self) -> None:
        while True:
            if self.said_bye and self.connected.is_set():
                await asyncio.sleep(self.heartbeat_s)
                continue
            self._seq += 1
            hello = ipc.Hello(frontend_id=self.frontend_id, address=self.grpc_address)
            msg = (ipc.EngineRequest(ping=ipc.Ping(seq=self._seq)) if self.connected.is_set()
                   else ipc.EngineRequest(hello=hello))
            try:
                await self._send(msg)
            except EngineLost:
                pass  # nobody to talk to yet; the silence check below handles it
            slept_from = time.monotonic()
            await asyncio.sleep(self.heartbeat_s)
            now = time.monotonic()
            if now - slept_from > 2 * self.heartbeat_s:
                # Our own loop stalled (a slow callback or import): no pings went out and the
                # engine's answers may sit unread. That silence is ours; give the engine a new clock.
                self._last_heard = now
            elif self.connected.is_set() and now - self._last_heard > self.timeout_s:
                self._lose("no answer from the engine for %.1fs" % self.timeout_s)

    def _lose(self, reason: str) -> None:
        log.error("engine lost: %s (%s)", reason, self.address)
        self.connected.clear()
        self.said_bye = False
        self.stats, self.num_added_since_stats = ipc.EngineStats(), 0  # none of it is true any more
        self.on_state(False)
        self._fail_streams(reason)

    def _fail_streams(self, reason: str) -> None:
        for inbox in self.streams.values():
            inbox.put(EngineLost(reason))
        for future in list(self._operations.values()):
            if not future.done():
                future.set_exception(EngineLost(reason))


_ERROR_CLASSES = {ipc.RequestError.KIND_OVERLOADED: EngineOverloaded, ipc.RequestError.KIND_NOT_FOUND: NotFound}
