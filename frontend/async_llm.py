"""AsyncLLM: what every API of the frontend calls to run a request (vLLM v1's AsyncLLM).

    API (gRPC servicer, HTTP route)                 AsyncLLM                       engine
      parse its own fields ──► input processor ──► admit() ──► generate() ── AddRequest ──►
                                                                 ▲ deltas   ◄── outputs ───
                                                          RequestState (output processor)

It owns admission (draining, engine present, concurrency, one check of the prompt), the
engine pool, and each request's output state. A request that has received nothing yet from
its engine when that engine is lost or answers "overloaded" moves to another engine; one that
has, ends (UNAVAILABLE), since its client may have seen tokens already. The APIs only translate: their fields to
`SamplingParams` and a prompt, `SampleDelta`s to their messages, and the typed errors
(`InvalidRequest`, `EngineOverloaded`, `Unavailable`) to their status codes.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
import weakref
import zlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from common.errors import EngineOverloaded, InvalidRequest, Unavailable
from common.ipc import (bad_words_to_proto, image_to_proto, output_from_proto, sampling_defaults_from_proto,
                        sampling_params_to_proto, structured_to_proto)
from common.multimodal import ImageInput
from common.outputs import plain_output
from common.sampling_params import SamplingParams
from common.v1 import engine_ipc_pb2 as ipc
from common.validation import PromptLimits
from frontend.engine_client import EngineLost, Inbox
from frontend.engine_pool import EnginePool, PooledEngine
from frontend.harmony import encoding as harmony_encoding
from frontend.input_processor import InputProcessor, NotFound
from frontend.multimodal import DEFAULT_MAX_IMAGES
from frontend.multimodal.processor import MultiModalProcessor
from frontend.output_processor import ABORT, TIME_LIMIT, RequestState, SampleDelta
from frontend.pooling import PooledInput, PoolingState, require_task
from frontend.tokenizer import Tokenizer

log = logging.getLogger("pagedserve.frontend")
ASLEEP = "the server is asleep (an admin put it to sleep: POST /wake_up wakes it); retry later"
_ABORTED = object()  # queued by abort(): the caller asked to stop it
_TIME_LIMIT = object()  # the request's time limit ran out
_ERRORS = (EngineLost, EngineOverloaded, InvalidRequest)  # queued by the engine client (NotFound is one)
_RETRIED = (EngineLost, EngineOverloaded, NotFound)  # another engine may take it


@dataclass
class Generation:
    """One admitted request. `request_id` is the caller's; the engine sees a fresh
    `engine_id`, so a late token of an aborted request never reaches a new one with the same id."""

    request_id: str
    state: RequestState | PoolingState
    priority: int = 0
    lora_name: str = ""  # its LoRA adapter; "" for the base model
    images: list[ImageInput] = field(default_factory=list)  # its prompt's (frontend/multimodal)
    arrival: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None  # time.monotonic() of the first token
    inbox: Inbox | None = None  # its outputs, while it runs on an engine
    engine: PooledEngine | None = None  # where it runs now
    received: bool = False  # an output came: it can no longer move to another engine

    @property
    def engine_id(self) -> str:
        return self.state.engine_id

    @property
    def done(self) -> bool:
        return self.state.done

    def summary(self) -> dict[str, object]:
        """For the request log: token counts and how each sample ended."""
        reasons = [s.finish_reason or "none" for s in self.state.samples]
        return {"finish_reason": ",".join(reasons), "prompt_tokens": len(self.state.prompt),
                "cached_tokens": self.state.num_cached_tokens,
                "completion_tokens": self.state.num_completion_tokens, "n": len(reasons)}


class AsyncLLM:
    def __init__(self, pool: EnginePool | None, max_concurrent_streams: int, tokenizer_path: str | None = None,
                 harmony: bool | None = None, max_images: int = DEFAULT_MAX_IMAGES) -> None:
        self.pool = pool
        self.max_images = max_images  # per prompt (--limit-mm-per-prompt)
        self.harmony = harmony  # chat in harmony (frontend/harmony): None: where the model speaks it
        self.max_concurrent_streams = max_concurrent_streams
        self.tokenizer_path = tokenizer_path  # --tokenizer: overrides the engine's
        self.input: InputProcessor | None = None  # from the first handshake on
        self.draining = False  # shutting down: refuse new requests, let running ones finish
        self.active: dict[str, Generation] = {}  # by the caller's request id
        # Admitted but not running yet (an HTTP response starts its generations later, or an
        # n-prompt request admits n at once): they hold a slot too. Weak, so that one never
        # run (its client left first) gives its slot back when it is dropped.
        self.admitted: weakref.WeakValueDictionary[str, Generation] = weakref.WeakValueDictionary()  # by engine_id
        # encode() calls running, by the caller's request id: one slot each, however many
        # inputs (engine requests) they run; those are not in `active`.
        self.encoding: dict[str, list[Generation]] = {}
        self.http_address = ""  # for the ready line, once the HTTP API listens

    @property
    def num_running(self) -> int:
        """Stream slots taken: running, admitted and encoding calls."""
        return len(self.active) + len(self.admitted) + len(self.encoding)

    @property
    def tokenizer(self):
        return self.input.tokenizer if self.input is not None else None

    @property
    def welcome(self) -> ipc.Welcome | None:
        """The model facts every engine of the pool agrees on."""
        return self.pool.welcome

    @property
    def ready(self) -> bool:
        return self.pool.num_ready > 0 and self.input is not None and not self.draining

    def on_welcome(self, welcome: ipc.Welcome) -> None:
        """Each handshake: the model's limits (a restarted engine may have another KV pool;
        with several engines, the smallest pool decides what fits) and sampling defaults; the
        tokenizer only once."""
        limits = PromptLimits(welcome.vocab_size, welcome.max_model_len,
                              self.pool.min_kv_blocks() or welcome.kv_blocks_total, welcome.block_size)
        if self.input is None:
            tokenizer = _load_tokenizer(welcome, self.tokenizer_path)
            multimodal = MultiModalProcessor(welcome.multimodal, tokenizer) if welcome.HasField("multimodal") else None
            self.input = InputProcessor(tokenizer, limits, lambda: self.pool.lora_adapters().keys(),
                                        harmony=harmony_encoding.for_model(welcome.architecture, tokenizer, self.harmony),
                                        multimodal=multimodal, max_images=self.max_images)
        self.input.limits = limits
        self.input.sampling_defaults = sampling_defaults_from_proto(welcome.sampling_defaults)

    def require_engine(self) -> InputProcessor:
        """For calls that need the model but start no generation (tokenize, model info)."""
        if not self.pool.serving() or self.input is None:
            raise Unavailable("no engine connected; retry shortly")
        return self.input

    def require_ready(self, generates: bool = True) -> InputProcessor:
        """For a new request: a ready engine, and not draining; with `generates`, a model that
        generates (a pooling model's 400 names the task it serves, before any prompt work)."""
        if self.draining:
            raise Unavailable("server is shutting down; retry on another replica")
        processor = self.require_engine()
        if not self.pool.num_ready:
            raise Unavailable("no engine ready (every engine is draining or refused); retry shortly")
        if self.pool.asleep:
            raise Unavailable(ASLEEP)
        if generates:
            require_task(self.welcome.pooler, "generate")
        return processor

    def admit(self, prompt: list[int], params: SamplingParams, request_id: str | None = None,
              priority: int = 0, prompt_field: str = "prompt", lora_name: str = "",
              images: list[ImageInput] = ()) -> Generation:
        """Check everything that can be checked before a response starts. `images`: the
        prompt's (InputProcessor.chat_prompt)."""
        processor = self.require_ready()
        processor.check_lora(lora_name)
        processor.check(prompt, params, prompt_field)
        if not -2**31 <= priority < 2**31:  # the engine's wire type (gRPC's is int32 already; JSON's is not)
            raise InvalidRequest(f"priority: must be in [{-2**31}, {2**31 - 1}], got {priority}")
        request_id = self._admit_id(request_id)
        state = RequestState(uuid.uuid4().hex, prompt, params, processor.tokenizer,
                             self.welcome.eos_token_ids)
        gen = Generation(request_id, state, priority, lora_name, list(images))
        self.admitted[gen.engine_id] = gen
        return gen

    def _admit_id(self, request_id: str | None) -> str:
        """The request's id, once it is known to be free and a stream slot is left."""
        request_id = request_id or uuid.uuid4().hex
        if request_id in self.active or request_id in self.encoding:
            raise InvalidRequest(f"request_id {request_id!r} is already in use by a running request")
        num_running = self.num_running
        if num_running >= self.max_concurrent_streams:
            raise EngineOverloaded(f"server busy: {num_running} requests running "
                                   f"(--max-concurrent-streams {self.max_concurrent_streams}); retry later")
        return request_id

    async def encode(self, inputs: list[PooledInput], request_id: str | None = None,
                   priority: int = 0) -> list[list[float]]:
        """Run pooling requests (embed, score; frontend/pooling.py), one per input, batched
        by the engine's scheduler: their vectors, in input order. The caller checked the task
        and the inputs; the whole call takes one stream slot, each input one engine request."""
        request_id = self._admit_id(request_id)
        gens = [Generation(f"{request_id}/{i}", PoolingState(uuid.uuid4().hex, item), priority)
                for i, item in enumerate(inputs)]
        self.encoding[request_id] = gens

        async def run(gen: Generation) -> list[float]:
            async for _ in self.generate(gen):
                pass
            if gen.state.vector is None:  # aborted on the way (the server is stopping)
                raise Unavailable("the engine ended the request before it ran; retry")
            return gen.state.vector

        try:
            async with asyncio.TaskGroup() as group:  # one failure cancels the rest (and aborts them)
                tasks = [group.create_task(run(gen)) for gen in gens]
        except ExceptionGroup as e:  # the first error is the caller's (its status code)
            raise e.exceptions[0] from None
        finally:
            del self.encoding[request_id]
        return [t.result() for t in tasks]

    async def generate(self, gen: Generation, time_limit_s: float | None = None
                       ) -> AsyncIterator[list[SampleDelta]]:
        """Run an admitted request; yields the deltas that arrived together (several tokens
        per sample under load). Leaving early (cancel, disconnect) stops it in the engine."""
        self.admitted.pop(gen.engine_id, None)
        tracked = not isinstance(gen.state, PoolingState)  # an encode() call holds the slot of its inputs
        if tracked:
            self.active[gen.request_id] = gen
        deadline = None if time_limit_s is None else time.monotonic() + time_limit_s
        tried: set[str] = set()
        failed: tuple[PooledEngine, Exception] | None = None  # the last attempt's engine and error
        try:
            while True:
                engine = self.pool.route(gen.state.prompt, tried, gen.lora_name, gen.images)
                if engine is None:  # the last engine's error says most (RESOURCE_EXHAUSTED or UNAVAILABLE)
                    raise failed[1] if failed else self._no_engine(gen)
                if failed:
                    self.pool.record_retry(failed[0], _reason(failed[1]))
                    log.info("request %s: engine %s %s; retrying on %s", gen.request_id, failed[0].address,
                             _reason(failed[1]), engine.address)
                try:
                    async for deltas in self._run_on(engine, gen, deadline):
                        yield deltas
                    return
                except _RETRIED as e:
                    if isinstance(e, EngineOverloaded):
                        self.pool.record_overload(engine)
                    if gen.received:
                        raise
                    tried.add(engine.address)
                    failed = (engine, e)
        finally:
            if tracked:
                del self.active[gen.request_id]

    async def _run_on(self, engine: PooledEngine, gen: Generation, deadline: float | None
                      ) -> AsyncIterator[list[SampleDelta]]:
        client, engine_id = engine.client, gen.engine_id
        gen.engine, gen.inbox = engine, client.open_stream(engine_id)
        try:
            if isinstance(gen.state, PoolingState):
                add = gen.state.add_request()
                add.priority = gen.priority
            else:
                params = gen.state.params
                add = ipc.AddRequest(
                    request_id=engine_id, prompt_token_ids=gen.state.prompt, sampling=sampling_params_to_proto(params),
                    priority=gen.priority, structured_outputs=structured_to_proto(params.structured_outputs),
                    lora_name=gen.lora_name, bad_words_token_ids=bad_words_to_proto(params),
                    images=[image_to_proto(im) for im in gen.images])
            await client.add(add)
            while not gen.done:
                items = await _next(gen.inbox, deadline)
                deltas = self._handle(gen, items)
                if deltas:
                    yield deltas
            self.pool.record_success(engine)
        finally:
            client.close_stream(engine_id)
            if not gen.done:  # cancelled, disconnected or failed: free its blocks
                self._abort_later(engine, [engine_id])
            self.pool.release(engine)

    def _no_engine(self, gen: Generation) -> Exception:
        if gen.lora_name and gen.lora_name not in self.pool.lora_adapters():  # unloaded since admit()
            return NotFound(f"the LoRA adapter `{gen.lora_name}` does not exist (any more)")
        return Unavailable(ASLEEP if self.pool.asleep else "no engine available; retry shortly")

    def abort(self, request_ids: list[str]) -> list[bool]:
        """Stop running requests by the caller's id; their streams end with reason "abort".
        True for each id that was running."""
        found = []
        for request_id in request_ids:
            gen = self.active.get(request_id)
            if gen is None or gen.inbox is None or gen.done:
                found.append(False)
                continue
            gen.inbox.put(_ABORTED)
            self._abort_later(gen.engine, [gen.engine_id])
            found.append(True)
        return found

    def _handle(self, gen: Generation, items: list) -> list[SampleDelta]:
        if len(items) == 1 and type(items[0]) is tuple:  # one plain token: most streams, most steps
            delta = gen.state.process_plain(0, *items[0])
            if delta is not None:
                gen.received = True
                if gen.first_token_time is None:
                    gen.first_token_time = time.monotonic()
                return [delta]
        outputs, deltas = [], []
        for item in items:
            if isinstance(item, _ERRORS):
                raise item
            if item is _ABORTED or item is _TIME_LIMIT:
                deltas += self._process(gen, outputs)
                outputs = []
                deltas += gen.state.finish_all(ABORT if item is _ABORTED else TIME_LIMIT)
                if item is _TIME_LIMIT:
                    self._abort_later(gen.engine, [gen.engine_id])
                continue
            if type(item) is tuple:
                outputs.append(plain_output(gen.engine_id, *item))
            else:
                outputs.append(output_from_proto(item))
            gen.received = True
        deltas += self._process(gen, outputs)
        if gen.first_token_time is None and any(d.token_ids for d in deltas):
            gen.first_token_time = time.monotonic()
        return deltas

    def _process(self, gen: Generation, outputs: list) -> list[SampleDelta]:
        if not outputs:
            return []
        deltas, to_stop = gen.state.process(outputs)
        if to_stop:
            self._abort_later(gen.engine, to_stop, stop_string=True)
        return deltas

    def _abort_later(self, engine: PooledEngine | None, engine_ids: list[str], stop_string: bool = False) -> None:
        # Its own task: the caller may itself be a cancelled task, where an await would not run.
        if not engine_ids or engine is None:
            return

        async def send() -> None:
            try:
                await engine.client.abort(engine_ids, stop_string)
            except EngineLost:
                pass  # the engine is gone, and its requests with it
        asyncio.ensure_future(send())


def _reason(error: Exception) -> str:
    if isinstance(error, NotFound):
        return "not_found"  # its adapter is gone there (unloaded, or a restarted engine)
    return "overloaded" if isinstance(error, EngineOverloaded) else "lost"


async def _next(inbox: Inbox, deadline: float | None) -> list:
    """What came since the last call (waiting for something), or the time limit."""
    if deadline is None:
        return await inbox.take()
    remaining_s = deadline - time.monotonic()
    if remaining_s <= 0:  # however much keeps coming
        return [_TIME_LIMIT]
    return await inbox.take(remaining_s) or [_TIME_LIMIT]


def _load_tokenizer(welcome: ipc.Welcome, path: str | None) -> Tokenizer:
    if path is not None:
        return Tokenizer.from_dir(path)
    if not welcome.tokenizer_files:
        raise RuntimeError("the engine sent no tokenizer; start the frontend with --tokenizer")
    files = {name: zlib.decompress(data) for name, data in welcome.tokenizer_files.items()}
    log.info("tokenizer received from the engine (%s)", ", ".join(sorted(files)))
    return Tokenizer.from_files(files)
