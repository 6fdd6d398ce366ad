"""One place that maps command-line flags onto `EngineConfig`."""

from __future__ import annotations

import argparse
from dataclasses import MISSING, fields

from engine.config import EngineConfig

HELP = {
    "model": "a Hugging Face Hub repo id (ORG/NAME; ORG/NAME:TAG picks a GGUF repo's file by quantization "
             "tag, e.g. :Q4_K_M), downloaded into the Hub's cache unless there already, or a local model "
             "folder or .gguf file, which wins over a repo of the same name (default: the bundled "
             "SmolLM2-135M-Instruct, also for an empty value)",
    "tokenizer": "tokenizer: a Hub repo id or a folder (default: the model's own)",
    "revision": "the model's Hub revision: a branch, tag or commit (default: main, also for an empty value)",
    "tokenizer_revision": "the --tokenizer's Hub revision (default: main)",
    "download_dir": "cache folder for Hub downloads (default: the Hugging Face cache: HF_HUB_CACHE, else "
                    "HF_HOME/hub, else ~/.cache/huggingface/hub)",
    "hf_file": "the GGUF file of a GGUF Hub repo to serve, by name (unset: the :TAG's file, else Q4_K_M's, "
               "else the first)",
    "dtype": "weight and KV-cache dtype; auto picks bfloat16 on CUDA, and on a CPU the faster of the "
             "bf16 and float32 quantized kernels, measured per machine (docs/cpu.md; without the kernels: "
             "bfloat16 where the CPU has AVX512-BF16 or AMX, float32 elsewhere)",
    "device": "auto (cuda where torch sees a GPU, else cpu; the start-up log says which), cpu, or cuda[:N]",
    "block_size": "tokens per KV-cache block",
    "num_kv_blocks": "KV-cache blocks; wins over --gpu-memory-utilization and --kv-cache-memory-gb "
                     "(default: sized by those)",
    "gpu_memory_utilization": "cuda only: the share F (0 < F <= 1) of the GPU's total memory this engine may "
                              "use for weights, activations and the KV cache, as vLLM reads it: the KV cache "
                              "gets F x total less the weights and the peak activations of a profiled step of "
                              "--max-num-batched-tokens (the start-up log gives the numbers); the CUDA context, "
                              "CUDA graphs and a draft model come on top, so 0.9 leaves them room. Wins over "
                              "--kv-cache-memory-gb; --num-kv-blocks wins over it; an error on cpu, where "
                              "--kv-cache-memory-gb sizes it (unset: --kv-cache-memory-gb sizes the KV cache)",
    "kv_cache_memory_gb": "KV-cache size in GiB, where neither --num-kv-blocks nor (on cuda) "
                          "--gpu-memory-utilization is given",
    "max_model_len": "longest prompt + output, in tokens (default: the model's, at most 8192); Phi-3 "
                     "LongRoPE uses its long factors for every request when this exceeds the original length",
    "max_num_batched_tokens": "token budget per engine step; longer prompts are chunked",
    "max_num_seqs": "most sequences running at once",
    "max_waiting_requests": "most requests waiting for a seat; more get RESOURCE_EXHAUSTED "
                            "(unset: no limit)",
    "enable_prefix_caching": "reuse KV blocks of shared prompt prefixes",
    "kv_offload_gb": "a second tier for the prefix cache, of N GiB per tensor-parallel rank: cached blocks "
                     "evicted from the KV cache are kept there (CPU: a file in --kv-offload-dir, allocated "
                     "whole at start; CUDA: pinned host memory) and copied back on a later prefix hit "
                     "instead of recomputed; needs --enable-prefix-caching; docs/operations.md (unset: off, "
                     "unless --kv-offload-dir is given, then 4)",
    "kv_offload_dir": "CPU: the directory for the second tier's file (turns the tier on, at 4 GiB unless "
                      "--kv-offload-gb says; unset: a fresh temporary directory); the file is unlinked once "
                      "mapped, so nothing is left behind; a directory that cannot hold it turns the tier "
                      "off with a log line",
    "scheduling_policy": "fcfs, or priority (lower value first)",
    "attention_backend": "auto (cpu on CPU where its kernels build, cupy on CUDA where cupy runs and the "
                         "head size is 64, 96 or 128, else torch), torch (the plain-torch "
                         "reference), cpu (C++ paged attention), or cupy (GPU kernels)",
    "quantization": "int4 or int8: quantize a float checkpoint's linear layers at load, in "
                    "blocks of 32; mxfp4: quantize a float mixture-of-experts checkpoint's experts to "
                    "MXFP4 at load (bfloat16 on a CPU with AVX512-BF16); none: dequantize a GGUF to --dtype "
                    "(unset: GGUF Q4_0/Q4_1/Q8_0/Q5_0/Q4_K run in blocks, float checkpoints dense)",
    "layer_kernels": "run the decoder's norms, rotary and SiLU-and-mul as fused kernels (cpu_kernels on a "
                     "CPU, cupy_kernels on CUDA) where they build; --no-layer-kernels: eager torch, "
                     "the reference (default: on)",
    "cpu_arithmetic": "auto: a CPU's quantized layers multiply the activations by the weights as stored, "
                      "every product exact, summed in float32 (the bf16, AMX or float32 kernels, measured "
                      "per machine); int8: "
                      "activations rounded to 8 bits per block of 32 and integer dot products, as llama.cpp "
                      "computes, for int4 and int8 weights (GGUF Q4_0/Q4_1/Q8_0/K-quants, GPTQ, AWQ, "
                      "--quantization int4|int8) and MXFP4 experts (gpt-oss's), with AVX512-VNNI and a "
                      "bfloat16 model: faster, but the numbers move away from Hugging Face's (docs/cpu.md)",
    "kv_cache_dtype": "how the KV cache stores keys and values: auto (the model's dtype), int8 (8-bit values "
                      "with a bfloat16 scale per token and head: 66 bytes a row at head size 64 instead of "
                      "bf16's 128, so ~1.9x the sequences in the same --kv-cache-memory-gb; the CPU kernels "
                      "read it, elsewhere the torch backend), or fp8 (float8 e4m3, scale 1.0: the CUDA "
                      "kernels' format, the torch backend elsewhere); docs/engine.md",
    "cuda_graphs": "capture decode steps in CUDA graphs (default: on with --device cuda when "
                   "attention runs on cupy, else off)",
    "async_scheduling": "schedule and launch the next decode step while the device runs this one, "
                        "where every running request decodes greedily or at a temperature (no top-k, "
                        "top-p, penalties, logit_bias, bad_words, allowed_token_ids or logprobs); pays on a GPU "
                        "(default: on where decode runs in CUDA graphs, else off); docs/engine.md",
    "async_admission_steps": "with async scheduling and the batch at least half full, decode steps that may "
                             "still go ahead while a request waits for a seat; the next synchronous step "
                             "admits every request that waited (0: admit at once)",
    "num_threads": "CPU threads for torch, split evenly over the tensor-parallel ranks, at least "
                   "1 each (default: $OMP_NUM_THREADS, else every CPU this process may use)",
    "tensor_parallel_size": "shard the model over N processes joined by torch.distributed (gloo on "
                            "CPU, NCCL on CUDA): this one is rank 0 and starts N-1 workers; the "
                            "model's attention heads must divide by N (the bundled SmolLM2: 1 or 3); "
                            "no --speculative-method draft, no CUDA graphs above 1",
    "speculative_method": "speculative decoding: ngram (prompt lookup: propose what followed the "
                          "context's last n-gram earlier on) or draft (a small model, "
                          "--speculative-model); verified losslessly by the model (unset: off)",
    "num_speculative_tokens": "most tokens proposed per request per step",
    "speculative_model": "draft model for --speculative-method draft: a Hub repo id, HF folder or .gguf sharing "
                         "the model's tokenizer (setting it implies --speculative-method draft)",
    "prompt_lookup_min": "ngram: shortest suffix n-gram to look up",
    "prompt_lookup_max": "ngram: longest suffix n-gram to look up (the longest match wins)",
    "enable_lora": "serve LoRA adapters (PEFT format) on the base model, mixed in one batch; "
                   "see docs/lora.md",
    "lora_modules": "adapters to load at start, as name=path (PEFT folders: adapter_config.json + "
                    "adapter_model.safetensors); implies --enable-lora",
    "max_loras": "distinct LoRA adapters one engine step may mix; requests for others wait",
    "max_lora_rank": "largest LoRA rank accepted (adapters above it are refused); the device "
                     "slots are this wide",
    "generation_config": "the requests' sampling defaults (temperature, top_p, top_k, min_p, "
                         "repetition_penalty, max_tokens), for the fields a request leaves unset: auto "
                         "takes the model's (an HF folder's generation_config.json, a GGUF's "
                         "general.sampling.* keys), vllm ignores them, or a folder holding a "
                         "generation_config.json (default: auto)",
    "task": "what the model serves: generate (text), embed (/v1/embeddings; a decoder embeds with its "
            "last token), or score (a cross-encoder: /score, /v1/rerank); auto: score for a "
            "*ForSequenceClassification model, embed for an encoder or a sentence-transformers folder, "
            "else generate (default: auto); docs/embeddings.md",
    "pooling": "embed: how a sequence's hidden states become one vector: mean, cls or last token "
               "(unset: the model's sentence-transformers config, else cls for an encoder, last for a decoder)",
}
CHOICES = {"dtype": ["float32", "bfloat16", "float16", "auto"], "scheduling_policy": ["fcfs", "priority"],
           "attention_backend": ["auto", "torch", "cpu", "cupy"], "quantization": ["none", "int4", "int8", "mxfp4"],
           "cpu_arithmetic": ["auto", "int8"], "kv_cache_dtype": ["auto", "int8", "fp8"],
           "speculative_method": ["ngram", "draft", "none"], "task": ["auto", "generate", "embed", "score"],
           "pooling": ["mean", "cls", "last"]}
METAVARS = {"generation_config": "auto|vllm|PATH", "gpu_memory_utilization": "F"}
# Flags whose empty value means the flag left out, for templates that always pass them
# (compose.yaml's --model "${PAGEDSERVE_MODEL:-}", the Kubernetes engine's $(PAGEDSERVE_MODEL)).
EMPTY_IS_UNSET = ("model", "revision")


def add_engine_args(parser: argparse.ArgumentParser, **defaults: object) -> None:
    """Add a --flag for every EngineConfig field; `defaults` override the dataclass's."""
    group = parser.add_argument_group("engine")
    for f in fields(EngineConfig):
        default = defaults.get(f.name, f.default if f.default is not MISSING else None)
        flag = "--" + f.name.replace("_", "-")
        if isinstance(f.default, bool) or f.type == "bool | None":  # None: decided by other flags
            group.add_argument(flag, default=default, action=argparse.BooleanOptionalAction,
                               help=HELP[f.name])
            continue
        if f.name == "lora_modules":
            group.add_argument(flag, default=default, nargs="+", metavar="NAME=PATH", help=HELP[f.name])
            continue
        kind = {"int": int, "float": float}.get(type(f.default).__name__, str)
        if f.name in ("num_kv_blocks", "max_model_len", "num_threads", "max_waiting_requests"):
            kind = int
        if f.name in ("gpu_memory_utilization", "kv_offload_gb"):
            kind = float
        if f.name in EMPTY_IS_UNSET:
            kind = _empty_is_none
        text = HELP[f.name]
        if "default:" not in text and "unset:" not in text:  # the help already says it otherwise
            text += f" (default: {default})"
        group.add_argument(flag, default=default, type=kind, choices=CHOICES.get(f.name), metavar=METAVARS.get(f.name),
                           help=text)
    # Not a field: the token goes to huggingface_hub through the environment (pagedserve.cli),
    # never into a config that is logged or a child's command line.
    group.add_argument("--hf-token", metavar="TOKEN",
                       help="Hugging Face token for gated or private repos (default: HF_TOKEN, else the saved login)")


def _empty_is_none(text: str) -> str | None:
    return text or None


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**{f.name: getattr(args, f.name) for f in fields(EngineConfig)})
