"""Rank 0's tensor-parallel workers: spawned processes that mirror its model steps.

    rank 0 (engine process)                       rank r (worker, spawned)
    Scheduler, BlockManager, Sampler              ModelRunner(shard r)
    ModelRunner(shard 0) ── broadcast StepPlan ──► same forward, same collectives
                          ◄── all-reduce / gather ─┘ (logits reach rank 0 only)

Workers block in the broadcast between steps (gloo and NCCL wait without spinning), so an
idle engine costs no CPU. Liveness, both ways:
- rank 0 has a thread waiting on the workers' process sentinels: a worker that exits while
  the engine runs logs "tensor-parallel worker rank R exited (code C); stopping the engine"
  and ends the engine process with code 1 (its collectives could never complete again);
- a worker ends when rank 0 does: a blocked gloo collective fails when rank 0's sockets
  close, and a thread checks once a second that its parent is still its parent (what frees
  a worker waiting at the shared-memory barrier). Workers ignore SIGINT and SIGTERM: Ctrl-C
  reaches the whole process group, and rank 0 stops them itself, after its drain.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

from engine.config import EngineConfig
from engine.distributed.shm import ShmHandle, create_handle
from engine.distributed.state import TPShard, broadcast_object, destroy_group, init_group

log = logging.getLogger("pagedserve.engine")
STOP = None  # the plan that tells workers to leave their loop
JOIN_TIMEOUT_S = 10.0


class WorkerGroup:
    """Spawns ranks 1..N-1 and joins the process group as rank 0."""

    def __init__(self, config: EngineConfig, model_path: Path, runner_class: type) -> None:
        """`runner_class`: what each worker builds its shard as (ModelRunner, which starts this
        group: passed in rather than imported, so that neither module imports the other)."""
        size = config.tensor_parallel_size
        self.shard = TPShard(0, size)
        self.closing = False
        port = _free_port()
        ctx = multiprocessing.get_context("spawn")
        # CPU ranks: shared-memory collectives, unless PAGEDSERVE_TP_SHM=0 (gloo alone: to measure the difference)
        use_shm = not config.device.startswith("cuda") and os.environ.get("PAGEDSERVE_TP_SHM", "1") != "0"
        self.shm = create_handle(size, ctx) if use_shm else None
        self.procs = {rank: ctx.Process(target=run_worker, args=(rank, size, port, config, model_path, runner_class,
                                                                 self.shm),
                                        name=f"tp-worker-{rank}", daemon=True)
                      for rank in range(1, size)}
        atexit.register(self.close)
        try:
            for proc in self.procs.values():
                proc.start()
            threading.Thread(target=self._watch, name="tp-watch", daemon=True).start()
            init_group(self.shard, port, config.device, self.shm)
        except BaseException:
            self.close()  # no worker or mapped file outlives a failed start
            raise
        log.info("tensor parallel: %d ranks over %s (workers %s)", size,
                 "nccl" if config.device.startswith("cuda") else "gloo",
                 ", ".join(str(p.pid) for p in self.procs.values()))

    def _watch(self) -> None:
        by_sentinel = {p.sentinel: rank for rank, p in self.procs.items()}
        ready = multiprocessing.connection.wait(list(by_sentinel))
        if self.closing:
            return
        rank = by_sentinel[ready[0]]
        proc = self.procs[rank]
        proc.join(timeout=1)
        log.error("tensor-parallel worker rank %d exited (code %s); stopping the engine", rank, proc.exitcode)
        self._kill()
        self._unlink_shm()  # os._exit runs no atexit handler
        for handler in logging.getLogger().handlers:
            handler.flush()
        sys.stderr.flush()
        os._exit(1)  # the main thread may be blocked in a collective that can never finish

    def stop(self) -> None:
        """Let the workers leave their loop (they wait for a plan), reap them, leave the group."""
        if self.closing:
            return
        self.closing = True  # before the workers exit: the watcher must not take it for a failure
        broadcast_object(STOP, self.shard)
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        for proc in self.procs.values():
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        self.close()

    def close(self) -> None:
        """End the workers now (at exit they may be blocked in a collective) and leave the group."""
        atexit.unregister(self.close)
        self.closing = True
        self._kill()
        destroy_group()
        self._unlink_shm()

    def _unlink_shm(self) -> None:
        """Rank 0 unlinks the file once every rank has mapped it; this covers a start that failed first."""
        if self.shm is not None:
            Path(self.shm.path).unlink(missing_ok=True)

    def _kill(self) -> None:
        for proc in self.procs.values():
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)


def run_worker(rank: int, size: int, port: int, config: EngineConfig, model_path: Path, runner_class: type,
               shm: ShmHandle | None = None) -> None:
    """A worker process's body: build its shard of the model, then run rank 0's plans."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s %(name)s[tp{rank}]: %(message)s")
    # Rank 0 decides when workers stop: Ctrl-C reaches the whole process group, and a
    # worker dying of it would turn the engine's drain into a crash.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _exit_with_parent()
    if config.device.startswith("cuda"):
        import torch
        base = int(config.device.partition(":")[2] or 0)
        config = dataclasses.replace(config, device=f"cuda:{base + rank}")
        torch.cuda.set_device(config.device)
    shard = TPShard(rank, size)
    init_group(shard, port, config.device, shm)
    runner = runner_class(config, model_path, eos_token_ids=(), shard=shard)
    try:
        while (plan := broadcast_object(None, shard)) is not STOP:
            runner.run_plan(plan)
    except RuntimeError as e:  # rank 0 went away mid-collective
        log.error("tensor-parallel worker rank %d: lost rank 0 (%s); exiting", rank, e)
        os._exit(1)
    destroy_group()


def _exit_with_parent() -> None:
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="tp-parent-watch", daemon=True).start()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
