"""The bundled Gemma 3 270M GGUF under a real `pagedserve serve --model ...` (one start),
asked through the `openai` SDK (a completion, and chat through Gemma's chat template) and
a gRPC stub."""

from __future__ import annotations

import pytest

from grpc_client import generate, greedy, user
from http_client import openai_client


@pytest.fixture(scope="module")
def gemma(procs):
    from engine.models.source import gemma3_model_path
    path = gemma3_model_path()
    with procs.serving("--model", str(path), "--dtype", "float32", "--num-kv-blocks", "128",
                       "--max-model-len", "1024", "--num-threads", "1", timeout_s=300) as fe:
        yield fe


# The first 8 greedy tokens of our engine and of HF on this file (tests/engine/test_gemma3.py
# checks the two agree); the packaged model is the base model, not the instruction-tuned one.
COMPLETION = " the capital of the country of France."


def test_gemma3_over_openai_and_grpc(gemma):
    from engine.models.gemma3 import CHAT_TEMPLATE
    assert "<start_of_turn>" in CHAT_TEMPLATE
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    with openai_client(gemma) as client:
        [model] = [m.id for m in client.models.list().data]
        assert "gemma" in model.lower()
        r = client.completions.create(model=model, prompt="The capital of France is", max_tokens=8,
                                      temperature=0, extra_body={"ignore_eos": True})
        assert r.choices[0].text == COMPLETION
        chat = client.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0)
    # <bos><start_of_turn>user\n ... <end_of_turn>\n<start_of_turn>model\n: the question's 7 tokens + 9
    assert chat.usage.prompt_tokens == 16, chat.usage
    answer = chat.choices[0].message.content
    assert answer and "<start_of_turn>" not in answer

    g = generate(gemma, chat=user(messages[0]["content"]), sampling=greedy(12))
    assert g.texts[0] == answer  # the same template and greedy tokens over gRPC
    completion = generate(gemma, text="The capital of France is", sampling=greedy(8, ignore_eos=True))
    assert completion.texts[0] == COMPLETION and len(completion.tokens[0]) == 8
    gemma.wait_kv_free()
