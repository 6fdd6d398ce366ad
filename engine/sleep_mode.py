"""Sleep, wake and weight updates of one engine's model runner (docs/engine.md, "Sleep, wake
and weight updates"); `EngineCore.sleep`, `wake_up` and `update_weights` call these between
steps, after preempting every running request (no request holds KV then).

    awake ──sleep(1)──► level 1: KV caches freed; weights on the host (CUDA: moved to CPU memory)
      ▲   ──sleep(2)──► level 2: KV caches and weights freed
      └──── wake_up ─── KV caches allocated again; level 2: weights loaded again from their path

An update builds a whole new model object from the new path beside the live one, checks every
tensor's name, shape and dtype against the live model's, and only then swaps the object: a
missing path, another architecture or one wrong shape leaves the old weights serving. A new
object, not copies into the old one: everything built from the weights at load (oneDNN's packed
layouts, the CPU one-call decode layers, quantized blocks) is built again with it.
"""

from __future__ import annotations

import gc
import logging
from pathlib import Path

import torch

from common.errors import InvalidRequest
from engine.model_runner import ModelRunner
from engine.models.loader import read_arch_config, release_freed_memory
from engine.vision import VisionInputs

log = logging.getLogger("pagedserve.engine")
LEVELS = {1: "KV cache freed, weights kept in host memory", 2: "KV cache and weights freed"}


def check_supported(core, what: str) -> ModelRunner:
    """The core's model runner, or InvalidRequest naming what this engine cannot do yet."""
    runner = core.model_runner
    if not isinstance(runner, ModelRunner) or core.pooler.pools:
        raise InvalidRequest(f"{what}: not for a model that pools (--task {core.pooler.task}) yet")
    if runner.workers is not None:
        raise InvalidRequest(f"{what}: not with tensor parallelism (--tensor-parallel-size "
                             f"{core.config.tensor_parallel_size}) yet: the shards live in the workers' processes")
    if core.config.speculative_method == "draft":
        raise InvalidRequest(f"{what}: not with a draft model (--speculative-method draft) yet: its own weights "
                             "and KV cache would stay as they are")
    return runner


def check_level(core, level: int) -> ModelRunner:
    if level not in LEVELS:
        raise InvalidRequest("level: 1 (free the KV cache, keep the weights in host memory) or 2 (free both)")
    runner = check_supported(core, "sleep")
    if level == 2 and runner.lora is not None:
        raise InvalidRequest("level: 2 frees the weights, and with --enable-lora the adapters' layers wrap them; "
                             "use level 1")
    if level == 2 and runner.vision is not None:
        raise InvalidRequest(f"level: 2 is not for a vision-language model ({runner.arch.model_type}) yet; "
                             "use level 1")
    return runner


def put_to_sleep(runner: ModelRunner, level: int) -> None:
    """Free the KV caches and (level 2) the weights, or (level 1, CUDA) move them to CPU memory."""
    runner.kv_caches = []
    runner.graphs = None  # captured over the caches' and weights' addresses
    runner._last_steady = None  # rows of requests that were preempted since
    if runner.kv_offload is not None:  # the sleep forgot its index (reset_prefix_cache)
        runner.kv_offload.release_pages()
    if level == 2:
        runner.model = None
    elif runner.device.type != "cpu":
        move_tensors(runner.model, torch.device("cpu"))
    free_memory(runner.device)


def wake(runner: ModelRunner, weights_path: Path) -> None:
    """Undo `put_to_sleep`: weights back (level 2: loaded from `weights_path`, unless an update
    while asleep loaded them already), KV caches allocated the runner's own way, CUDA graphs
    captured again."""
    if runner.model is None:
        runner.model = runner.load_weights(weights_path)
    elif runner.device.type != "cpu":
        move_tensors(runner.model, runner.device)
    runner.kv_caches = runner._kv_caches(runner.num_kv_blocks)
    _capture(runner)


def load_checked(runner: ModelRunner, path: str, expected: dict[str, tuple]) -> torch.nn.Module:
    """`path`'s weights in a new model object, checked tensor by tensor against `expected`
    (the live weights' `signature`); InvalidRequest (naming the first difference) where they
    do not fit."""
    folder = Path(path).expanduser() if isinstance(path, str) and path else None
    if folder is None or not folder.exists():
        raise InvalidRequest(f"model_path: {path!r} does not exist on the engine (a local model folder or "
                             "GGUF file, as the engine sees it)")
    try:
        arch = read_arch_config(folder)
    except Exception as e:  # noqa: BLE001 - a config that does not read, however it fails: the caller's
        raise InvalidRequest(f"model_path: {path!r} holds no model this engine reads ({type(e).__name__}: {e})")
    if arch.model_type != runner.arch.model_type:
        raise InvalidRequest(f"model_path: {path!r} is a {arch.model_type} model; this engine serves "
                             f"{runner.arch.model_type}, and an update keeps the architecture")
    try:
        new = runner.load_weights(folder, arch)
    except Exception as e:  # noqa: BLE001 - a broken checkpoint (missing tensor, bad file): the caller's
        raise InvalidRequest(f"model_path: could not load {path!r} ({type(e).__name__}: {e})")
    mismatch = first_mismatch(expected, signature(new))
    if mismatch is not None:
        del new
        free_memory(runner.device)
        raise InvalidRequest(f"model_path: {path!r} does not fit the live model: {mismatch}")
    return new


def signature(model: torch.nn.Module) -> dict[str, tuple]:
    """Every tensor's name -> (shape, dtype): what an update must keep (kept through a level-2
    sleep, which frees the model)."""
    return {name: (list(t.shape), t.dtype) for name, t in model.state_dict().items()}


def first_mismatch(ours: dict[str, tuple], theirs: dict[str, tuple]) -> str | None:
    """The first tensor whose name, shape or dtype differs between two signatures, in words."""
    for name in ours.keys() - theirs.keys():
        return f"it has no {name}"
    for name in theirs.keys() - ours.keys():
        return f"it has {name}, which the live model has not"
    for name, (shape, dtype) in ours.items():
        other_shape, other_dtype = theirs[name]
        if other_shape != shape:
            return f"{name} is {other_shape}, the live model's is {shape}"
        if other_dtype != dtype:
            return f"{name} is {other_dtype}, the live model's is {dtype}"
    return None


def swap_model(runner: ModelRunner, new: torch.nn.Module, asleep: bool = False) -> None:
    """Serve `new` from the next step on (no step runs now, and no request holds KV);
    `asleep`: from the wake on, which captures the CUDA graphs."""
    runner.graphs = None
    runner._last_steady = None
    runner.model = new
    if runner.vision is not None:  # its encoder cache holds the old weights' embeddings
        runner.vision = VisionInputs(new, runner.device)
    free_memory(runner.device)
    if not asleep:
        _capture(runner)


def move_tensors(model: torch.nn.Module, device: torch.device) -> None:
    """Every parameter and buffer, and any tensor a module keeps as a plain attribute (a kernel's
    packed weights), to `device`."""
    model.to(device)
    for module in model.modules():
        for name, value in list(vars(module).items()):
            if isinstance(value, torch.Tensor) and value.device != device:
                setattr(module, name, value.to(device))


def free_memory(device: torch.device) -> None:
    """Give freed tensors' memory back: to the system on CPU (glibc keeps freed heap pages
    otherwise; large blocks were mmap'd and are unmapped already), to the driver on CUDA."""
    gc.collect()  # a module graph may hold itself in a cycle (a layer's packed state)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    release_freed_memory()


def _capture(runner: ModelRunner) -> None:
    if runner.config.cuda_graphs and runner.backend.name == "cupy":
        runner.graphs = runner._capture_graphs()


def describe(level: int) -> str:
    return f"asleep at level {level} ({LEVELS[level]})"


def log_sleep(level: int, num_preempted: int) -> None:
    log.info("%s; %d running requests preempted, to recompute on wake", describe(level), num_preempted)
