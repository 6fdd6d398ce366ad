"""ModelRunner: owns the device, the weights, the KV cache and the sampler.

It is the only part of the engine that builds tensors: it turns a
`SchedulerOutput` (request objects and block ids) into flat input ids,
positions, slot mappings and block tables, runs the model, and samples.

Under tensor parallelism each rank has a ModelRunner of its model shard. Rank 0's
`execute` reduces a step to a `StepPlan` (plain ints), broadcasts it, and every rank
runs it (`run_plan`) through the same collectives; only rank 0 gets logits and samples.
"""

from __future__ import annotations

import logging
import operator
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from common.process_args import default_num_threads
from cpu_kernels.dispatch import KernelPlan
from cpu_kernels.dispatch import plan as plan_kernels
from engine.async_step import InflightStep
from engine.attention import AttentionMetadata, PrefillChunk, get_attention_backend
from engine.attention.kv_format import kv_cache_format
from engine.block_tables import BlockTables
from engine.config import EngineConfig
from engine.cpu_tuning import bucket, linear_shapes, tune_cpu
from engine.cuda_graphs import DecodeGraphs, GraphOutputs
from engine.distributed.state import SINGLE, TPShard, all_reduce_min, broadcast_object
from engine.kv_offload.store import open_offload
from engine.kv_sizing import GpuMemory, measure_gpu_memory, num_kv_blocks, num_profile_blocks, profile_rows
from engine.layers.parallel import check_shardable, local_sizes
from engine.models.llama import ForwardContext
from engine.models.loader import DTYPES, linear_formats, load_model, read_arch_config
from engine.models.multimodal import MultiModalStep
from engine.outputs import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from engine.pooling import Pooler, pool
from engine.prompt_rows import pool_jobs, prompt_jobs, score_prompts
from engine.request import Request
from engine.sampled_rows import group_by_request, sampling_rows
from engine.sampler import Sampler
from engine.sampling_batch import SamplingBatch
from engine.step_rows import (DecodeInputs, ForwardRow, SteadyRows, all_ahead, all_plain_greedy, as_decodes,
                              forward_order, forward_row, num_leading_decodes, padded, prefill_inputs)
from engine.vision import VisionInputs

log = logging.getLogger(__name__)

MAX_DEFAULT_MODEL_LEN = 8192


@dataclass(slots=True)
class StepPlan:
    """One step as every tensor-parallel rank runs it (rank 0 broadcasts it): the rows to
    compute, from which each rank builds the same input ids, positions, slot mappings and
    block tables, and the LM-head calls to make, in order (each one is a collective)."""

    blocks_to_copy: list[tuple[int, int]]  # copy-on-write pairs, before the forward
    rows: list[ForwardRow]
    logits_slices: list[tuple[int, int]] = field(default_factory=list)  # hidden rows [a, b) scored for prompt logprobs
    sample: bool = False  # then the LM head on the rows that sample
    steady: SteadyRows | None = None  # steady decodes, which run before `rows`
    pool_slices: list[tuple[int, int]] = field(default_factory=list)  # hidden rows [a, b) of pooling requests
    mm: MultiModalStep | None = None  # image embeddings and M-RoPE positions (engine/vision.py)
    kv_offload: tuple[list, list] | None = None  # second-tier saves and restores, before the copies


class ModelRunner:
    def __init__(self, config: EngineConfig, model_path: Path, eos_token_ids: tuple[int, ...],
                 shard: TPShard | None = None, num_tokens: int | None = None,
                 pooler: Pooler = Pooler("generate")) -> None:
        """`shard`: a worker's rank (it has joined the group already); None on rank 0, which
        starts the workers itself when `config.tensor_parallel_size` > 1. `num_tokens`: the
        tokenizer's size; rows of the LM head past it (padding) are never sampled. `pooler`:
        how requests that embed (task embed) pool their hidden states."""
        self.config = config
        self.pooler = pooler
        self.device = torch.device(config.device)
        self.arch = read_arch_config(model_path)
        check_shardable(self.arch, config.tensor_parallel_size)
        if self.arch.vision is not None and config.tensor_parallel_size > 1:
            raise ValueError(f"tensor_parallel_size {config.tensor_parallel_size}: a vision-language model "
                             f"({self.arch.model_type}) runs on one device so far")
        # A quantized checkpoint that cannot be split (W8A8) is refused before workers start.
        linear_formats(model_path, self.arch, config.quantization, config.tensor_parallel_size)
        self.pad_shapes = self.device.type == "cpu"  # few shapes for oneDNN: see cpu_tuning
        self.kernel_plan = None  # CPU, quantized layers: cpu_kernels.dispatch's measured choice
        if self.pad_shapes:  # ranks share the cores
            threads = max(1, (config.num_threads or default_num_threads()) // config.tensor_parallel_size)
            tune_cpu(threads)
            self.kernel_plan = self._kernel_plan(model_path, threads)
        self.max_model_len = self._max_model_len()
        self.workers = None
        if shard is None and config.tensor_parallel_size > 1:
            from engine.distributed.workers import WorkerGroup
            self.workers = WorkerGroup(config, model_path, ModelRunner)
            shard = self.workers.shard
        self.shard = shard or SINGLE
        self.model = self.load_weights(model_path)
        local = local_sizes(self.arch, self.shard)
        self.num_kv_heads = local["num_kv_heads"]
        windows = [self.arch.layer_window(i) for i in range(self.arch.num_layers)]
        # Every layer windowed (Mistral): blocks older than the widest window can be released.
        self.kv_window = max(windows) if None not in windows else None
        self.kv_format = kv_cache_format(config.kv_cache_dtype, DTYPES[config.dtype])
        self.backend = get_attention_backend(self._attention_backend(config), local["num_heads"], self.num_kv_heads,
                                             self.arch.head_dim, config.device, DTYPES[config.dtype], self.kv_format)
        self.block_size = config.block_size
        self.block_tables = BlockTables(-(-self.max_model_len // self.block_size), config.max_num_seqs)
        # Every rank must hold the same blocks: the smallest pool any rank can afford.
        self.num_kv_blocks = all_reduce_min(
            num_kv_blocks(config, self._bytes_per_block(), self._measure_gpu_memory), self.shard)
        self.kv_caches = self._kv_caches(self.num_kv_blocks)
        log.info("KV cache: %s (%d bytes a token and kv head), %d blocks of %d tokens, %s attention",
                 self.kv_format.storage_dtype if config.kv_cache_dtype == "auto" else config.kv_cache_dtype,
                 self.kv_format.bytes_per_token_head(self.arch.head_dim), self.num_kv_blocks, self.block_size,
                 self.backend.name)
        self.sampler = Sampler(eos_token_ids, None if num_tokens is None else min(num_tokens, self.arch.vocab_size))
        self.kv_offload = open_offload(config, self.kv_caches, self.shard)  # the prefix cache's second tier
        # The previous `execute`'s steady decodes: their requests and rows (see _steady_rows).
        self._last_steady: tuple[list[Request], SteadyRows] | None = None
        if config.cuda_graphs and self.backend.name != "cupy":
            log.warning("cuda_graphs: off, since attention runs on the %s backend (graphs need cupy)",
                        self.backend.name)
        self.graphs = self._capture_graphs() if config.cuda_graphs and self.backend.name == "cupy" else None
        # A vision-language model's images: the encoder and its cache (engine/vision.py).
        self.vision = VisionInputs(self.model, self.device) if hasattr(self.model, "embed_images") else None
        bidirectional = getattr(self.model, "bidirectional_images", False)
        if bidirectional and config.max_num_batched_tokens < self.model.tokens_per_image:
            raise ValueError(f"max_num_batched_tokens {config.max_num_batched_tokens}: {self.arch.model_type} "
                             f"prefills each image's {self.model.tokens_per_image} tokens in one step; raise it to "
                             "at least that")
        self.lora = None  # multi-LoRA: the adapters and their slots (engine/lora)
        if config.enable_lora:
            from engine.lora.manager import LoraManager
            self.lora = LoraManager(self.model, self.arch, config.max_loras, config.max_lora_rank,
                                    DTYPES[config.dtype], self.device)

    def load_weights(self, path: Path, arch=None) -> torch.nn.Module:
        """A model object with `path`'s weights, built as at start: level 2's wake and
        `update_weights` build one more (engine/sleep.py). `arch`: `path`'s, if not ours."""
        config = self.config
        return load_model(path, arch or self.arch, config.dtype, config.device, self.max_model_len,
                          config.quantization, self.shard, config.layer_kernels,
                          amx=self.kernel_plan is not None and self.kernel_plan.amx,
                          cpu_arithmetic=config.cpu_arithmetic)

    def _attention_backend(self, config: EngineConfig) -> str:
        """The backend to ask for: the torch one for a model whose image tokens attend to each
        other both ways (Gemma 3) on CUDA, whose kernels mask causally only so far."""
        if not (getattr(self.model, "bidirectional_images", False) and self.device.type == "cuda"):
            return config.attention_backend
        if config.attention_backend == "cupy":
            raise ValueError(f"attention_backend 'cupy': {self.arch.model_type}'s image tokens attend both ways, "
                             "which the CUDA kernels do not mask yet; use 'torch' or 'auto'")
        return "torch"

    def close(self) -> None:
        """Stop the tensor-parallel workers (nothing to do on one rank)."""
        if self.workers is not None:
            self.workers.stop()

    def _capture_graphs(self):
        graphs = DecodeGraphs(self.model, self.sampler.argmax_tensor, self.backend, self.kv_caches,
                              self.block_size, self.config.max_num_seqs, self.max_model_len, self.device)
        graphs.capture()
        return graphs

    def _kernel_plan(self, model_path: Path, threads: int) -> KernelPlan | None:
        """cpu_kernels.dispatch's measured plan for this model's quantized layers in bfloat16:
        whether they run in AMX arithmetic, and (without --num-threads) how many threads.
        None where the model has none or runs in float32."""
        if self.config.dtype != "bfloat16" or not linear_formats(model_path, self.arch, self.config.quantization):
            return None
        chosen = plan_kernels(linear_shapes(self.arch), threads)
        if chosen is None:
            return None
        if self.config.num_threads is None and chosen.threads != threads:
            torch.set_num_threads(chosen.threads)
        log.info("CPU kernels: %s", chosen.reason())
        return chosen

    def _max_model_len(self) -> int:
        limit = min(self.arch.max_position_embeddings, MAX_DEFAULT_MODEL_LEN)
        wanted = self.config.max_model_len or limit
        if wanted > self.arch.max_position_embeddings:
            raise ValueError(f"max_model_len: {wanted} exceeds the model's "
                             f"{self.arch.max_position_embeddings} positions")
        return wanted

    def _bytes_per_block(self) -> int:
        a = self.arch  # K and V of every layer; a quantized format's rows are smaller
        return 2 * a.num_layers * self.num_kv_heads * self.kv_format.bytes_per_token_head(a.head_dim) * self.block_size

    def _kv_caches(self, num_blocks: int) -> list[torch.Tensor]:
        shape = self.backend.kv_cache_shape(num_blocks, self.block_size)
        return [torch.zeros(shape, dtype=self.kv_format.storage_dtype, device=self.device)
                for _ in range(self.arch.num_layers)]

    @torch.inference_mode()
    def _measure_gpu_memory(self) -> GpuMemory:
        """The weights, and the peak of the largest step with the LM head on as many rows as
        a step samples and their float32 copy (the sampler's), for --gpu-memory-utilization."""
        rows = profile_rows(self.config.max_num_batched_tokens, self.max_model_len, self.block_size)

        def step(caches: list[torch.Tensor]) -> None:
            input_ids, positions, meta, _ = self._prepare(rows, None)
            hidden = self.model(input_ids, positions, ForwardContext(self.backend, meta, caches))
            logits = self.model.compute_logits(hidden[:self.config.max_num_seqs])
            if logits is not None:  # None on tensor-parallel ranks but 0
                logits.float().softmax(-1)

        return measure_gpu_memory(self.device, lambda: self._kv_caches(num_profile_blocks(rows)), step)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        start = time.perf_counter()
        # Steady decodes run first, as columns (SteadyRows); then the other single-token rows
        # and draft verifications (the batched decode path), then prefill chunks. With LoRA,
        # every row goes by adapter instead, so that each adapter's tokens are contiguous
        # (engine/lora/ops.py).
        num_steady = 0 if self.lora is not None else sched.num_steady
        steady = sched.scheduled[:num_steady]
        steady_requests = sched.steady_requests[:num_steady]
        order = forward_order(sched.scheduled[num_steady:], self.lora is not None)
        sampling = steady + [s for s in order if s.num_samples]
        jobs, slices = prompt_jobs(order, first_row=num_steady)
        rows = [forward_row(s) for s in order]
        if self.lora is not None:
            self.lora.assign_slots([s.request.lora_name for s in order], rows)
        pooling, pool_slices = pool_jobs(order, first_row=num_steady)
        plan = StepPlan(list(sched.blocks_to_copy), rows, slices, bool(sampling),
                        self._steady_rows(steady, steady_requests), pool_slices)
        if sched.kv_saves or sched.kv_restores:
            plan.kv_offload = (sched.kv_saves, sched.kv_restores)
        if self.vision is not None:
            plan.mm = self.vision.step(order, num_steady, steady_requests,
                                       None if plan.steady is None else plan.steady.positions)
        prompt_logits, logits, greedy, pooled_hidden = self.run_plan(plan)
        prompt_lps = score_prompts(jobs, prompt_logits)
        if not sampling:
            return ModelRunnerOutput(prompt_logprobs=prompt_lps, model_s=time.perf_counter() - start,
                                     pooled=self._pool(pooling, pooled_hidden))
        if all_plain_greedy(steady_requests, sampling[num_steady:]):  # the hot path: no per-row sampling state
            model_end = time.perf_counter()
            if greedy is None:
                greedy = self.sampler.argmax_tensor(logits)
            tokens = greedy[:len(sampling)].tolist()
            rest = sampling[num_steady:]
            return ModelRunnerOutput([s.request.request_id for s in rest], [[t] for t in tokens[num_steady:]],
                                     [[None]] * len(rest), prompt_lps, model_end - start,
                                     time.perf_counter() - model_end, steady_token_ids=tokens[:num_steady],
                                     pooled=self._pool(pooling, pooled_hidden))
        rows, row_owner, logits_index = sampling_rows(sampling)
        logits = logits[:logits_index[-1] + 1]
        model_end = time.perf_counter()
        if logits_index != list(range(len(logits))):  # forking prompts sample n tokens from one row
            logits = logits[torch.tensor(logits_index, device=logits.device)]
        sampled = self.sampler(logits, rows)
        out = group_by_request(sampling, row_owner, sampled, num_steady)
        out.prompt_logprobs = prompt_lps
        out.pooled = self._pool(pooling, pooled_hidden)
        out.model_s, out.sample_s = model_end - start, time.perf_counter() - model_end
        out.grammar_s = sampled.grammar_s
        return out

    def can_launch(self, sched: SchedulerOutput) -> bool:
        """Whether `launch` can run this step (engine/async_step.py): every row a steady decode
        that samples plain greedy or plain random, on one rank, with no adapters and no block
        copies."""
        n = sched.num_steady
        return (0 < n == len(sched.scheduled) and self.lora is None and self.workers is None
                and not sched.blocks_to_copy and not sched.kv_restores
                and (self.graphs is None or n <= self.graphs.max_batch)
                and all_ahead(sched.steady_requests)
                and not (self.vision is not None and any(r.rope_table is not None for r in sched.steady_requests)))

    @torch.inference_mode()
    def launch(self, sched: SchedulerOutput, previous: InflightStep | None = None) -> InflightStep:
        """Start a `can_launch` step without waiting for the device. After `previous` (launched,
        not yet resolved), each row computes the token that step samples for it, still on the
        device, one position further than the request's counters say."""
        start = time.perf_counter()
        self._last_steady = None  # its rows run one position further, and `execute` does not see them
        if sched.kv_saves:  # a lease renewal popped cached blocks, which this step may overwrite
            self.kv_offload.copy(self.kv_caches, sched.kv_saves, [])
        requests = sched.steady_requests
        steady = SteadyRows.of(sched.scheduled, requests)
        device_ids = None
        if previous is not None:
            steady.positions += 1
            device_ids = previous.input_ids(requests)
        n = len(requests)
        greedy = None
        if self.graphs is not None:  # the LM head and the argmax ran in the graph too
            inputs = self._decode_inputs([], steady)
            _, logits, greedy = self.graphs.run(inputs.token_ids, inputs.positions, inputs.slots,
                                                inputs.block_tables, device_ids)
        else:
            input_ids, positions, meta, _ = self._prepare([], steady)
            if device_ids is not None:
                input_ids[:n].copy_(device_ids)
            hidden = self.model(input_ids, positions, ForwardContext(self.backend, meta, self.kv_caches))
            logits = self.model.compute_logits(hidden[:n])
        if all_plain_greedy(requests, []):
            tokens = greedy if greedy is not None else self.sampler.argmax_tensor(logits)
        else:  # a seeded row's key is its output position: one further with a step in flight
            tokens = self.sampler.sample_tensor(logits, SamplingBatch.of_requests(requests, previous is not None))
        return InflightStep.launched(sched, requests, tokens, start)

    def _steady_rows(self, steady: list[ScheduledRequest], requests: list[Request]) -> SteadyRows | None:
        """The steady decodes' rows. Where they are the previous step's requests in the same
        order (as the scheduler keeps them), each has computed exactly its one token since:
        the positions advance by one and the tables are the same lists, so only the tokens
        are read again (SteadyRows.following)."""
        last = self._last_steady
        if not steady:
            self._last_steady = None
            return None
        if last is not None and len(last[0]) == len(requests) and all(map(operator.is_, requests, last[0])):
            rows = last[1].following(requests)
        else:
            rows = SteadyRows.of(steady, requests)
        self._last_steady = requests, rows
        return rows

    def forward(self, rows: list[ForwardRow], steady: SteadyRows | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the model over `rows` (single-token rows and verifications first, for the batched
        decode path): (hidden states, the indices of the rows whose logits are needed, in order).

        A verification (every token needs logits: a decode's token and its drafts) runs as one
        decode row per token, each attending to the cache up to its own position: every K/V
        of the step is written before attention reads any, so token j sees drafts 0..j-1.
        The decode kernel is much cheaper than a prefill chunk for a few tokens, and each
        token goes through the same kernels as without speculation."""
        hidden, last_rows, _ = self._forward(rows, steady)
        return hidden, last_rows

    def _forward(self, rows: list[ForwardRow], steady: SteadyRows | None, mm: MultiModalStep | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, GraphOutputs | None]:
        """`forward`, plus a CUDA graph's outputs where the step ran in one (its logits and
        argmax cover every row, in order, sampled or not). `mm`: the step's images."""
        if any(f.num_logits > 1 for f in rows):
            rows = [one for f in rows for one in as_decodes(f)]
        if self.graphs is not None and mm is None and self._all_decode(rows, steady):
            return self._run_graph(rows, steady)
        input_ids, positions, meta, last_rows = self._prepare(rows, steady)
        if self.lora is not None:
            self.lora.set_tokens(rows)
        if mm is not None and mm.rope_positions is not None and mm.rope_positions.shape[1] < len(positions):
            padding = len(positions) - mm.rope_positions.shape[1]  # rows padded to a bucket: position 0
            mm.rope_positions = torch.nn.functional.pad(mm.rope_positions, (0, padding))
        hidden = self.model(input_ids, positions, ForwardContext(self.backend, meta, self.kv_caches, mm))
        return hidden, last_rows, None

    @torch.inference_mode()
    def run_plan(self, plan: StepPlan) -> tuple[list[torch.Tensor | None], torch.Tensor | None, torch.Tensor | None,
                                                list[torch.Tensor]]:
        """Run one step on this rank (rank 0 first broadcasts it): (the prompt-logprob slices'
        logits, the sampling rows' logits, their argmax where a CUDA graph computed it, else
        None, the pooling slices' hidden states). Logits are None except on rank 0."""
        if self.workers is not None:
            broadcast_object(plan, self.shard)
        if plan.kv_offload is not None:  # saves read blocks that the copies and the forward overwrite
            self.kv_offload.copy(self.kv_caches, *plan.kv_offload)
        self.copy_blocks(plan.blocks_to_copy)
        hidden, last_rows, graph = self._forward(plan.rows, plan.steady, plan.mm)
        prompt_logits = [self.model.compute_logits(hidden[a:b]) for a, b in plan.logits_slices]
        pooled = [hidden[a:b] for a, b in plan.pool_slices]
        if not plan.sample:
            return prompt_logits, None, None, pooled
        if graph is not None:  # the graph's LM head covered every row: keep the sampling ones
            if len(last_rows) == len(graph.greedy):
                return prompt_logits, graph.logits, graph.greedy, pooled
            return prompt_logits, graph.logits[last_rows], graph.greedy[last_rows], pooled
        return prompt_logits, self.model.compute_logits(hidden[last_rows]), None, pooled

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: copy whole KV blocks src -> dst before a forward. The copies replaced
        table entries in place, so the persistent block tables are read again."""
        self.backend.copy_blocks(self.kv_caches, pairs)
        if pairs:
            self.block_tables.invalidate()

    def _pool(self, requests: list[Request], hidden: list[torch.Tensor]) -> dict[str, list[float]]:
        """Each pooling request's vector (a decoder pools its last token: engine/pooling.py)."""
        if not requests:
            return {}
        pooler = self.pooler
        return {r.request_id: pool(h, pooler.mode, pooler.normalize).tolist() for r, h in zip(requests, hidden)}

    def _prepare(self, rows: list[ForwardRow], steady: SteadyRows | None):
        """The flat step inputs of the steady decodes then `rows`, single-token rows first:
        (input ids, positions, attention metadata, the rows whose logits are needed). Decode
        rows are built as arrays over the persistent block tables; prefill chunks as arrays
        too, their tables one padded array (one copy to the device)."""
        bs = self.block_size
        num_leading = num_leading_decodes(rows)
        decode = self._decode_inputs(rows[:num_leading], steady)
        num_decode = len(decode.token_ids)
        input_ids, positions, slots = [decode.token_ids], [decode.positions], [decode.slots]
        last_rows = [decode.logits_rows]
        prefills, prefill_tables = [], None
        if len(rows) > num_leading:
            chunks = prefill_inputs(rows[num_leading:], num_decode, bs)
            input_ids.append(chunks.token_ids)
            positions.append(chunks.positions)
            slots.append(chunks.slots)
            last_rows.append(chunks.logits_rows)
            prefill_tables = self._tensor(chunks.block_tables)
            prefills = [PrefillChunk(start, n, context, table[:k], row.bidirectional)
                        for start, n, context, k, table, row in zip(
                            chunks.token_starts.tolist(), chunks.num_tokens.tolist(), chunks.context_lens.tolist(),
                            chunks.num_blocks.tolist(), prefill_tables.unbind(0), rows[num_leading:])]
        meta = AttentionMetadata(
            slot_mapping=self._tensor(np.concatenate(slots)), num_decode_tokens=num_decode,
            decode_block_tables=self._tensor(decode.block_tables) if num_decode else None,
            decode_context_lens=self._tensor(decode.positions + 1) if num_decode else None,
            prefills=prefills, backend_state={"block_size": bs}, prefill_block_tables=prefill_tables)
        self.backend.prepare(meta)
        input_ids, positions, last_rows = (np.concatenate(a) for a in (input_ids, positions, last_rows))
        if self.pad_shapes:  # padding rows: token 0 at position 0, no slot, never sampled
            size = bucket(len(input_ids))
            input_ids, positions = padded(input_ids, size, 0), padded(positions, size, 0)
            if len(last_rows):  # padding repeats the last row: never sampled
                last_rows = padded(last_rows, bucket(len(last_rows)), last_rows[-1])
        return self._tensor(input_ids), self._tensor(positions), meta, self._tensor(last_rows)

    def _decode_inputs(self, rows: list[ForwardRow], steady: SteadyRows | None) -> DecodeInputs:
        """The steady decodes, then single-token `rows`, as arrays: O(1) Python work per row,
        the tables from `block_tables`."""
        n, bs = len(rows), self.block_size
        if steady is not None and not rows:  # a step of steady decodes only: every row samples
            token_ids, positions, tables = steady.token_ids, steady.positions, steady.block_tables
            logits = np.ones(len(token_ids), dtype=np.int64)
        else:
            columns = np.array([(f.token_ids[0], f.start, f.num_logits) for f in rows],
                               dtype=np.int64).reshape(n, 3)
            token_ids, positions, logits = columns[:, 0], columns[:, 1], columns[:, 2]
            tables = [f.block_ids for f in rows]
            if steady is not None:
                token_ids = np.concatenate([steady.token_ids, token_ids])
                positions = np.concatenate([steady.positions, positions])
                logits = np.concatenate([np.ones(len(steady.token_ids), dtype=np.int64), logits])
                tables = steady.block_tables + tables
        n = len(tables)
        width = int(positions.max()) // bs + 1 if n else 0
        tables = self.block_tables.gather(tables, width)
        slots = tables[np.arange(n), positions // bs] * bs + positions % bs
        return DecodeInputs(np.ascontiguousarray(token_ids), np.ascontiguousarray(positions), slots, tables,
                            np.flatnonzero(logits))

    def _all_decode(self, rows: list[ForwardRow], steady: SteadyRows | None) -> bool:
        n = len(rows) + (0 if steady is None else len(steady.token_ids))
        return 0 < n <= self.graphs.max_batch and num_leading_decodes(rows) == len(rows)

    def _run_graph(self, rows: list[ForwardRow], steady: SteadyRows | None
                   ) -> tuple[torch.Tensor, torch.Tensor, GraphOutputs]:
        """A pure-decode step through the captured graph of its batch-size bucket."""
        inputs = self._decode_inputs(rows, steady)
        outputs = self.graphs.run(inputs.token_ids, inputs.positions, inputs.slots, inputs.block_tables)
        return outputs.hidden, self._tensor(inputs.logits_rows), outputs

    def _tensor(self, values: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(values).to(self.device, non_blocking=True)
