"""gRPC end to end: `logit_bias`, `allowed_token_ids` and `bad_words` in SamplingParams (their
INVALID_ARGUMENTs are in test_grpc_validation.py)."""

from __future__ import annotations

from grpc_client import generate, greedy
from common.v1 import generation_pb2 as gen, tokenization_pb2 as tok

PROMPT = "The capital of France is"


def token_id(fe, text: str) -> int:
    [t] = fe.tokenization.Tokenize(tok.TokenizeRequest(text=text, add_special_tokens=False), timeout=10).token_ids
    return t


def test_logit_bias_forces_and_bans_tokens(frontend):
    forced = token_id(frontend, " yes")
    r = generate(frontend, text=PROMPT, sampling=greedy(6, ignore_eos=True, logit_bias={forced: 100}))
    assert r.tokens[0] == [forced] * 6
    plain = generate(frontend, text=PROMPT, sampling=greedy(6, ignore_eos=True)).tokens[0]
    avoided = generate(frontend, text=PROMPT, sampling=greedy(6, ignore_eos=True, logit_bias={plain[0]: -100}))
    assert avoided.tokens[0][0] != plain[0]
    frontend.wait_kv_free()


def test_allowed_token_ids_and_bad_words(frontend):
    allowed = [token_id(frontend, " yes"), token_id(frontend, " no"), 11]
    r = generate(frontend, text=PROMPT, sampling=gen.SamplingParams(
        n=2, temperature=1.5, seed=3, max_tokens=8, ignore_eos=True, allowed_token_ids=allowed))
    assert all(set(r.tokens[i]) <= set(allowed) and len(r.tokens[i]) == 8 for i in range(2))
    assert "Paris" in generate(frontend, text=PROMPT, sampling=greedy(6)).texts[0]
    banned = generate(frontend, text=PROMPT, sampling=greedy(6, bad_words=["Paris"]))
    assert "Paris" not in banned.texts[0] and banned.texts[0]
    frontend.wait_kv_free()
