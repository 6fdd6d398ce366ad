"""Async scheduling: a decode step launched on the device, resolved later.

With `async_scheduling` on, `EngineCore.step()` launches step N+1 before it waits for step N:

    host:    schedule N | launch N | schedule N+1, launch N+1 | wait N, update N, return N's outputs | ...
    device:             | ========= N ========= | ========= N+1 ========= |

so the scheduling, the update and whatever the caller does with the outputs (the engine
process publishes them, the offline `LLM` detokenizes them) overlap the device's work. Step
N+1's input tokens are N's sampled ids, still on the device; the host has not seen them.

A step goes ahead only where that changes no output (`AsyncScheduler.schedule_ahead`,
`ModelRunner.can_launch`): every row a steady decode (one token, no drafts) sampling plain
greedy or plain random (an argmax, or a temperature and min_p drawn on the device; no
top-k/top-p, grammar, penalties, token controls, logprobs or `min_tokens` left), no adapters, one rank, and
nobody waiting who could be admitted (or, under load, not for more than
`async_admission_steps` steps). Stops are therefore applied one step late: a request that
ends with step N's token also ran in step N+1, whose token for it is dropped
(`Scheduler._append_steady`) and whose KV write lands in its own blocks, freed with it.
Everything else (prefills, top-k/top-p, speculative decoding, structured output, LoRA,
prompt logprobs) takes the synchronous path, a step at a time.
"""

from __future__ import annotations

import itertools
import operator
import time
from dataclasses import dataclass

import numpy as np
import torch

from engine.outputs import ModelRunnerOutput, SchedulerOutput
from engine.request import Request


@dataclass(slots=True)
class InflightStep:
    """A launched step: its sampled ids on the device and, once `done` has fired, on the host."""

    sched: SchedulerOutput
    requests: list[Request]  # row order
    token_ids: torch.Tensor  # [n] int64 on the device: the next step's inputs
    host: torch.Tensor  # [n] int64, pinned on CUDA: filled by an asynchronous copy
    done: torch.cuda.Event | None  # recorded after that copy; None on a CPU, where all is done
    start: float  # perf_counter at launch

    @classmethod
    def launched(cls, sched: SchedulerOutput, requests: list[Request], token_ids: torch.Tensor,
                 start: float) -> InflightStep:
        if token_ids.device.type != "cuda":
            return cls(sched, requests, token_ids, token_ids, None, start)
        host = torch.empty(token_ids.shape, dtype=token_ids.dtype, pin_memory=True)
        host.copy_(token_ids, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return cls(sched, requests, token_ids, host, done, start)

    def input_ids(self, requests: list[Request]) -> torch.Tensor:
        """The ids this step samples for `requests`, on the device: a subsequence of its own
        rows, in order (the ones that have not ended since)."""
        if len(requests) == len(self.requests) and all(map(operator.is_, requests, self.requests)):
            return self.token_ids
        rows = dict(zip(map(id, self.requests), itertools.count()))
        index = np.fromiter(map(rows.__getitem__, map(id, requests)), np.int64, len(requests))
        return self.token_ids[torch.from_numpy(index).to(self.token_ids.device, non_blocking=True)]

    def result(self) -> ModelRunnerOutput:
        """Wait for the step; its tokens as the runner's output (every row a steady decode)."""
        if self.done is not None:
            self.done.synchronize()
        return ModelRunnerOutput(steady_token_ids=self.host.tolist(), model_s=time.perf_counter() - self.start)
