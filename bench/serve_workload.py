"""One run's requests, sending them, and the in-process offline reference.

The dataset is built against the server it will run on: over gRPC, GetModelInfo gives the
vocabulary and the length limit and ShareGPT text is counted with the server's own Tokenize;
over the OpenAI API, bench.openai_client reads the same facts from the model's local files.
The embeddings dataset always goes over the OpenAI API (bench.serve_embeddings): `address` is
then the server's base URL, http://HOST:PORT/v1.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import gc
import statistics
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace

from bench import serve_embeddings, serve_structured
from bench.datasets import (BenchRequest, JsonRequest, load_sharegpt, load_structured_tasks,
                            prefix_repetition_requests, random_requests, sharegpt_requests, structured_requests)
from bench.load import RequestRecord, Send, arrival_offsets_s, generate, run_load
from engine.config import EngineConfig

NUM_WARMUP = 2
WARMUP_INPUT_LEN = 16
WARMUP_OUTPUT_LEN = 4


@dataclass
class Workload:
    """The requests of one run and what the JSON says about them."""

    requests: list[BenchRequest]
    model: dict  # GetModelInfo
    dataset: dict  # name, parameters, and the mean lengths drawn


def run_seed(seed: int, index: int) -> str:
    """Run `index`'s seed: a different draw per rate, the same across backends."""
    return f"{seed}:run{index}"


def build_workload(address: str, args: argparse.Namespace, plan, index: int, backend: str,
                   ratio: float | None = None) -> Workload:
    """`ratio`: the structured dataset's constrained share."""
    if backend == "openai" or plan.dataset == "embeddings":
        from bench.openai_client import describe_target
        model, count_tokens = describe_target(args, address)
        return _workload(model, count_tokens, args, plan, index)
    import grpc
    with grpc.insecure_channel(address) as channel:
        model = grpc_model_info(channel, address)
        if plan.dataset == "structured":
            return _workload(model, grpc_chat_counter(channel), args, plan, index, ratio)
        return _workload(model, grpc_token_counter(channel), args, plan, index)


def grpc_model_info(channel, address: str) -> dict:
    """GetModelInfo's facts the workloads need; SystemExit if the server does not answer."""
    import grpc

    from common.v1 import info_pb2, info_pb2_grpc
    try:
        info = info_pb2_grpc.InfoStub(channel).GetModelInfo(info_pb2.GetModelInfoRequest(), timeout=30)
    except grpc.RpcError as e:
        raise SystemExit(f"GetModelInfo on {address} failed: {e.code().name}: {e.details()}") from e
    return {"model_name": info.model_name, "architecture": info.architecture, "dtype": info.dtype,
            "vocab_size": info.vocab_size, "max_model_len": info.max_model_len}


def _workload(model: dict, count_tokens: Callable, args: argparse.Namespace, plan, index: int,
              ratio: float | None = None) -> Workload:
    if plan.dataset == "structured":
        requests, dataset = _structured(count_tokens, args, ratio)
    else:
        requests, dataset = _requests(count_tokens, args, plan, model, index)
    dataset.update({"name": plan.dataset, "num_prompts": len(requests), "seed": args.seed,
                    "mean_prompt_len": statistics.fmean(r.prompt_len for r in requests)})
    if plan.dataset != "structured":  # its replies end on their own: their lengths are in the report
        dataset["mean_output_len"] = statistics.fmean(r.output_len for r in requests)
    return Workload(requests, model, dataset)


def _requests(count_tokens: Callable[[str, bool], int], args: argparse.Namespace, plan, model: dict,
              index: int) -> tuple[list[BenchRequest], dict]:
    seed = run_seed(args.seed, index)
    if plan.dataset == "embeddings":
        return serve_embeddings.workload_requests(count_tokens, args, seed)
    if plan.dataset == "random":
        requests = random_requests(args.num_prompts, args.random_input_len, args.random_output_len,
                                   args.random_range_ratio, model["vocab_size"], seed)
        return requests, {"input_len": args.random_input_len, "output_len": args.random_output_len,
                          "range_ratio": args.random_range_ratio}
    if plan.dataset == "prefix-repetition":
        requests = prefix_repetition_requests(args.num_prompts, args.prefix_len, args.suffix_len, args.num_prefixes,
                                              args.prefix_output_len, model["vocab_size"], seed)
        return requests, {"prefix_len": args.prefix_len, "suffix_len": args.suffix_len,
                          "num_prefixes": args.num_prefixes, "output_len": args.prefix_output_len}
    return _sharegpt(count_tokens, args, plan, model)


def grpc_token_counter(channel) -> Callable[[str, bool], int]:
    """Counts with the server's own Tokenize (while `channel` is open)."""
    from common.v1 import tokenization_pb2, tokenization_pb2_grpc
    tokenize = tokenization_pb2_grpc.TokenizationStub(channel).Tokenize

    def count_tokens(text: str, add_special_tokens: bool) -> int:
        request = tokenization_pb2.TokenizeRequest(text=text, add_special_tokens=add_special_tokens)
        return len(tokenize(request, timeout=30).token_ids)

    return count_tokens


def grpc_chat_counter(channel) -> Callable[[str], int]:
    """Counts a user message as Generate renders it with the chat template."""
    from common.v1 import generation_pb2, tokenization_pb2, tokenization_pb2_grpc
    tokenize = tokenization_pb2_grpc.TokenizationStub(channel).Tokenize

    def count_tokens(message: str) -> int:
        chat = generation_pb2.Chat(messages=[generation_pb2.ChatMessage(role="user", content=message)])
        return len(tokenize(tokenization_pb2.TokenizeRequest(chat=chat), timeout=30).token_ids)

    return count_tokens


def _structured(count_tokens: Callable[[str], int], args: argparse.Namespace, ratio: float
                ) -> tuple[list[BenchRequest], dict]:
    """The same prompts at every ratio (the seed, not the run's): runs differ only in constraints."""
    prompts = load_structured_tasks()
    requests = structured_requests(prompts, args.num_prompts, ratio, args.structured_output_len, count_tokens,
                                   args.seed)
    if len(prompts) < args.num_prompts:
        print(f"note: the structured dataset has {len(prompts)} prompts for {args.num_prompts} requests; "
              "repeats follow (a prefix cache serves their prompts again)")
    return requests, {"structured_ratio": ratio, "num_constrained": sum(r.constrained for r in requests),
                      "distinct_prompts": len(prompts), "output_len_cap": args.structured_output_len,
                      "tasks": sorted({r.task for r in requests})}


def _sharegpt(count_tokens: Callable[[str, bool], int], args: argparse.Namespace, plan, model: dict
              ) -> tuple[list[BenchRequest], dict]:
    try:
        pairs = load_sharegpt(plan.dataset_path)
        requests, usable = sharegpt_requests(pairs, args.num_prompts, count_tokens, model["max_model_len"],
                                             args.sharegpt_output_len, args.seed)
    except ValueError as e:
        raise SystemExit(f"bench serve: {e}") from e
    if usable < args.num_prompts:
        print(f"note: {plan.dataset_path.name} has {usable} usable conversations for {args.num_prompts} "
              "prompts; drawing repeats (a prefix cache serves their prompts again)")
    return requests, {"path": str(plan.dataset_path), "conversations": len(pairs), "usable_conversations": usable,
                      "output_len_cap": args.sharegpt_output_len}


async def drive(address: str, workload: Workload, rate: float, args: argparse.Namespace, index: int,
                label: str, backend: str, before_timed: Callable[[], None] | None = None
                ) -> tuple[list[RequestRecord], float]:
    """A short warm-up on other prompts, then `before_timed()`, then the timed run, over
    `backend`'s API."""
    offsets_s = arrival_offsets_s(len(workload.requests), rate, args.burstiness, (args.seed, index))
    # Other prompts than the timed ones: the warm-up must not fill the prefix cache for them.
    warmup = random_requests(NUM_WARMUP, WARMUP_INPUT_LEN, WARMUP_OUTPUT_LEN, 0.0, workload.model["vocab_size"],
                             f"{args.seed}:warmup{index}")
    async with _sender(address, workload, args, backend) as send:
        await asyncio.gather(*(send(r, None) for r in warmup))
        if workload.dataset["name"] == "structured":  # the grammar library loads now, not in the timed run
            await send(serve_structured.warmup_request(WARMUP_OUTPUT_LEN), None)
        if before_timed is not None:
            before_timed()
        return await run_load(send, workload.requests, offsets_s, args.max_concurrency, desc=label)


@contextlib.asynccontextmanager
async def _sender(address: str, workload: Workload, args: argparse.Namespace, backend: str
                  ) -> AsyncIterator[Send]:
    """`send(request, run_start)` over one connection pool of the backend's API."""
    if workload.dataset["name"] == "embeddings":  # kept-alive connections, as the openai SDK's
        from bench import openai_client
        async with openai_client.open_client(address, args.api_key, keep_alive=True) as client:
            yield functools.partial(serve_embeddings.embed, client, workload.model["model_name"])
        return
    if backend == "openai":
        from bench import openai_client
        async with openai_client.open_client(address, args.api_key) as client:
            yield functools.partial(openai_client.generate, client, workload.model["model_name"])
        return
    import grpc

    from common.v1 import generation_pb2_grpc
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        if workload.dataset["name"] == "structured":
            # Its own requests (chat, constraint) and records (the reply, checked); the warm-up's
            # random ids go the plain way.
            plain = functools.partial(generate, stub)
            json_send = functools.partial(serve_structured.generate_json, stub)
            yield lambda r, start: json_send(r, start) if isinstance(r, JsonRequest) else plain(r, start)
            return
        yield functools.partial(generate, stub)


def time_offline(config: EngineConfig, args: argparse.Namespace) -> dict:
    """engine.LLM on the same prompts as run 0, freed before any server starts: they never
    share cores. Twice: capped at --max-concurrency sequences like the gRPC run (what serving
    costs on top of the engine), and with every prompt at once (the engine's own best)."""
    cap = min(config.max_num_seqs, args.max_concurrency or config.max_num_seqs)
    same = _time_offline_once(replace(config, max_num_seqs=cap), args)
    return {**same, "all_at_once": _time_offline_once(config, args)}


def _time_offline_once(config: EngineConfig, args: argparse.Namespace) -> dict:
    from pagedserve import LLM, SamplingParams
    llm = LLM(**vars(config))
    vocab = llm.engine.vocab_size
    requests = random_requests(args.num_prompts, args.random_input_len, args.random_output_len,
                               args.random_range_ratio, vocab, run_seed(args.seed, 0))
    warmup = random_requests(NUM_WARMUP, WARMUP_INPUT_LEN, WARMUP_OUTPUT_LEN, 0.0, vocab, f"{args.seed}:warmup")
    llm.generate([r.prompt for r in warmup], SamplingParams(temperature=0, max_tokens=WARMUP_OUTPUT_LEN,
                                                            ignore_eos=True))
    llm.reset_prefix_cache()
    params = [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True) for r in requests]
    start = time.perf_counter()
    outs = llm.generate([r.prompt for r in requests], params, use_tqdm=True)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    del llm, outs
    gc.collect()
    prompt_tokens = sum(r.prompt_len for r in requests)
    return {"output_tokens": tokens, "seconds": seconds, "output_tok_s": tokens / seconds,
            "total_tok_s": (tokens + prompt_tokens) / seconds, "max_num_seqs": config.max_num_seqs}
