"""End to end over HTTP with the unmodified `openai` SDK (and Anthropic's for /v1/messages):
`logit_bias`, vLLM's `allowed_token_ids` and `bad_words`, their 400s, and an engine started
with `--generation-config FOLDER`, whose defaults (greedy, 7 tokens) apply where a request
sets nothing. Every test ends with every KV block free."""

from __future__ import annotations

import json
import re

import openai
import pytest

from http_client import kv_free_after, model  # noqa: F401 - shared fixtures
from http_client import anthropic_client, assert_error, openai_client, post, tokenize

PROMPT = "The capital of France is"
DEFAULT_MAX_TOKENS = 7  # the generation config's max_new_tokens


@pytest.fixture(scope="module")
def frontend(servers, tmp_path_factory):
    """A frontend on an engine of its own, whose generation config sets defaults."""
    folder = tmp_path_factory.mktemp("generation-config")
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 0.0,
                                                               "max_new_tokens": DEFAULT_MAX_TOKENS}))
    flags = ("--generation-config", str(folder))
    fe = servers.frontend(engine=flags)
    log = "".join(servers.engine(*flags).proc.log)
    assert "using the model's generation config defaults: temperature=0, max_tokens=7" in log, log
    return fe


@pytest.fixture(scope="module")
def client(frontend):
    with openai_client(frontend) as c:
        yield c


def one_token(frontend, text: str) -> int:
    [t] = tokenize(frontend, prompt=text, add_special_tokens=False)
    return t


def complete(client, model, **kwargs) -> str:
    r = client.completions.create(model=model, prompt=PROMPT, **kwargs)
    return r.choices[0].text


# -- logit_bias, allowed_token_ids, bad_words ----------------------------------------------------

def test_logit_bias_forces_a_token(client, model, frontend):
    yes = one_token(frontend, " yes")
    text = complete(client, model, max_tokens=6, temperature=0.9, seed=1, logit_bias={str(yes): 100},
                    extra_body={"ignore_eos": True})
    assert text == " yes" * 6
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=4, logit_bias={str(yes): 100})
    assert chat.choices[0].message.content == " yes" * 4


def test_logit_bias_against_the_greedy_token_changes_the_output(client, model, frontend):
    plain = complete(client, model, max_tokens=6, temperature=0)
    first = tokenize(frontend, prompt=plain, add_special_tokens=False)[0]
    assert complete(client, model, max_tokens=6, temperature=0, logit_bias={str(first): -100}) != plain


def test_allowed_token_ids_restrict_every_token(client, model, frontend):
    allowed = [one_token(frontend, " yes"), one_token(frontend, " no")]
    text = complete(client, model, max_tokens=8, temperature=1.5, seed=2,
                    extra_body={"allowed_token_ids": allowed, "ignore_eos": True})
    assert re.fullmatch(r"( yes| no){8}", text), text


def test_bad_words_keep_a_word_out(client, model):
    assert "Paris" in complete(client, model, max_tokens=6, temperature=0)
    text = complete(client, model, max_tokens=6, temperature=0, extra_body={"bad_words": ["Paris"]})
    assert text and "Paris" not in text


@pytest.mark.parametrize("body, field", [
    ({"logit_bias": {"999999": 1}}, "logit_bias: token id 999999 is outside the vocabulary [0, 49152)"),
    ({"logit_bias": {"abc": 1}}, "logit_bias: keys must be token ids"),
    ({"logit_bias": {"5": 150}}, "logit_bias: the bias of token 5 must be a number in [-100, 100]"),
    ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias: at most 300"),
    ({"allowed_token_ids": []}, "allowed_token_ids: must hold at least one"),
    ({"allowed_token_ids": [1, 49152]}, "allowed_token_ids: token id 49152 is outside the vocabulary"),
    ({"bad_words": [""]}, "bad_words: every word"),
], ids=["logit_bias-vocab", "logit_bias-key", "logit_bias-150", "logit_bias-301", "allowed-empty",
        "allowed-vocab", "bad_words-empty"])
def test_bad_values_get_a_400_naming_the_field(frontend, model, body, field):
    for path, request in (("/v1/completions", {"prompt": PROMPT}),
                          ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})):
        error = assert_error(post(frontend, path, {"model": model, "max_tokens": 4, **request, **body}), 400,
                             "invalid_request_error", field)
        assert error["param"] == field.split(":")[0]


def test_the_sdk_raises_a_bad_request(client, model):
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        complete(client, model, max_tokens=4, logit_bias={"999999": 1})


# -- --generation-config: the model's defaults where a request sets nothing ---------------------

def test_unset_fields_take_the_generation_configs_defaults(client, model):
    unset = client.completions.create(model=model, prompt=PROMPT)
    assert unset.usage.completion_tokens <= DEFAULT_MAX_TOKENS
    greedy = complete(client, model, temperature=0, max_tokens=DEFAULT_MAX_TOKENS)
    assert unset.choices[0].text == greedy == complete(client, model)  # temperature 0 by default
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Tell me a story"}])
    assert chat.usage.completion_tokens == DEFAULT_MAX_TOKENS and chat.choices[0].finish_reason == "length"


def test_a_requests_own_values_override_them(client, model):
    assert client.completions.create(model=model, prompt=PROMPT, max_tokens=12,
                                     extra_body={"ignore_eos": True}).usage.completion_tokens == 12
    greedy = complete(client, model, max_tokens=12, extra_body={"ignore_eos": True})
    hot = {complete(client, model, max_tokens=12, temperature=2.0, seed=s, extra_body={"ignore_eos": True})
           for s in range(3)}
    assert hot - {greedy}, "a temperature of 2 sampled the greedy text three times"


def test_anthropic_messages_take_them_too(frontend, model):
    with anthropic_client(frontend) as client:
        texts = {client.messages.create(model=model, max_tokens=10, messages=[{"role": "user", "content": "Hi"}]
                                        ).content[0].text for _ in range(2)}
    assert len(texts) == 1  # greedy by the model's default
