"""Multi-LoRA through both APIs, end to end: one `pagedserve serve` (a frontend over two
engine processes: data parallel) on a tiny random Llama with tiny peft adapters made here.
The openai SDK names an adapter in `model` and gets what the offline `LLM` gives with that
adapter (greedy); an unknown name is the SDK's NotFoundError; /v1/models lists the adapters;
an adapter loaded at run time through the admin route (API key required) is loaded on both
engines and serves, one above --max-lora-rank is a 400, and one unloaded is gone from both
and a 404 again. gRPC names it in `lora_name`; an unknown one is NOT_FOUND."""

from __future__ import annotations

import time

import grpc
import httpx
import openai
import pytest
import torch

from bench.lora_adapters import save_random_adapter
from grpc_client import generate, greedy
from helpers import build_tiny_model
from common.v1 import info_pb2
from pagedserve.health import ping_engine

KEY = "lora-test-key"
MAX_TOKENS = 8
PROMPT = "Tell me a story about a cat"
MESSAGES = [{"role": "user", "content": "Tell me a story"}]
ENGINE = ["--dtype", "float32", "--num-kv-blocks", "128", "--max-model-len", "512", "--num-threads", "1"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory, bundled_tokenizer):
    """A tiny Llama with the bundled tokenizer's whole vocabulary (so text and chat prompts
    work) and adapters: a (rank 8), b (rank 4, every projection), big (rank 16)."""
    from transformers import AutoModelForCausalLM
    root = tmp_path_factory.mktemp("lora-api")
    folder = build_tiny_model("llama", root / "base", bundled_tokenizer, vocab_size=len(bundled_tokenizer))
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    every = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    adapters = {name: save_random_adapter(model, root / name, rank, targets, seed=seed)
                for seed, (name, rank, targets) in enumerate((("a", 8, ["q_proj", "v_proj"]), ("b", 4, every),
                                                             ("big", 16, ["q_proj"])))}
    return folder, adapters


@pytest.fixture(scope="module")
def offline(setup):
    """The offline LLM's greedy text and tokens for PROMPT and MESSAGES, per adapter (None: base)."""
    from pagedserve.llm import LLM
    from common.sampling_params import SamplingParams
    folder, adapters = setup
    llm = LLM(str(folder), dtype="float32", num_kv_blocks=64, max_model_len=512, max_lora_rank=8,
              lora_modules={"a": str(adapters["a"]), "b": str(adapters["b"])})
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    chat = llm.input.tokenize_chat(MESSAGES)  # the renderer the frontend uses
    out = {}
    for name in (None, "a", "b"):
        text, chat_out = llm.generate([PROMPT, chat], params, lora_name=name)
        out[name] = {"text": text.outputs[0].text, "tokens": text.outputs[0].token_ids,
                     "chat": chat_out.outputs[0].text}
    assert out["a"]["tokens"] != out[None]["tokens"] != out["b"]["tokens"]  # the adapters change the output
    return out


@pytest.fixture(scope="module")
def server(setup, procs):
    folder, adapters = setup
    port = procs.free_port(span=2)  # the two engines listen on port and port + 1
    proc = procs.pagedserve("serve", "--engine-address", f"tcp://127.0.0.1:{port}", "--data-parallel-size", "2",
                            "--grpc-port", "0", "--http-port", "0", "--model", str(folder), *ENGINE,
                            "--served-model-name", "base", "--api-key", KEY, "--lora-modules", f"a={adapters['a']}",
                            "--max-lora-rank", "8", "--max-loras", "2")
    fe = procs.Frontend(proc, *procs.read_addresses(proc))
    fe.engines = [f"tcp://127.0.0.1:{port + i}" for i in range(2)]
    try:
        fe.wait_serving(timeout_s=180)
        deadline = time.monotonic() + 120
        while not all(e.id for e in fe.server_info().engines) and time.monotonic() < deadline:
            time.sleep(0.2)  # both engines' handshakes, so a load reaches both at once
        yield fe
    finally:
        fe.close()


def client(fe) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{fe.http_url}/v1", api_key=KEY, max_retries=0, timeout=60)


def complete(fe, model: str) -> str:
    r = client(fe).completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert r.model == model
    return r.choices[0].text


def admin(fe, route: str, body: dict, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{fe.http_url}/v1/{route}", json=body, headers=headers, timeout=60)


def test_openai_sdk_names_the_adapter_in_model(server, offline):
    assert complete(server, "a") == offline["a"]["text"]
    assert complete(server, "base") == offline[None]["text"]
    chat = client(server).chat.completions.create(model="a", messages=MESSAGES, max_tokens=MAX_TOKENS,
                                                  temperature=0, extra_body={"ignore_eos": True})
    assert chat.choices[0].message.content == offline["a"]["chat"]
    for create in (lambda: complete(server, "nope"),
                   lambda: client(server).chat.completions.create(model="nope", messages=MESSAGES, max_tokens=2)):
        with pytest.raises(openai.NotFoundError) as info:
            create()
        assert "The model `nope` does not exist" in info.value.message and info.value.code == "model_not_found"
    models = {m.id: m for m in client(server).models.list().data}
    assert set(models) == {"base", "a"} and models["a"].parent == "base"
    assert models["a"].root.endswith("/a") and models["base"].parent is None


def test_admin_load_use_and_unload(server, offline, setup):
    _, adapters = setup
    load_b = {"lora_name": "b", "lora_path": str(adapters["b"])}
    assert admin(server, "load_lora_adapter", load_b, key=None).status_code == 401
    loaded = admin(server, "load_lora_adapter", load_b)
    assert loaded.status_code == 200, loaded.text
    assert [sorted(ping_engine(e, timeout_s=10).lora_names) for e in server.engines] == [["a", "b"]] * 2
    assert complete(server, "b") == offline["b"]["text"]
    again = admin(server, "load_lora_adapter", load_b)
    assert again.status_code == 400 and "already" in again.json()["error"]["message"]
    big = admin(server, "load_lora_adapter", {"lora_name": "big", "lora_path": str(adapters["big"])})
    assert big.status_code == 400 and "exceeds --max-lora-rank 8" in big.json()["error"]["message"], big.text
    assert "big" not in {m.id for m in client(server).models.list().data}
    assert admin(server, "unload_lora_adapter", {"lora_name": "b"}).status_code == 200
    assert [list(ping_engine(e, timeout_s=10).lora_names) for e in server.engines] == [["a"]] * 2
    with pytest.raises(openai.NotFoundError):
        complete(server, "b")
    gone = admin(server, "unload_lora_adapter", {"lora_name": "b"})
    assert gone.status_code == 404 and gone.json()["error"]["type"] == "not_found_error"
    server.wait_kv_free()


def test_grpc_lora_name(server, offline):
    r = generate(server, text=PROMPT, sampling=greedy(MAX_TOKENS, ignore_eos=True), lora_name="a")
    assert r.tokens[0] == offline["a"]["tokens"]
    with pytest.raises(grpc.RpcError) as info:
        generate(server, text=PROMPT, sampling=greedy(2), lora_name="nope")
    assert info.value.code() == grpc.StatusCode.NOT_FOUND and "`nope` does not exist" in info.value.details()
    model = server.info.GetModelInfo(info_pb2.GetModelInfoRequest(), timeout=10)
    assert model.lora_enabled and model.max_lora_rank == 8
    assert [(a.name, a.rank) for a in model.lora_adapters] == [("a", 8)]
    server.wait_kv_free()
