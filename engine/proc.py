"""EngineProc: an EngineCore behind a ZeroMQ ROUTER socket, in its own process.

    frontends (DEALER) ──tcp/ipc──► ROUTER ─ I/O thread ─┬─► input queue ─► main loop: step()
                                                       ◄─┴── inproc PULL ◄── outputs, per frontend

The I/O thread owns the socket (ZeroMQ sockets are single-threaded): it decodes requests,
answers Hello and Ping itself (so heartbeats are answered even during a long step), and
sends what the main loop produced. The main loop only runs steps; torch releases the GIL,
so socket work overlaps the model. Requests are namespaced by frontend id, so two frontends
may reuse the same request ids.

Shutdown: `begin_drain()` (the first SIGTERM) keeps serving until every frontend it had then
has said Bye or gone silent and nothing is left running, or until the drain timeout, whatever
keeps connecting; `stop()` (a second signal) stops at once.

A frontend is known by its id (its ZeroMQ identity, generated once per frontend process): a
Hello from an id seen before is that frontend reconnecting, not one more frontend.
"""

from __future__ import annotations

import logging
import queue
import re
import threading
import time
import uuid
import zlib
from collections import OrderedDict, defaultdict
from dataclasses import dataclass, field

import zmq

from common.errors import EngineOverloaded, InvalidRequest, LoraError
from common.ipc import (add_plain_tokens, bad_words_from_proto, image_from_proto, is_plain_token, output_to_proto,
                        pooler_to_proto, sampling_defaults_to_proto, sampling_params_from_proto, structured_from_proto)
from common.multimodal import MAX_PIXEL_BYTES, ImageInput
from common.outputs import EngineCoreOutput, PlainTokens
from common.pooling_params import PoolingParams
from common.sampling_params import SamplingParams
from common.v1 import engine_ipc_pb2 as ipc, info_pb2
from engine.core import EngineCore, EngineStats
from engine.metrics import EngineMetrics
from engine.models.loader import weight_format
from engine.vision import multimodal_info

log = logging.getLogger("pagedserve.engine")

FRONTEND_TIMEOUT_S = 10.0  # a frontend silent this long is gone: abort its requests
NUM_REMEMBERED_FRONTENDS = 1024  # ids kept after a frontend leaves, to tell a reconnect from a new one
# Far above any real message (a max-length prompt is ~40 KB, a request's images at most
# MAX_PIXEL_BYTES); ZeroMQ drops the connection of a peer that sends more, before the bytes
# are held in memory.
MAX_MESSAGE_BYTES = MAX_PIXEL_BYTES + 16 * 2**20
_FRONTEND_ID = re.compile(r"[0-9A-Za-z_-]{1,64}")
_OUTPUTS_INPROC = "inproc://engine-outputs"


@dataclass
class _Frontend:
    identity: bytes
    address: str
    # It said Hello after the drain began: nothing of it ran here before, so the drain does not
    # wait for it (a stray that keeps reconnecting cannot hold the engine up).
    joined_draining: bool = False
    last_seen: float = field(default_factory=time.monotonic)


@dataclass(slots=True)
class _AbortFrontend:
    """Abort everything a frontend has running (it vanished or restarted)."""

    frontend_id: str


@dataclass(slots=True)
class _Add:
    core_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    lora_name: str = ""
    pooling: PoolingParams | None = None  # a pooling request (embed, score)
    images: list[ImageInput] = field(default_factory=list)  # its prompt's (vision-language models)


@dataclass(slots=True)
class _LoraOp:
    """LoadLora or UnloadLora, run by the main loop between steps (it owns the core)."""

    frontend_id: str
    msg: ipc.LoadLora | ipc.UnloadLora


@dataclass(slots=True)
class _AdminOp:
    """Sleep, WakeUp or UpdateWeights, run by the main loop between steps (engine/sleep_mode.py)."""

    frontend_id: str
    msg: ipc.AdminOp


class EngineProc:
    def __init__(self, core: EngineCore, address: str, model_name: str,
                 metrics: EngineMetrics | None = None, drain_timeout_s: float = 30.0,
                 tokenizer_files: dict[str, bytes] | None = None) -> None:
        self.core = core
        self.address = address
        self.metrics = metrics  # None: no metrics port; the core then collects no stats
        self.drain_timeout_s = drain_timeout_s
        self.drain_deadline: float | None = None  # set by begin_drain()
        self.last_progress_s = time.monotonic()  # the main loop's heartbeat, for liveness probes
        self.engine_id = uuid.uuid4().hex[:12]
        self.welcome = self._welcome(model_name, tokenizer_files or {})
        # The adapters loaded now, replaced (never mutated) by the main loop; the I/O thread
        # reads it for Welcome and Pong.
        self.lora_adapters: tuple[ipc.LoraAdapter, ...] = _adapters_to_proto(core.lora_adapters())
        self.inputs: queue.Queue = queue.Queue()
        self.frontends: dict[str, _Frontend] = {}  # by frontend id; touched by the I/O thread only
        self.seen_frontends: OrderedDict[str, None] = OrderedDict()  # ids that said Hello, newest last; I/O thread
        self.stats = _stats_to_proto(core.stats())  # latest, replaced (never mutated) by the main loop
        self.sleep_level = 0  # the core's, set by the main loop; the I/O thread reads it for Pong
        self.stopping = threading.Event()
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 0)  # drop replies to vanished frontends
        self.router.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        self.router.bind(address)
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.bind(_OUTPUTS_INPROC)
        self.push = self.ctx.socket(zmq.PUSH)  # main thread's end
        self.push.connect(_OUTPUTS_INPROC)
        self.io_thread = threading.Thread(target=self._io_loop, name="engine-io", daemon=True)

    # -- main thread ---------------------------------------------------------------

    def run(self) -> None:
        """Serve until `stop()`; returns after closing the sockets."""
        self.io_thread.start()
        log.info("engine %s listening on %s", self.engine_id, self.address)
        try:
            while not self.stopping.is_set():
                self.last_progress_s = time.monotonic()
                self._drain_inputs(block=not self.core.has_unfinished_requests())
                outputs, plain = self.core.step_packed() if self.core.has_unfinished_requests() else ([], None)
                snapshot = self.core.stats()
                self.stats = _stats_to_proto(snapshot)
                if self.metrics is not None:  # first: a client that has a step's tokens sees its metrics
                    self.metrics.record(snapshot, self.core.take_iteration_stats())
                self._publish(outputs, plain)
                if self._drained():
                    break
        finally:
            self.stopping.set()
            self.io_thread.join(timeout=5)
            for sock in (self.push, self.pull, self.router):
                sock.close(linger=0)
            self.ctx.term()

    def stop(self) -> None:
        self.stopping.set()
        self.inputs.put(None)  # wake a blocked main loop

    def begin_drain(self) -> None:
        """Finish what the frontends have running, then stop (see the module docstring)."""
        self.drain_deadline = time.monotonic() + self.drain_timeout_s
        log.info("draining: stopping once every frontend is gone and nothing runs (at most %.0fs)",
                 self.drain_timeout_s)
        self.inputs.put(None)

    def on_signal(self) -> None:
        """First SIGTERM/SIGINT drains, a second one stops at once."""
        if self.drain_deadline is None:
            self.begin_drain()
        else:
            self.stop()

    def _drained(self) -> bool:
        if self.drain_deadline is None:
            return False
        # list(): one copy under the GIL, as the I/O thread may change the dict meanwhile.
        waited_for = sum(not f.joined_draining for f in list(self.frontends.values()))
        if not waited_for and not self.core.has_unfinished_requests():
            log.info("drained: no frontend and no request left")
            return True
        if time.monotonic() > self.drain_deadline:
            log.warning("drain timeout: stopping with %d requests unfinished and %d frontends connected",
                        self.core.scheduler.num_unfinished, waited_for)
            return True
        return False

    def _drain_inputs(self, block: bool) -> None:
        """Apply what the I/O thread queued: the first item (waiting up to 0.5 s if `block`) and
        those queued behind it then, no more, so a peer that keeps sending cannot keep the loop
        from its next step or from the drain deadline."""
        try:
            first = self.inputs.get(timeout=0.5) if block else self.inputs.get_nowait()
        except queue.Empty:
            return
        items = [first] + [self.inputs.get_nowait() for _ in range(self.inputs.qsize())]  # we are the only reader
        for item in items:
            if item is not None:  # None only wakes the loop (stop, drain)
                self._apply(item)

    def _apply(self, item) -> None:
        if isinstance(item, _Add):
            try:
                if item.pooling is not None:
                    self.core.add_pooling_request(item.core_id, item.prompt_token_ids, item.pooling, item.priority)
                else:
                    self.core.add_request(item.core_id, item.prompt_token_ids, item.params, item.priority,
                                          lora_name=item.lora_name, images=item.images)
            except EngineOverloaded as e:
                self._reject(item.core_id, str(e), ipc.RequestError.KIND_OVERLOADED)
            except LoraError as e:  # an adapter this engine lacks (a frontend's stale list)
                kind = ipc.RequestError.KIND_NOT_FOUND if e.kind == "not_found" else ipc.RequestError.KIND_INVALID
                self._reject(item.core_id, str(e), kind)
            except InvalidRequest as e:  # the frontend validated, so this is rare (e.g. an id clash)
                self._reject(item.core_id, str(e), ipc.RequestError.KIND_INVALID)
        elif isinstance(item, _LoraOp):
            self._lora_op(item)
        elif isinstance(item, _AdminOp):
            self._admin_op(item)
        elif isinstance(item, _AbortFrontend):
            self.core.abort_requests_with_prefix(f"{item.frontend_id}:")
        else:  # (engine-side ids to abort, whether a stop string ended them)
            self.core.abort_requests(*item)

    def _lora_op(self, op: _LoraOp) -> None:
        msg = op.msg
        try:
            if isinstance(msg, ipc.LoadLora):
                self.core.load_lora(msg.name, msg.path)
            else:
                self.core.unload_lora(msg.name)
            kind, message = ipc.LoraResult.KIND_OK, ""
        except LoraError as e:
            kind, message = _LORA_KINDS[e.kind], str(e)
        self.lora_adapters = _adapters_to_proto(self.core.lora_adapters())
        result = ipc.LoraResult(op_id=msg.op_id, kind=kind, message=message, adapters=self.lora_adapters)
        self.push.send_multipart([op.frontend_id.encode(),
                                  ipc.EngineResponse(lora_result=result).SerializeToString()])

    def _admin_op(self, op: _AdminOp) -> None:
        msg, core = op.msg, self.core
        outputs, ok, message = [], True, ""
        try:
            if msg.kind == ipc.AdminOp.KIND_SLEEP:
                outputs = core.sleep(msg.level or 1)
            elif msg.kind == ipc.AdminOp.KIND_WAKE_UP:
                core.wake_up()
            else:
                outputs = core.update_weights(msg.model_path)
        except InvalidRequest as e:
            ok, message = False, str(e)
        except Exception as e:  # noqa: BLE001 - e.g. out of memory on wake: the engine stays up, and says so
            log.exception("admin operation %s failed", ipc.AdminOp.Kind.Name(msg.kind))
            ok, message = False, f"the engine failed: {type(e).__name__}: {e}"
        self.sleep_level, self.stats = core.sleep_level, _stats_to_proto(core.stats())  # the next Pong's
        self._publish(outputs, None)  # a step that was in flight (async scheduling)
        result = ipc.AdminResult(op_id=msg.op_id, ok=ok, message=message, sleep_level=self.sleep_level)
        self.push.send_multipart([op.frontend_id.encode(),
                                  ipc.EngineResponse(admin_result=result).SerializeToString()])

    def _publish(self, outputs: list[EngineCoreOutput], plain: PlainTokens | None) -> None:
        # One message per frontend per step: this runs in the step loop, for every request
        # every step. Most outputs are one plain token each (the core packs most of them,
        # EngineCore.step_packed), packed into three lists; the rest become RequestOutputs,
        # built in place (no copies).
        responses: dict[str, tuple[ipc.EngineResponse, PlainTokens]] = defaultdict(
            lambda: (ipc.EngineResponse(), PlainTokens()))
        if plain is not None:
            for core_id, token_id, num_cached in zip(plain.request_ids, plain.token_ids, plain.num_cached_tokens):
                frontend_id, request_id = core_id.split(":", 1)
                responses[frontend_id][1].add([request_id], [token_id], [num_cached])
        for out in outputs:
            frontend_id, request_id = out.request_id.split(":", 1)
            response, packed = responses[frontend_id]
            if is_plain_token(out):
                packed.add([request_id], out.new_token_ids, [out.num_cached_tokens])
            else:
                output_to_proto(out, request_id, response.outputs)
        for frontend_id, (response, packed) in responses.items():
            add_plain_tokens(response.outputs, packed)
            response.outputs.stats.CopyFrom(self.stats)
            self.push.send_multipart([frontend_id.encode(), response.SerializeToString()])

    def _reject(self, core_id: str, message: str, kind: int) -> None:
        frontend_id, request_id = core_id.split(":", 1)
        reply = ipc.EngineResponse(error=ipc.RequestError(request_id=request_id, message=message, kind=kind))
        self.push.send_multipart([frontend_id.encode(), reply.SerializeToString()])

    def _welcome(self, model_name: str, tokenizer_files: dict[str, bytes]) -> ipc.Welcome:
        core, cfg = self.core, self.core.config
        return ipc.Welcome(
            engine_id=self.engine_id, model_name=model_name,
            architecture=core.model_runner.arch.model_type, max_model_len=core.max_model_len,
            vocab_size=core.vocab_size, eos_token_ids=core.eos_token_ids, block_size=cfg.block_size,
            kv_blocks_total=core.block_manager.num_blocks, dtype=cfg.dtype, device=cfg.device,
            model_path=str(core.model_path),
            tokenizer_files={name: zlib.compress(data) for name, data in tokenizer_files.items()},
            lora_enabled=cfg.enable_lora, max_lora_rank=cfg.max_lora_rank if cfg.enable_lora else 0,
            max_loras=cfg.max_loras if cfg.enable_lora else 0,
            sampling_defaults=sampling_defaults_to_proto(core.sampling_defaults),
            pooler=pooler_to_proto(core.pooler, core.max_pooling_tokens),
            quantization=weight_format(core.model_path, cfg.quantization), multimodal=multimodal_info(core))

    # -- I/O thread ----------------------------------------------------------------

    def _io_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        poller.register(self.pull, zmq.POLLIN)
        while not self.stopping.is_set():
            for sock, _ in poller.poll(timeout=200):
                if sock is self.pull:
                    self.router.send_multipart(self.pull.recv_multipart())
                else:
                    self._on_frames(self.router.recv_multipart())
            self._expire_frontends()

    def _on_frames(self, frames: list[bytes]) -> None:
        """One message from a peer. Anything malformed is logged and dropped: the port may be
        reached by more than our frontends, and nothing a peer sends may stop the engine."""
        if len(frames) != 2:
            log.warning("dropped a message of %d frames from %r (expected 1)", len(frames) - 1, frames[0][:64])
            return
        identity, payload = frames
        try:
            msg = ipc.EngineRequest.FromString(payload)
        except Exception:  # noqa: BLE001 - protobuf raises several types on garbage
            log.warning("dropped an undecodable message (%d bytes) from %r", len(payload), identity[:64])
            return
        try:
            self._on_request(identity, msg)
        except Exception:  # noqa: BLE001 - a bug must cost one message, not the I/O thread
            log.exception("failed to handle a %s message from %r", msg.WhichOneof("kind"), identity[:64])

    def _on_request(self, identity: bytes, msg: ipc.EngineRequest) -> None:
        frontend_id = identity.decode(errors="replace")
        kind = msg.WhichOneof("kind")
        frontend = self.frontends.get(frontend_id)
        if frontend is not None:
            frontend.last_seen = time.monotonic()
        if kind == "hello":
            self._on_hello(identity, frontend_id, msg.hello)
        elif kind == "ping":
            self._reply(identity, ipc.EngineResponse(pong=ipc.Pong(
                seq=msg.ping.seq, stats=self.stats, engine_id=self.engine_id,
                draining=self.drain_deadline is not None,  # frontends stop routing new requests here
                lora_names=[a.name for a in self.lora_adapters], sleep_level=self.sleep_level,
                frontends=[info_pb2.Peer(id=i, address=f.address) for i, f in self.frontends.items()])))
        elif frontend is None:
            log.warning("request from unknown frontend %s ignored (no Hello yet)", frontend_id)
        elif kind == "add":
            self._on_add(frontend, frontend_id, msg.add)
        elif kind == "abort":
            self.inputs.put(([f"{frontend_id}:{r}" for r in msg.abort.request_ids], msg.abort.stop_string))
        elif kind in ("load_lora", "unload_lora"):
            self.inputs.put(_LoraOp(frontend_id, getattr(msg, kind)))
        elif kind == "admin":
            self.inputs.put(_AdminOp(frontend_id, msg.admin))
        elif kind == "bye":
            log.info("frontend %s said bye", frontend_id)
            del self.frontends[frontend_id]
            self.inputs.put(_AbortFrontend(frontend_id))

    def _on_hello(self, identity: bytes, frontend_id: str, hello: ipc.Hello) -> None:
        if not _FRONTEND_ID.fullmatch(frontend_id):  # it namespaces request ids with ":"
            log.warning("refused a Hello from the malformed identity %r", identity[:64])
            return
        if self.frontends.pop(frontend_id, None) is not None:  # it reconnected: old streams are gone
            self.inputs.put(_AbortFrontend(frontend_id))
        draining = self.drain_deadline is not None
        self.frontends[frontend_id] = _Frontend(identity, hello.address, joined_draining=draining)
        address = hello.address or "no address"
        if self._remember(frontend_id):
            log.info("frontend %s reconnected (%s)", frontend_id, address)
        else:
            log.info("frontend %s connected (%s); %d frontends", frontend_id, address, len(self.frontends))
        welcome = ipc.Welcome()
        welcome.CopyFrom(self.welcome)
        welcome.lora_adapters.extend(self.lora_adapters)  # the adapters now, not at start
        self._reply(identity, ipc.EngineResponse(welcome=welcome))

    def _remember(self, frontend_id: str) -> bool:
        """Whether this id said Hello before (it may have left since: Bye, silence); bounded, as
        any peer may send Hellos."""
        seen = frontend_id in self.seen_frontends
        self.seen_frontends[frontend_id] = None
        self.seen_frontends.move_to_end(frontend_id)
        if len(self.seen_frontends) > NUM_REMEMBERED_FRONTENDS:
            self.seen_frontends.popitem(last=False)
        return seen

    def _on_add(self, frontend: _Frontend, frontend_id: str, add: ipc.AddRequest) -> None:
        # ":" separates the namespace; frontends' ids never contain one.
        core_id = f"{frontend_id}:{add.request_id}"
        try:
            params = sampling_params_from_proto(
                add.sampling, structured_outputs=structured_from_proto(add.structured_outputs),
                bad_words_token_ids=bad_words_from_proto(add))
        except InvalidRequest as e:
            self._reply(frontend.identity, ipc.EngineResponse(
                error=ipc.RequestError(request_id=add.request_id, message=str(e),
                                       kind=ipc.RequestError.KIND_INVALID)))
            return
        pooling = PoolingParams(add.pooling.token_type_start) if add.HasField("pooling") else None
        try:
            images = [image_from_proto(im) for im in add.images]
        except InvalidRequest as e:
            self._reply(frontend.identity, ipc.EngineResponse(
                error=ipc.RequestError(request_id=add.request_id, message=str(e),
                                       kind=ipc.RequestError.KIND_INVALID)))
            return
        self.inputs.put(_Add(core_id, list(add.prompt_token_ids), params, add.priority, add.lora_name, pooling,
                             images))

    def _expire_frontends(self) -> None:
        now = time.monotonic()
        for frontend_id, f in list(self.frontends.items()):
            if now - f.last_seen > FRONTEND_TIMEOUT_S:
                log.warning("frontend %s silent for %.0fs: aborting its requests",
                            frontend_id, now - f.last_seen)
                del self.frontends[frontend_id]
                self.inputs.put(_AbortFrontend(frontend_id))

    def _reply(self, identity: bytes, msg: ipc.EngineResponse) -> None:
        self.router.send_multipart([identity, msg.SerializeToString()])


_LORA_KINDS = {"invalid": ipc.LoraResult.KIND_INVALID, "not_found": ipc.LoraResult.KIND_NOT_FOUND,
               "conflict": ipc.LoraResult.KIND_CONFLICT}


def _adapters_to_proto(adapters) -> tuple[ipc.LoraAdapter, ...]:
    return tuple(ipc.LoraAdapter(name=a.name, path=a.path, rank=a.rank) for a in adapters)


def _stats_to_proto(s: EngineStats) -> ipc.EngineStats:
    return ipc.EngineStats(
        num_running=s.num_running, num_waiting=s.num_waiting, kv_blocks_total=s.num_kv_blocks,
        kv_blocks_free=s.num_free_kv_blocks, num_preemptions=s.num_preemptions,
        prefix_cache_queries=s.num_prefix_cache_queries, prefix_cache_hits=s.num_prefix_cache_hits,
        kv_offload_hits=s.num_kv_offload_hits, kv_offload_saved_bytes=s.kv_offload_saved_bytes,
        kv_offload_restored_bytes=s.kv_offload_restored_bytes, kv_offload_restore_seconds=s.kv_offload_restore_s)
