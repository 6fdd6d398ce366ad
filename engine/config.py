"""Engine configuration: small per-component dataclasses, validated without touching disk.

`EngineConfig` is what users pass (flat keyword arguments to `LLM(...)`, or CLI
flags); it is split into the component configs the engine parts take.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields

DTYPES = ("float32", "bfloat16", "float16", "auto")
ATTENTION_BACKENDS = ("auto", "torch", "cpu", "cupy")
QUANTIZATIONS = (None, "none", "int4", "int8", "mxfp4")
SPECULATIVE_METHODS = (None, "ngram", "draft")
MAX_SPECULATIVE_TOKENS = 16
DEFAULT_OFFLOAD_GB = 4.0  # the second tier's size when only --kv-offload-dir is given
log = logging.getLogger("pagedserve.engine")


@dataclass
class EngineConfig:
    """Every knob of the engine, with defaults that work out of the box, on a CPU or a GPU."""

    model: str | None = None  # Hub repo id (ORG/NAME[:TAG]), HF folder or .gguf file; None = the bundled SmolLM2
    tokenizer: str | None = None  # defaults to the model's own
    # Where a Hub id's files come from (common/hub.py): a revision of the model (branch, tag or
    # commit) and of --tokenizer, another cache folder than the Hub's, a GGUF file by name.
    revision: str | None = None
    tokenizer_revision: str | None = None
    download_dir: str | None = None
    hf_file: str | None = None
    dtype: str = "auto"  # bfloat16 where bf16 is fast (CUDA, CPUs with bf16 instructions), else float32
    device: str = "auto"  # auto: cuda where torch sees a GPU, else cpu (resolved here, logged once)
    block_size: int = 16
    # The KV pool's size (engine/kv_sizing.py), first given wins: num_kv_blocks, then (cuda only)
    # gpu_memory_utilization, then kv_cache_memory_gb.
    num_kv_blocks: int | None = None
    # The share of the GPU's memory for weights, activations and KV, as vLLM reads it: the KV pool
    # gets what the weights and a profiled step leave of it.
    gpu_memory_utilization: float | None = None
    kv_cache_memory_gb: float = 1.0
    max_model_len: int | None = None  # None: the model's own limit, capped at 8192
    max_num_batched_tokens: int = 2048  # per-step token budget (chunked prefill above it)
    max_num_seqs: int = 128
    max_waiting_requests: int | None = None  # admission: refuse new requests past this many waiting
    enable_prefix_caching: bool = True
    # The prefix cache's second tier (engine/kv_offload): cached blocks evicted from the KV pool
    # go to host memory (CUDA: pinned) or a file in kv_offload_dir (CPU), and are restored from
    # there instead of recomputed. kv_offload_gb sets its size (per tensor-parallel rank); the
    # directory alone turns it on at DEFAULT_OFFLOAD_GB. None and None: off.
    kv_offload_gb: float | None = None
    kv_offload_dir: str | None = None
    scheduling_policy: str = "fcfs"  # or "priority"
    attention_backend: str = "auto"  # auto: cpu kernels on CPU, cupy on CUDA, where they run; else torch
    quantization: str | None = None  # int4 | int8 | mxfp4 (MoE experts): quantize float weights at load; none: dequantize GGUF
    # The decoder's norms, rotary and SiLU-and-mul as fused kernels (cpu_kernels on a CPU,
    # cupy_kernels on CUDA) where they build; off: eager torch, the reference.
    layer_kernels: bool = True
    # CPU: auto keeps exact float sums of the weights as stored (the bf16/AMX/float32 kernels,
    # chosen per machine); int8 rounds activations to 8 bits per block of 32 for integer dot
    # products, as llama.cpp does, where a kernel exists (MXFP4 experts): faster, not HF's numbers.
    cpu_arithmetic: str = "auto"
    # The KV cache's storage (engine/attention/kv_format.py): auto keeps the model's dtype; int8
    # (a scale per token and head; CPU kernels) and fp8 (e4m3; CUDA kernels) fit ~2x the blocks.
    kv_cache_dtype: str = "auto"
    cuda_graphs: bool | None = None  # decode in CUDA graphs; None: on for device cuda + backend cupy (or auto)
    # Schedule and launch decode step N+1 while the device runs step N (engine/async_step.py).
    # It pays with a GPU (a CPU runs the forward on the host's own cores, so nothing overlaps).
    # None: on where decode runs in CUDA graphs (the path measured and tested on an H100).
    async_scheduling: bool | None = None
    # With async scheduling and the batch at least half full: decode steps that may still go
    # ahead while a request waits for a free seat; the next synchronous step admits all that
    # waited at once (TGI's --max-waiting-tokens, in steps). 0: admit at once, every time.
    async_admission_steps: int = 4
    num_threads: int | None = None  # CPU: torch intra-op threads (default_num_threads()), split over TP ranks
    # Tensor parallel: shard the model over this many processes (this one is rank 0); the model's
    # attention heads must divide by it (checked once the model is read).
    tensor_parallel_size: int = 1
    # Speculative decoding: propose tokens (n-gram prompt lookup, or a small draft model) and
    # verify them all in one target step. None: off.
    speculative_method: str | None = None
    num_speculative_tokens: int = 4  # most tokens proposed per request per step
    speculative_model: str | None = None  # draft: Hub id, HF folder or .gguf with the target's tokenizer
    prompt_lookup_min: int = 2  # ngram: shortest suffix n-gram looked up
    prompt_lookup_max: int = 5  # ngram: longest
    # Multi-LoRA (docs/lora.md): PEFT adapters on the base model, mixed in one batch.
    enable_lora: bool = False
    lora_modules: dict[str, str] | None = None  # name -> adapter folder, loaded at start (implies enable_lora)
    max_loras: int = 4  # distinct adapters one step may mix (device slots)
    max_lora_rank: int = 16  # largest adapter rank accepted; the slots are this wide
    # The requests' sampling defaults (vLLM's flag): auto reads the model's (generation_config.json
    # of an HF folder, a GGUF's general.sampling.*), vllm ignores them, else a folder holding a
    # generation_config.json (engine/models/generation_config.py).
    generation_config: str = "auto"
    # What the model serves (engine/pooling.py): generate, embed (one vector per input) or
    # score (a cross-encoder's relevance of a text pair); auto reads it from the model.
    task: str = "auto"
    pooling: str | None = None  # embed: mean | cls | last; None: the model's sentence-transformers config

    def __post_init__(self) -> None:
        _positive("block_size", self.block_size)
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ValueError(f"block_size: must be one of 8, 16, 32, 64, 128, got {self.block_size}")
        if self.num_kv_blocks is not None:
            _positive("num_kv_blocks", self.num_kv_blocks)
        if not self.kv_cache_memory_gb > 0:
            raise ValueError(f"kv_cache_memory_gb: must be > 0, got {self.kv_cache_memory_gb}")
        if self.max_model_len is not None:
            _positive("max_model_len", self.max_model_len)
        self._check_kv_offload()
        _positive("max_num_batched_tokens", self.max_num_batched_tokens)
        _positive("max_num_seqs", self.max_num_seqs)
        if self.max_waiting_requests is not None:
            _positive("max_waiting_requests", self.max_waiting_requests)
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy: must be 'fcfs' or 'priority', got {self.scheduling_policy!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend: must be one of {', '.join(ATTENTION_BACKENDS)}, "
                             f"got {self.attention_backend!r}")
        if self.kv_cache_dtype not in ("auto", "int8", "fp8"):
            raise ValueError(f"kv_cache_dtype: must be one of auto, int8, fp8, got {self.kv_cache_dtype!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization: must be one of none, int4, int8, mxfp4 (or unset), got {self.quantization!r}")
        if not (self.device in ("auto", "cpu") or self.device.startswith("cuda")):
            raise ValueError(f"device: must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.device == "auto":  # first: every check below and the rest of the engine see cpu or cuda
            self.device = resolve_device(self.device)
            log.info("device auto: %s", _describe_auto(self.device))
        on_cuda = self.device.startswith("cuda")
        self._check_gpu_memory_utilization(on_cuda)
        self.dtype = resolve_dtype(self.dtype, self.device)  # the rest of the engine sees a real dtype
        if self.attention_backend == "cupy" and not on_cuda:
            raise ValueError("attention_backend: 'cupy' runs CUDA kernels; it needs device 'cuda'")
        if self.attention_backend == "cpu" and on_cuda:
            raise ValueError("attention_backend: 'cpu' runs CPU kernels; it needs device 'cpu'")
        _positive("tensor_parallel_size", self.tensor_parallel_size)
        if not isinstance(self.generation_config, str) or not self.generation_config:
            raise ValueError(f"generation_config: must be auto, vllm or a folder, got {self.generation_config!r}")
        if self.task not in ("auto", "generate", "embed", "score"):
            raise ValueError(f"task: must be one of auto, generate, embed, score, got {self.task!r}")
        if self.pooling not in (None, "mean", "cls", "last"):
            raise ValueError(f"pooling: must be one of mean, cls, last (or unset), got {self.pooling!r}")
        if self.async_admission_steps < 0:
            raise ValueError(f"async_admission_steps: must be >= 0, got {self.async_admission_steps}")
        # "auto" on CUDA means cupy where it runs; the model runner turns graphs off if the
        # model's head size sends it to torch instead.
        cupy_attention = on_cuda and (self.attention_backend == "cupy"
                                      or self.attention_backend == "auto" and _cupy_available())
        if self.cuda_graphs is None:  # resolved here, so the rest of the engine sees a bool
            self.cuda_graphs = cupy_attention
        elif self.cuda_graphs and not cupy_attention:
            raise ValueError("cuda_graphs: needs device 'cuda' and attention_backend 'cupy' (or 'auto' where "
                             f"cupy runs), got device {self.device!r} and attention_backend "
                             f"{self.attention_backend!r}")
        if self.cuda_graphs and self.tensor_parallel_size > 1:
            log.warning("cuda_graphs: off with tensor_parallel_size %d (our graphs hold no collectives)",
                        self.tensor_parallel_size)
            self.cuda_graphs = False

        self._check_speculative()
        self._check_lora()
        if self.async_scheduling is None:  # after the checks above, which may turn graphs off
            self.async_scheduling = self.cuda_graphs

    def _check_kv_offload(self) -> None:
        if self.kv_offload_gb is None and not self.kv_offload_dir:
            return
        if self.kv_offload_gb is None:
            self.kv_offload_gb = DEFAULT_OFFLOAD_GB
        if isinstance(self.kv_offload_gb, bool) or not self.kv_offload_gb > 0:
            raise ValueError(f"kv_offload_gb: must be > 0, got {self.kv_offload_gb!r}")
        if not self.enable_prefix_caching:
            raise ValueError("kv_offload_gb/kv_offload_dir: the second tier holds the prefix cache's blocks; "
                             "it needs --enable-prefix-caching")

    def _check_gpu_memory_utilization(self, on_cuda: bool) -> None:
        share = self.gpu_memory_utilization
        if share is None:
            return
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share <= 1:
            raise ValueError(f"gpu_memory_utilization: must be a number in (0, 1], got {share!r}")
        if not on_cuda:
            raise ValueError(f"gpu_memory_utilization: is for cuda, and this engine runs on {self.device}; "
                             "use --kv-cache-memory-gb (kv_cache_memory_gb) to size its KV cache")

    def _check_lora(self) -> None:
        _positive("max_loras", self.max_loras)
        _positive("max_lora_rank", self.max_lora_rank)
        self.lora_modules = parse_lora_modules(self.lora_modules)
        if self.lora_modules:
            self.enable_lora = True  # adapters to load say LoRA is wanted
        if not self.enable_lora:
            return
        if self.tensor_parallel_size > 1:
            raise ValueError(f"enable_lora: not with tensor_parallel_size {self.tensor_parallel_size} "
                             "(adapters are not sharded); use tensor_parallel_size 1")
        if self.speculative_method == "draft":
            raise ValueError("enable_lora: not with speculative_method 'draft' (the draft model has no "
                             "adapters); use 'ngram' or no speculation")
        if self.cuda_graphs:
            log.warning("cuda_graphs: off with enable_lora (a step's adapter slots change per step)")
            self.cuda_graphs = False

    def _check_speculative(self) -> None:
        if self.speculative_method == "none":
            self.speculative_method = None
        if self.speculative_method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_method: must be ngram or draft (or unset), got {self.speculative_method!r}")
        if self.speculative_model is not None and self.speculative_method is None:
            self.speculative_method = "draft"  # a draft model says which method
        if self.speculative_method == "draft" and self.speculative_model is None:
            raise ValueError("speculative_method 'draft' needs speculative_model: a small model with the "
                             "target's tokenizer")
        if self.speculative_method == "draft" and self.tensor_parallel_size > 1:
            raise ValueError(f"speculative_method 'draft' does not run with tensor_parallel_size "
                             f"{self.tensor_parallel_size}: use 'ngram', or tensor_parallel_size 1")
        if self.speculative_method == "ngram" and self.speculative_model is not None:
            raise ValueError("speculative_model: only for speculative_method 'draft', not 'ngram'")
        _positive("num_speculative_tokens", self.num_speculative_tokens)
        if self.num_speculative_tokens > MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens: at most {MAX_SPECULATIVE_TOKENS}, "
                             f"got {self.num_speculative_tokens}")
        _positive("prompt_lookup_min", self.prompt_lookup_min)
        _positive("prompt_lookup_max", self.prompt_lookup_max)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min ({self.prompt_lookup_min}) must be <= prompt_lookup_max "
                             f"({self.prompt_lookup_max})")

    @classmethod
    def from_kwargs(cls, **kwargs: object) -> EngineConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown engine option(s) {unknown}; known: {sorted(known)}")
        return cls(**kwargs)  # type: ignore[arg-type]


@dataclass(frozen=True)
class SchedulerConfig:
    """What the scheduler needs: budgets and the length limit."""

    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    policy: str = "fcfs"
    num_lookahead_tokens: int = 0  # KV slots past each step's tokens, for a draft model's drafts
    max_loras: int = 4  # distinct LoRA adapters the running requests may use at once
    async_admission_steps: int = 0  # EngineConfig.async_admission_steps


def resolve_device(device: str) -> str:
    """`device`, with "auto" made "cuda" where torch sees a GPU, else "cpu"."""
    if device != "auto":
        return device
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


def _describe_auto(device: str) -> str:
    """What "auto" found, for the start-up log: the GPU's name, or that there is none."""
    if device == "cpu":
        return f"{device} (no CUDA device)"
    import torch
    return f"{device} ({torch.cuda.get_device_name(device)})"


def resolve_dtype(dtype: str, device: str) -> str:
    """`dtype`, with "auto" made bfloat16 on CUDA; on a CPU, what the measured kernel plan
    of this machine prefers (cpu_kernels.dispatch: bfloat16 where its bf16 kernels beat the
    float32 ones), else bfloat16 where the CPU has bf16 instructions, else float32."""
    if dtype != "auto":
        return dtype
    if device.startswith("cuda"):
        return "bfloat16"
    from cpu_kernels.dispatch import machine_plan
    plan = machine_plan()
    if plan is not None:
        return plan.dtype
    return "bfloat16" if cpu_has_bf16() else "float32"


def cpu_has_bf16() -> bool:
    """Whether this CPU has bf16 instructions (AVX512-BF16 or AMX). Without them oneDNN
    emulates bf16 matmuls: about 5x slower than float32 on an AVX2-only EPYC. Read from
    /proc/cpuinfo so that the frontend needs no torch import; elsewhere: no."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def parse_lora_modules(modules: object) -> dict[str, str]:
    """`--lora-modules name=path ...` (a list of strings) or a dict, as a name -> path dict."""
    if not modules:
        return {}
    if isinstance(modules, dict):
        return {str(k): str(v) for k, v in modules.items()}
    if isinstance(modules, str):
        modules = [modules]
    out = {}
    for item in modules:
        name, sep, path = str(item).partition("=")
        if not sep or not name or not path:
            raise ValueError(f"lora_modules: expected name=path, got {item!r}")
        if name in out:
            raise ValueError(f"lora_modules: the name {name!r} is given twice")
        out[name] = path
    return out


def _positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name}: must be a positive integer, got {value!r}")


def _cupy_available() -> bool:
    import cupy_kernels
    return cupy_kernels.available()
