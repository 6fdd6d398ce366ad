"""EngineCore: one pure step of the engine, schedule -> run -> sample -> update.

No sockets, threads or text here: requests come in as token ids, outputs go
out as token ids. The process wrapper (sockets, busy loop) and the offline
`LLM` both drive this class.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

from common.errors import EngineOverloaded, InvalidRequest, LoraError
from common.multimodal import ImageInput, with_images
from common.outputs import EngineCoreOutput, PlainTokens, sample_request_id
from common.pooling_params import PoolingParams
from common.prefix_hash import block_extra_keys
from common.sampling_params import SamplingParams
from common.validation import PromptLimits, check_pooling_prompt, check_prompt
from engine.async_scheduler import AsyncScheduler
from engine.async_step import InflightStep
from engine.block_manager import BlockManager
from engine.config import EngineConfig, SchedulerConfig
from engine.encoder_runner import EncoderRunner
from engine.kv_offload.index import OffloadIndex
from engine.lora.adapter import LoraAdapter
from engine.model_runner import ModelRunner
from engine.models.generation_config import load_sampling_defaults
from engine.models.loader import read_arch_config
from engine.models.source import adapter_path, model_files
from engine.pooling import Pooler, resolve_pooler, sentence_transformers_max_len
from engine.request import Request, RequestStatus
from engine.scheduler import Scheduler
from engine.sleep_mode import (check_level, check_supported, load_checked, log_sleep, put_to_sleep, signature,
                               swap_model, wake)
from engine.spec_decode.proposers import build_speculator
from engine.stats import IterationStats, SpecDecodingStats
from engine.structured_output.manager import StructuredOutputManager

log = logging.getLogger("pagedserve.engine")
GRAMMAR_WAIT_S = 0.005
POOLING_SAMPLING = SamplingParams(max_tokens=1)  # a pooling request samples nothing; its Request needs some


def _pooling_config(config: EngineConfig, pooler: Pooler, encoder: bool, model_path) -> EngineConfig:
    """The engine's config for a model that pools: the longest input its sentence-transformers
    config takes (unless --max-model-len says), no prefix caching for an encoder (it keeps no
    KV), no speculation, no steps ahead."""
    if not pooler.pools:
        return config
    if config.speculative_method:
        raise ValueError(f"speculative_method: the {pooler.task} task generates nothing to speculate on")
    st_len = sentence_transformers_max_len(model_path)
    return dataclasses.replace(
        config, max_model_len=config.max_model_len or st_len, async_scheduling=False,
        enable_prefix_caching=config.enable_prefix_caching and not encoder,
        kv_offload_gb=None if encoder else config.kv_offload_gb,
        kv_offload_dir=None if encoder else config.kv_offload_dir)


@dataclass(frozen=True)
class EngineStats:
    """A snapshot for health, metrics and the frontend's server info."""

    num_running: int
    num_waiting: int
    num_kv_blocks: int
    num_free_kv_blocks: int
    num_preemptions: int
    num_prefix_cache_queries: int
    num_prefix_cache_hits: int
    spec_decoding: SpecDecodingStats | None = None  # totals; None when speculative decoding is off
    # The prefix cache's second tier (engine/kv_offload), totals: prompt tokens restored from it,
    # bytes copied there and back, and the time restores took.
    num_kv_offload_hits: int = 0
    kv_offload_saved_bytes: int = 0
    kv_offload_restored_bytes: int = 0
    kv_offload_restore_s: float = 0.0


class EngineCore:
    def __init__(self, config: EngineConfig, eos_token_ids: tuple[int, ...], log_stats: bool = False,
                 tokenizer=None) -> None:
        """`log_stats`: collect `IterationStats` for metrics; whoever sets it must take them.
        `tokenizer`: the model's (Hugging Face) tokenizer; structured output needs it, and it
        bounds the tokens that can be sampled when the LM head has padding rows."""
        self.model_path = model_files(config)
        arch = read_arch_config(self.model_path)
        self.pooler = resolve_pooler(self.model_path, arch.encoder, arch.num_labels, arch.hidden_size,
                                     config.task, config.pooling)
        self.config = config = _pooling_config(config, self.pooler, arch.encoder, self.model_path)
        self.eos_token_ids = eos_token_ids
        # For the fields a request leaves unset; applied by the frontend (common/sampling_defaults.py).
        self.sampling_defaults = load_sampling_defaults(config.generation_config, self.model_path)
        if arch.encoder:
            self.model_runner = EncoderRunner(config, self.model_path, self.pooler)
        else:  # rows of the LM head past the tokenizer's tokens are padding: never sampled
            self.model_runner = ModelRunner(config, self.model_path, eos_token_ids,
                                            num_tokens=None if tokenizer is None else len(tokenizer),
                                            pooler=self.pooler)
        self.vocab_size = self.model_runner.arch.vocab_size
        self.structured_output = None
        if tokenizer is not None and not self.pooler.pools:
            self.structured_output = StructuredOutputManager(tokenizer, self.vocab_size, eos_token_ids)
        # A draft model shares the block tables and attends to whole contexts: keep every block.
        kv_window = self.model_runner.kv_window if config.speculative_method != "draft" else None
        store = getattr(self.model_runner, "kv_offload", None)
        self.block_manager = BlockManager(self.model_runner.num_kv_blocks, config.block_size,
                                          config.enable_prefix_caching, kv_window,
                                          None if store is None else OffloadIndex(store.num_slots))
        if store is not None and self.block_manager.offload is None:
            log.warning("kv offload: off: every layer of this model attends through a sliding window, "
                        "whose blocks are released as sequences move on")
        self.max_model_len = self._fit_max_model_len(self.model_runner.max_model_len)
        self.limits = PromptLimits(self.vocab_size, self.max_model_len, self.block_manager.num_blocks,
                                   config.block_size)
        # A pooling prompt runs whole, in one step (engine/pooling.py).
        self.max_pooling_tokens = min(self.max_model_len, config.max_num_batched_tokens)
        self.iteration_stats = IterationStats() if log_stats else None
        self.speculator = None if self.pooler.pools else build_speculator(
            config, self.model_runner, self.max_model_len, self.model_runner.sampler.num_tokens or self.vocab_size)
        lookahead = config.num_speculative_tokens if config.speculative_method == "draft" else 0
        # A speculator proposes from each step's tokens, on the host: no step goes ahead.
        self.async_scheduling = bool(config.async_scheduling) and self.speculator is None
        scheduler = AsyncScheduler if self.async_scheduling else Scheduler
        self.scheduler = scheduler(SchedulerConfig(
            max_num_batched_tokens=config.max_num_batched_tokens, max_num_seqs=config.max_num_seqs,
            max_model_len=self.max_model_len, policy=config.scheduling_policy,
            num_lookahead_tokens=lookahead, max_loras=config.max_loras,
            async_admission_steps=config.async_admission_steps), self.block_manager,
            self.iteration_stats)
        self._inflight: InflightStep | None = None  # the step launched and not yet resolved
        self.sleep_level = 0  # 0 awake; 1 or 2 asleep (sleep): nothing is scheduled
        self.weights_path = self.model_path  # where the live weights came from: level 2's wake reloads them
        self._asleep_signature: dict | None = None  # the freed weights' names, shapes, dtypes (level 2)
        for name, path in (config.lora_modules or {}).items():  # a bad one stops the start, named
            self.load_lora(name, str(adapter_path(path, config.download_dir)))

    def _fit_max_model_len(self, max_model_len: int) -> int:
        # A sequence longer than the whole pool would preempt itself forever: never admit one.
        # With every layer windowed, a sequence holds a bounded number of blocks: only
        # those bound it (a step writes at most the token budget plus a draft model's lookahead).
        step_tokens = self.config.max_num_batched_tokens + self.config.num_speculative_tokens
        peak = self.block_manager.window_peak_blocks(step_tokens)
        if peak is not None and peak <= self.block_manager.num_blocks:
            return max_model_len
        capacity = self.block_manager.num_blocks * self.config.block_size
        if capacity < max_model_len:
            log.warning("max_model_len lowered from %d to %d tokens: the KV cache holds no more (raise "
                        "--num-kv-blocks, --gpu-memory-utilization or --kv-cache-memory-gb)", max_model_len, capacity)
        return min(max_model_len, capacity)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    priority: int = 0, lora_name: str | None = None, images: list[ImageInput] = ()) -> None:
        """Queue a request; raises ValueError (naming the problem) if it can never run,
        LoraError("not_found") for an adapter not loaded, and EngineOverloaded if
        `max_waiting_requests` are already waiting. `lora_name`: None or "" is the base model.
        `images`: the prompt's, preprocessed (common/multimodal.py), by offset."""
        if self.pooler.pools:
            raise InvalidRequest(f"this model serves the {self.pooler.task} task, not generate "
                                 f"(--task {self.pooler.task}); send it to /v1/embeddings, /score or /v1/rerank")
        self._validate(request_id, prompt_token_ids, params)
        self._check_images(prompt_token_ids, images)
        extra_keys = with_images(self.lora_block_keys(lora_name), images)
        limit = self.config.max_waiting_requests
        if limit is not None and self.scheduler.num_waiting >= limit:
            raise EngineOverloaded(f"server busy: {self.scheduler.num_waiting} requests are waiting "
                                   f"(--max-waiting-requests {limit}); retry later")
        if params.n == 1:
            request = Request(request_id, list(prompt_token_ids), params, self.eos_token_ids, priority)
        else:  # sample 0 runs the prompt; the scheduler forks the others after its prefill
            request = Request(sample_request_id(request_id, 0), list(prompt_token_ids), params,
                              self.eos_token_ids, priority, parent_id=request_id)
        request.lora_name, request.block_extra_keys = lora_name or None, extra_keys
        if images:
            request.images = list(images)
            self.model_runner.vision.prepare(request)
        if params.structured_outputs is not None:
            request.structured = self.structured_output.request(params.structured_outputs)
        self.scheduler.add_request(request)

    def add_pooling_request(self, request_id: str, prompt_token_ids: list[int],
                            pooling: PoolingParams = PoolingParams(), priority: int = 0) -> None:
        """Queue a request that pools its prompt (task embed or score): it ends in the step
        that runs its prompt, with its vector in EngineCoreOutput.pooled. Raises like
        `add_request`."""
        if not self.pooler.pools:
            raise InvalidRequest("this model serves the generate task; start the engine with --task embed "
                                 "to embed with it")
        check_pooling_prompt(prompt_token_ids, self.vocab_size, self.max_pooling_tokens)
        if request_id in self.scheduler.requests:
            raise InvalidRequest(f"request_id {request_id!r} is already in use")
        limit = self.config.max_waiting_requests
        if limit is not None and self.scheduler.num_waiting >= limit:
            raise EngineOverloaded(f"server busy: {self.scheduler.num_waiting} requests are waiting "
                                   f"(--max-waiting-requests {limit}); retry later")
        request = Request(request_id, list(prompt_token_ids), POOLING_SAMPLING, (), priority)
        request.pooling = pooling
        self.scheduler.add_request(request)

    # -- LoRA adapters (docs/lora.md) ---------------------------------------------

    def load_lora(self, name: str, path: str) -> list[LoraAdapter]:
        """Load a PEFT adapter under `name`; returns the adapters loaded after it. Raises
        LoraError: "invalid" (LoRA off, unreadable, rank too high, does not fit the model),
        "conflict" (the name is taken)."""
        self._lora_manager().load(name, path)
        return self.lora_adapters()

    def unload_lora(self, name: str) -> list[LoraAdapter]:
        """Forget an adapter; refused (LoraError "conflict") while requests use it, since
        they would otherwise end part-way or run on the base model."""
        manager = self._lora_manager()
        users = [r.request_id for r in self.scheduler.requests.values() if r.lora_name == name]
        if users and name in manager.adapters:
            raise LoraError(f"LoRA {name!r} has {len(users)} request(s) in flight; unload it once "
                            "they finish", kind="conflict")
        manager.unload(name)
        return self.lora_adapters()

    def lora_adapters(self) -> list[LoraAdapter]:
        """The adapters loaded now, in load order (name, path, rank, ...)."""
        manager = self.model_runner.lora
        return [] if manager is None else list(manager.adapters.values())

    def _lora_manager(self):
        if self.model_runner.lora is None:
            raise LoraError("LoRA adapters are off: start the engine with --enable-lora")
        return self.model_runner.lora

    def lora_block_keys(self, lora_name: str | None) -> tuple:
        """The prefix-cache extra keys of a request for this adapter; raises LoraError
        ("not_found") for one not loaded."""
        if not lora_name:
            return ()
        loaded = {a.name: a for a in self.lora_adapters()}
        adapter = loaded.get(lora_name)
        if adapter is None:
            have = ", ".join(loaded) or ("none: LoRA is off" if self.model_runner.lora is None else "none")
            raise LoraError(f"LoRA adapter {lora_name!r} is not loaded (loaded: {have})", kind="not_found")
        return block_extra_keys(lora_name, adapter.path)

    def abort_requests(self, request_ids: list[str], stopped: bool = False) -> None:
        """Abort these requests, all samples of a caller's id or one sample by its internal
        id; unknown or finished ids are ignored. `stopped`: a stop string, which only the
        frontend can see, ended them; they count as finished by "stop", not aborted."""
        wanted = set(request_ids)
        internal = [r.request_id for r in self.scheduler.requests.values()
                    if r.request_id in wanted or r.parent_id in wanted]
        status = RequestStatus.FINISHED_STOPPED if stopped else RequestStatus.FINISHED_ABORTED
        self.scheduler.remove_requests(internal, status)
        self._drop_idle_inflight()

    def abort_requests_with_prefix(self, prefix: str) -> None:
        """Abort every request whose id starts with `prefix` (a vanished client's namespace)."""
        self.abort_requests([r for r in self.scheduler.requests if r.startswith(prefix)])

    def step(self) -> list[EngineCoreOutput]:
        """One step's outputs. With async scheduling, the next step may already be running on
        the device when this returns (engine/async_step.py)."""
        return self._step(None)

    def step_packed(self) -> tuple[list[EngineCoreOutput], PlainTokens]:
        """`step`, with the steady decodes' plain tokens packed (PlainTokens) instead of an
        EngineCoreOutput each: what the engine process and the offline `LLM` read."""
        plain = PlainTokens()
        return self._step(plain), plain

    def _step(self, plain: PlainTokens | None) -> list[EngineCoreOutput]:
        if self.block_manager.offload is not None and self.model_runner.kv_offload.failed:
            self.block_manager.drop_offload(turn_off=True)  # the store logged why; nothing restores from it
        if self.sleep_level:  # requests wait for wake_up
            return self.scheduler.take_failed_outputs()
        if self._inflight is not None:
            return self._finish_inflight(0.0, plain)
        start = time.perf_counter()
        sched = self.scheduler.schedule()
        if sched.is_empty:
            if self.speculator is not None:
                self.speculator.after_step(sched)  # forgets the requests that ended
            if not self.scheduler.failed_outputs:
                self._wait_for_grammars()
            return self.scheduler.take_failed_outputs()
        schedule_s = time.perf_counter() - start
        if self.async_scheduling and self.model_runner.can_launch(sched):
            self._inflight = self.model_runner.launch(sched)
            return self._finish_inflight(schedule_s, plain)
        result = self.model_runner.execute(sched)
        outputs = self.scheduler.take_failed_outputs() + self.scheduler.update_from_output(sched, result, plain)
        if self.speculator is not None:
            self.speculator.after_step(sched)
            self.speculator.observe_step(sched, time.perf_counter() - start)
        if self.iteration_stats is not None:
            self.iteration_stats.observe_step(schedule_s, result.model_s, result.sample_s,
                                              sched.num_batched_tokens, result.grammar_s)
        return outputs

    def _finish_inflight(self, schedule_s: float, plain: PlainTokens | None) -> list[EngineCoreOutput]:
        """Launch the next step where it can go ahead, then wait for the one in flight and
        return its outputs: the caller's work on them overlaps the next step."""
        current, self._inflight = self._inflight, None
        start = time.perf_counter()
        ahead = self.scheduler.schedule_ahead()
        if ahead is not None and self.model_runner.can_launch(ahead):
            self._inflight = self.model_runner.launch(ahead, previous=current)
        schedule_s += time.perf_counter() - start
        result = current.result()
        outputs = (self.scheduler.take_failed_outputs()
                   + self.scheduler.update_from_output(current.sched, result, plain))
        if self.iteration_stats is not None:
            self.iteration_stats.observe_step(schedule_s, result.model_s, 0.0, current.sched.num_batched_tokens,
                                              None)
        self._drop_idle_inflight()
        return outputs

    def _drop_idle_inflight(self) -> None:
        """A step in flight whose requests have all ended gives nobody anything: wait for it
        and forget it, so that an engine with no requests has nothing in flight."""
        if self._inflight is not None and not self.scheduler.running:
            self._inflight.result()
            self._inflight = None

    def _wait_for_grammars(self) -> None:
        """Nothing can run until a grammar compiles: wait a moment for one rather than spin
        (the caller's loop comes back at once, so sockets are still served)."""
        pending = [r.structured.grammar for r in self.scheduler.waiting_for_grammar]
        if pending:
            futures.wait(pending, timeout=GRAMMAR_WAIT_S, return_when=futures.FIRST_COMPLETED)

    def take_iteration_stats(self) -> IterationStats | None:
        """What happened since the last call (None unless built with log_stats)."""
        taken = self.iteration_stats
        if taken is not None:
            self.iteration_stats = self.scheduler.stats = IterationStats()
        return taken

    def close(self) -> None:
        """Stop the model runner's tensor-parallel workers, if any (they would otherwise be
        killed at exit)."""
        self.model_runner.close()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (e.g. between benchmark runs); False while requests hold blocks."""
        return self.block_manager.reset_prefix_cache()

    def has_unfinished_requests(self) -> bool:
        """Whether `step` has anything to do: requests to run, a step in flight, or outputs of
        requests that ended as they were added (a cached grammar that failed) still to give."""
        if self.sleep_level:
            return bool(self.scheduler.failed_outputs)
        return self.scheduler.num_unfinished > 0 or self._inflight is not None or bool(self.scheduler.failed_outputs)

    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=self.scheduler.num_waiting,
            num_kv_blocks=bm.num_blocks, num_free_kv_blocks=bm.num_free_blocks,
            num_preemptions=self.scheduler.num_preemptions,
            num_prefix_cache_queries=bm.num_cache_queries, num_prefix_cache_hits=bm.num_cache_hits,
            spec_decoding=None if self.speculator is None else self.scheduler.spec_stats.copy(),
            **self._kv_offload_stats())

    def _kv_offload_stats(self) -> dict:
        store = getattr(self.model_runner, "kv_offload", None)
        if store is None:
            return {}
        return dict(num_kv_offload_hits=self.block_manager.num_offload_hits, kv_offload_saved_bytes=store.saved_bytes,
                    kv_offload_restored_bytes=store.restored_bytes, kv_offload_restore_s=store.restore_s)

    # -- sleep, wake and weight updates (engine/sleep_mode.py) --------------------------

    def sleep(self, level: int = 1) -> list[EngineCoreOutput]:
        """Free the KV cache (level 1: the weights stay, in host memory; level 2: they are freed
        too) and schedule nothing until `wake_up`. Running requests are preempted: they wait, and
        recompute on wake (greedy output is unchanged). Returns the outputs of a step that was in
        flight. Asleep at this level already: nothing to do; InvalidRequest where it cannot."""
        runner = check_level(self, level)
        if self.sleep_level == level:
            return []
        if self.sleep_level:
            raise InvalidRequest(f"level: the engine is asleep at level {self.sleep_level}; wake it up first")
        outputs = self._settle()
        num_preempted = self._forget_kv()
        self._asleep_signature = signature(runner.model) if level == 2 else None
        put_to_sleep(runner, level)
        self.sleep_level = level
        log_sleep(level, num_preempted)
        return outputs

    def wake_up(self) -> None:
        """Allocate the KV cache again (level 2: load the weights again, from `weights_path`);
        waiting requests run from the next step. Awake already: nothing to do."""
        if self.sleep_level:
            wake(self.model_runner, self.weights_path)
            log.info("awake (was asleep at level %d)", self.sleep_level)
            self.sleep_level = 0

    def update_weights(self, path: str) -> list[EngineCoreOutput]:
        """Serve the weights at `path` (same architecture and shapes) from the next step: loaded
        and checked whole first, then swapped; InvalidRequest if they do not fit, and the old
        weights keep serving. Running requests recompute their KV with the new weights. Asleep
        (an RL loop's order: sleep, train, update, wake): the new weights are loaded onto the
        device now, and the wake allocates only the KV cache."""
        runner = check_supported(self, "update_weights")
        if runner.lora is not None:
            raise InvalidRequest("update_weights: not with --enable-lora yet: the adapters' layers wrap the "
                                 "live weights")
        live = self._asleep_signature if runner.model is None else signature(runner.model)
        new = load_checked(runner, path, live)
        outputs = []
        if not self.sleep_level:  # asleep, the sleep did this
            outputs = self._settle()
            self._forget_kv()
        swap_model(runner, new, asleep=bool(self.sleep_level))
        self._asleep_signature = None
        self.weights_path = Path(path).expanduser()
        log.info("weights updated from %s", path)
        return outputs

    def _settle(self) -> list[EngineCoreOutput]:
        """Resolve a step in flight (async scheduling) without launching the next."""
        current, self._inflight = self._inflight, None
        if current is None:
            return []
        return (self.scheduler.take_failed_outputs()
                + self.scheduler.update_from_output(current.sched, current.result(), None))

    def _forget_kv(self) -> int:
        """Every request's KV is about to go (sleep) or go stale (new weights): preempt the running
        requests and forget the cached prefixes. Returns how many were preempted."""
        num_preempted = self.scheduler.preempt_all()
        if not self.block_manager.reset_prefix_cache():  # a block still in use: a bug
            log.error("prefix cache not reset: %d blocks still in use",
                      self.block_manager.num_blocks - self.block_manager.num_free_blocks)
        # reset_prefix_cache forgets the second tier too (BlockManager.drop_offload): stale after an update.
        return num_preempted

    def _check_images(self, prompt: list[int], images: list[ImageInput]) -> None:
        if not images:
            return
        vision = getattr(self.model_runner, "vision", None)
        if vision is None:
            raise InvalidRequest(f"images: this model ({self.model_runner.arch.model_type}) takes text only")
        vision.check(prompt, images)

    def _validate(self, request_id: str, prompt: list[int], params: SamplingParams) -> None:
        check_prompt(prompt, params, self.limits)
        if params.structured_outputs is not None and self.structured_output is None:
            raise InvalidRequest("structured_outputs: this engine was started without its tokenizer, "
                                 "which structured output needs")
        if request_id in self.scheduler.requests or any(
                r.parent_id == request_id for r in self.scheduler.requests.values()):
            raise InvalidRequest(f"request_id {request_id!r} is already in use")
