"""EnginePool: the engines one frontend serves from (data parallel), one EngineClient each.

    --engine-address A --engine-address B        fixed engines
    --engine-dns HOST:PORT                       every A/AAAA record of HOST, re-resolved every
                                                 --engine-dns-interval-s (a headless Service)

Each engine has a state:

    connecting ──handshake──► ready ◄──► draining (its Pong says so, or DNS dropped it)
        │                       │
        └── refused             └── lost (silent or closed) ──handshake──► ready
            (its model facts disagree with the pool's)

Requests go only to ready engines whose circuit breaker lets them through; the router
(frontend/router.py) picks one. The first engine's handshake sets the facts (model, max
length, block size, vocabulary, eos ids) that every other engine must share: one that
disagrees is refused, with a log line that says why. An engine DNS no longer lists is
drained (no new requests; running ones finish) and then dropped.

An engine that sleeps (frontend/sleep.py) stays ready but gets no new requests until it wakes.

LoRA: a request for an adapter goes only to engines that list it (their handshake, Pongs and
LoraResults keep each client's list). An adapter loaded at run time through this frontend is
loaded on every engine (frontend/lora.py), and again on an engine that joins or restarts
without it.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from common.errors import Unavailable
from common.multimodal import ImageInput, with_images
from common.prefix_hash import block_extra_keys
from common.v1 import engine_ipc_pb2 as ipc
from frontend.engine_client import EngineClient
from frontend.router import CircuitBreaker, EngineView, RoutingPolicy, prompt_block_hashes

log = logging.getLogger("pagedserve.frontend")
_AGREED_FACTS = ("model_name", "max_model_len", "block_size", "vocab_size", "eos_token_ids", "lora_enabled",
                 "max_lora_rank")
RESTORE_TIMEOUT_S = 120.0  # loading an adapter reads its weights from disk
# This frontend process's id at every engine (its ZeroMQ identity, and Hello.frontend_id): made
# once, so a frontend that reconnects is the same frontend to the engine, not one more.
FRONTEND_ID = uuid.uuid4().hex


class EngineState(enum.Enum):
    CONNECTING = "connecting"
    READY = "ready"
    DRAINING = "draining"
    LOST = "lost"
    REFUSED = "refused"


@dataclass
class PooledEngine:
    """One engine of the pool, with what the frontend counts about it."""

    client: EngineClient
    breaker: CircuitBreaker = field(default_factory=CircuitBreaker)
    static: bool = False  # given by --engine-address: DNS never removes it
    removed: bool = False  # DNS no longer lists it: drain, then drop
    refused: str = ""  # why its handshake disagrees with the pool's; "" when it agrees
    ever_connected: bool = False
    num_routed: int = 0
    num_prefix_hits: int = 0  # requests sent here for a cached prefix
    num_prefix_hit_tokens: int = 0  # the tokens those prefixes cover
    num_retries: dict[str, int] = field(default_factory=dict)  # by reason: lost, overloaded

    @property
    def address(self) -> str:
        return self.client.address

    @property
    def state(self) -> EngineState:
        if not self.client.connected.is_set():
            return EngineState.LOST if self.ever_connected else EngineState.CONNECTING
        if self.refused:
            return EngineState.REFUSED
        if self.removed or self.client.draining:
            return EngineState.DRAINING
        return EngineState.READY

    def view(self) -> EngineView:
        stats, welcome = self.client.stats, self.client.welcome
        total = stats.kv_blocks_total or (welcome.kv_blocks_total if welcome is not None else 0)
        usage = 1 - stats.kv_blocks_free / total if stats.kv_blocks_total else 0.0
        num_requests = stats.num_running + stats.num_waiting + self.client.num_added_since_stats
        return EngineView(self.address, max(num_requests, len(self.client.streams)), total, usage)


class EnginePool:
    def __init__(self, policy: RoutingPolicy, frontend_id: str, grpc_address: str = "",
                 heartbeat_s: float = 0.5, timeout_s: float = 3.0,
                 on_change: Callable[[], None] | None = None,
                 on_welcome: Callable[[ipc.Welcome], None] | None = None) -> None:
        self.policy = policy
        self.frontend_id, self.grpc_address = frontend_id, grpc_address
        self.heartbeat_s, self.timeout_s = heartbeat_s, timeout_s
        self.on_change = on_change or (lambda: None)
        self.on_welcome = on_welcome or (lambda welcome: None)  # each accepted handshake
        self.engines: dict[str, PooledEngine] = {}  # by address, in the order they came
        self.welcome: ipc.Welcome | None = None  # the first accepted handshake: the pool's facts
        self.runtime_loras: dict[str, str] = {}  # adapters loaded at run time through us: name -> path
        self._tasks: list[asyncio.Task] = []
        self._started = False

    # -- membership ----------------------------------------------------------------

    async def start(self, addresses: list[str], dns: str | None = None, dns_interval_s: float = 5.0) -> None:
        self._started = True
        for address in addresses:
            await self.add(address)
            self.engines[address].static = True
        if dns is not None:
            self._tasks.append(asyncio.create_task(self._resolve_loop(dns, dns_interval_s)))
        self._tasks.append(asyncio.create_task(self._watch_loop()))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(*(e.client.close() for e in self.engines.values()))

    async def add(self, address: str) -> None:
        engine = self.engines.get(address)
        if engine is not None:
            engine.removed = False  # DNS lists it again
            return
        client = EngineClient(address, self.frontend_id, self.grpc_address, self.heartbeat_s, self.timeout_s,
                              on_state=lambda connected: self._on_state(address, connected))
        self.engines[address] = PooledEngine(client)
        log.info("engine %s added", address)
        if self._started:
            await client.start()

    def remove(self, address: str) -> None:
        """Route nothing new to it; drop it once nothing of ours runs there. An engine also
        given by --engine-address stays."""
        engine = self.engines.get(address)
        if engine is not None and not engine.removed and not engine.static:
            engine.removed = True
            log.info("engine %s removed: draining %d requests", address, len(engine.client.streams))
            self._drop_if_idle(engine)
            self.on_change()

    def _drop_if_idle(self, engine: PooledEngine) -> None:
        if engine.removed and not engine.client.streams and self.engines.get(engine.address) is engine:
            del self.engines[engine.address]
            self.policy.forget(engine.address)
            asyncio.ensure_future(engine.client.close())
            log.info("engine %s dropped", engine.address)

    async def _resolve_loop(self, dns: str, interval_s: float) -> None:
        host, port = dns.rsplit(":", 1)
        host = host.strip("[]")
        known: set[str] = set()
        while True:
            try:
                infos = await asyncio.get_running_loop().getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
                found = {_zmq_address(info[4][0], port) for info in infos}
            except OSError as e:  # keep what we have: a DNS hiccup must not drop healthy engines
                log.warning("could not resolve %s: %s; keeping %d engines", dns, e, len(known))
            else:
                for address in sorted(found - known):
                    await self.add(address)
                for address in sorted(known - found):
                    self.remove(address)
                known = found
            await asyncio.sleep(interval_s)

    async def _watch_loop(self) -> None:
        """States that heartbeats change (an engine starts draining) reach `on_change`; a draining
        engine waits for its frontends to leave, so once nothing of ours runs there, we leave."""
        states: dict[str, EngineState] = {}
        while True:
            await asyncio.sleep(self.heartbeat_s)
            now = {address: e.state for address, e in self.engines.items()}
            if now != states:
                states = now
                self.on_change()
            for engine in list(self.engines.values()):
                client = engine.client
                if client.draining and not client.streams and not client.said_bye and client.connected.is_set():
                    log.info("engine %s is draining and runs nothing of ours: saying bye", engine.address)
                    await client.say_bye()

    def _on_state(self, address: str, connected: bool) -> None:
        engine = self.engines.get(address)
        if engine is None:
            return
        self.policy.forget(address)  # lost or restarted: its prefix cache is gone
        if connected:
            engine.ever_connected = True
            engine.refused = self._disagreement(engine.client.welcome)
            if engine.refused:
                log.error("refused engine %s: %s", address, engine.refused)
            else:
                self.on_welcome(engine.client.welcome)
                self._restore_loras(engine)
        else:
            engine.breaker.record_failure(time.monotonic())
        self.on_change()

    def _disagreement(self, welcome: ipc.Welcome) -> str:
        if self.welcome is None:
            self.welcome = welcome
            return ""
        for name in _AGREED_FACTS:
            ours, theirs = getattr(self.welcome, name), getattr(welcome, name)
            if ours != theirs:
                return (f"its {name} is {_show(theirs)} but the pool's is {_show(ours)} "
                        f"(every engine behind one frontend must serve the same model the same way)")
        return ""

    def _restore_loras(self, engine: PooledEngine) -> None:
        """An engine that joined or restarted lacks what was loaded at run time: load it there
        too (its LoraResult updates the client's list; until then nothing of it routes there)."""
        for name, path in self.runtime_loras.items():
            if name not in engine.client.lora_adapters:
                log.info("loading LoRA adapter %s on engine %s, which joined without it", name, engine.address)
                load = ipc.LoadLora(op_id=uuid.uuid4().hex, name=name, path=path)
                asyncio.ensure_future(_send_quietly(engine, ipc.EngineRequest(load_lora=load)))

    # -- routing -------------------------------------------------------------------

    def lora_adapters(self) -> dict[str, ipc.LoraAdapter]:
        """Every adapter some answering engine has, by name."""
        adapters: dict[str, ipc.LoraAdapter] = {}
        for engine in self.serving():
            for name, adapter in engine.client.lora_adapters.items():
                if adapter.path or name not in adapters:  # a Pong-learnt entry has no path
                    adapters[name] = adapter
        return adapters

    def min_kv_blocks(self) -> int:
        """The smallest KV pool among the engines that agree with the pool (0 if none): a prompt
        must fit every engine it may be routed to."""
        return min((e.client.welcome.kv_blocks_total for e in self.serving()), default=0)

    @property
    def num_ready(self) -> int:
        return sum(1 for e in self.engines.values() if e.state is EngineState.READY)

    @property
    def asleep(self) -> bool:
        """Every ready engine sleeps (frontend/sleep.py): new requests get Unavailable until one
        wakes. An asleep engine still counts as ready for health: sleep is an admin's choice."""
        ready = [e for e in self.engines.values() if e.state is EngineState.READY]
        return bool(ready) and all(e.client.sleep_level for e in ready)

    def serving(self) -> list[PooledEngine]:
        """Engines that agree with the pool and answer (ready or draining)."""
        return [e for e in self.engines.values() if e.state in (EngineState.READY, EngineState.DRAINING)]

    def route(self, prompt: list[int], exclude: set[str] = frozenset(), lora_name: str = "",
              images: list[ImageInput] = ()) -> PooledEngine | None:
        """The engine for this request, or None if none may take it. Engines whose breaker is
        open are skipped while another can take it: with no other, trying one beats refusing.
        A request for an adapter goes only to engines that have it. `images`: the prompt's,
        whose hashes are in the engines' block keys."""
        now = time.monotonic()
        ready = [e for e in self.engines.values() if e.state is EngineState.READY and e.address not in exclude
                 and not e.client.sleep_level and (not lora_name or lora_name in e.client.lora_adapters)]
        candidates = [e for e in ready if e.breaker.available(now)] or ready
        if not candidates:
            return None
        hashes = (prompt_block_hashes(prompt, self.welcome.block_size,
                                      with_images(_extra_keys(candidates, lora_name), images))
                  if self.policy.needs_block_hashes and self.welcome is not None else [])
        route = self.policy.choose([e.view() for e in candidates], hashes)
        engine = self.engines[route.address]
        engine.breaker.on_routed(now)
        engine.num_routed += 1
        if route.num_matched_blocks:
            engine.num_prefix_hits += 1
            engine.num_prefix_hit_tokens += route.num_matched_blocks * self.welcome.block_size
        return engine

    def record_success(self, engine: PooledEngine) -> None:
        engine.breaker.record_success()

    def record_overload(self, engine: PooledEngine) -> None:
        """It refused a request as overloaded (a loss counts once, when the link goes)."""
        engine.breaker.record_failure(time.monotonic())

    def record_retry(self, engine: PooledEngine, reason: str) -> None:
        """A request left this engine for another, because it was `lost` or `overloaded`."""
        engine.num_retries[reason] = engine.num_retries.get(reason, 0) + 1

    def release(self, engine: PooledEngine) -> None:
        """A request of ours ended on this engine."""
        self._drop_if_idle(engine)


def _extra_keys(engines: list[PooledEngine], lora_name: str) -> tuple:
    """The engines' prefix-cache keys for the adapter: its name and their path to it (which a
    Pong does not carry: an adapter learnt only from Pongs hashes with no path, and its
    prefixes route as if uncached; correct, only less sticky)."""
    if not lora_name:
        return ()
    path = next((e.client.lora_adapters[lora_name].path for e in engines
                 if e.client.lora_adapters[lora_name].path), "")
    return block_extra_keys(lora_name, path)


async def _send_quietly(engine: PooledEngine, request: ipc.EngineRequest) -> None:
    try:
        result = await asyncio.wait_for(await engine.client.operation(request), RESTORE_TIMEOUT_S)
    except (Unavailable, asyncio.TimeoutError) as e:
        log.warning("could not restore a LoRA adapter on engine %s: %s", engine.address, e)
        return
    if result.kind not in (ipc.LoraResult.KIND_OK, ipc.LoraResult.KIND_CONFLICT):
        log.warning("engine %s refused a LoRA adapter it lacked: %s", engine.address, result.message)


def _zmq_address(ip: str, port: str) -> str:
    return f"tcp://[{ip}]:{port}" if ":" in ip else f"tcp://{ip}:{port}"


def _show(value) -> str:
    return repr(list(value)) if not isinstance(value, (str, int)) else repr(value)
