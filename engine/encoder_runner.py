"""EncoderRunner: the model runner of an encoder (BERT), for the embed and score tasks.

The scheduler treats its requests as it treats any prefill-only request: each step takes
whole prompts up to the token budget, and each ends in the step that runs it. An encoder
keeps no KV cache, so the block manager's blocks are bookkeeping only (no memory behind
them) and prefix caching is off. The step's prompts run as one flat batch
(engine/models/bert.py); each is pooled (engine/pooling.py), and a cross-encoder's CLS
state goes through its classification head.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from common.process_args import default_num_threads
from engine.config import EngineConfig
from engine.cpu_tuning import tune_cpu
from engine.models.loader import load_model, read_arch_config
from engine.outputs import ModelRunnerOutput, SchedulerOutput
from engine.pooling import Pooler, pool

log = logging.getLogger(__name__)


class EncoderRunner:
    lora = None  # no adapters, no speculation, no steps ahead: the model runner's interface, trimmed
    kv_window = None

    def __init__(self, config: EngineConfig, model_path: Path, pooler: Pooler) -> None:
        if config.tensor_parallel_size > 1 or config.enable_lora or config.speculative_method:
            raise ValueError("an encoder model runs on one rank, without LoRA or speculative decoding")
        self.config = config
        self.pooler = pooler
        self.device = torch.device(config.device)
        self.arch = read_arch_config(model_path)
        if self.device.type == "cpu":
            tune_cpu(config.num_threads or default_num_threads())
        self.max_model_len = config.max_model_len or self.arch.max_position_embeddings
        if self.max_model_len > self.arch.max_position_embeddings:
            raise ValueError(f"max_model_len: {self.max_model_len} exceeds the model's "
                             f"{self.arch.max_position_embeddings} positions")
        self.model = load_model(model_path, self.arch, config.dtype, config.device, self.max_model_len,
                                layer_kernels=False)
        # Blocks without memory: enough for every seat at full length, so none ever waits.
        self.num_kv_blocks = config.max_num_seqs * -(-self.max_model_len // config.block_size)

    def close(self) -> None:
        pass

    @staticmethod
    def can_launch(sched: SchedulerOutput) -> bool:
        return False

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        start = time.perf_counter()
        requests = [s.request for s in sched.scheduled]
        lengths = [r.num_prompt_tokens for r in requests]
        token_ids = [t for r in requests for t in r.prompt_token_ids]
        positions = [p for n in lengths for p in range(n)]
        # A text pair's second text (from token_type_start on, where it is set) is of type 1.
        types = [int(0 < r.pooling.token_type_start <= p) for r in requests for p in range(r.num_prompt_tokens)]
        hidden = self.model(self._tensor(token_ids), self._tensor(positions), self._tensor(types), lengths)
        pooler = self.pooler
        if pooler.task == "score":
            firsts = self._tensor([0] + lengths[:-1]).cumsum(0)
            vectors = self.model.classify(hidden[firsts]).float().tolist()
        else:
            vectors = [pool(h, pooler.mode, pooler.normalize).tolist() for h in hidden.split(lengths)]
        pooled = {r.request_id: v for r, v in zip(requests, vectors)}
        return ModelRunnerOutput(pooled=pooled, model_s=time.perf_counter() - start)

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)
