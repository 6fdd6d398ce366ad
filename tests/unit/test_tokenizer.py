"""The frontend's torch-free Tokenizer gives what the transformers tokenizer gives, from the
files the engine hands over: the bundled SmolLM2 (byte-level BPE), and tiny tokenizers
built here (word-level with clean-up, SentencePiece-style Metaspace, a template of our own)."""

from __future__ import annotations

import json

import pytest

from engine.models.loader import tokenizer_files
from frontend.tokenizer import Tokenizer

TEXTS = [
    "Hello, world!",
    "  leading and trailing spaces  ",
    "héllo 🤖 wörld 日本語 👋👍🏽",
    "Don't stop . , ? ! it's",
    "line one\nline two\n\n\ttabbed",
    "<|im_start|>user\nHi<|im_end|>\n<|endoftext|>",
]
CHATS = [
    [{"role": "user", "content": "Hi there"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}],
    [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "Hello"},
     {"role": "user", "content": "Again 🤖"}],
]


@pytest.fixture(scope="module")
def pair(bundled_tokenizer):
    return bundled_tokenizer, Tokenizer.from_files(tokenizer_files(bundled_tokenizer))


def test_handed_over_files(bundled_tokenizer):
    files = tokenizer_files(bundled_tokenizer)
    assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"} <= set(files)
    assert Tokenizer.from_files(files).chat_template == bundled_tokenizer.chat_template


@pytest.mark.parametrize("special", [True, False])
def test_encode(pair, special):
    hf, ours = pair
    for text in TEXTS:
        assert ours.encode(text, add_special_tokens=special) == hf.encode(text, add_special_tokens=special), text


@pytest.mark.parametrize("skip", [True, False])
def test_decode(pair, skip):
    hf, ours = pair
    for text in TEXTS:
        ids = hf.encode(text)
        assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), text
    assert ours.decode([]) == hf.decode([]) == ""


def test_tokens_and_ids(pair):
    hf, ours = pair
    ids = hf.encode(TEXTS[2] + TEXTS[5])
    assert ours.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids)
    assert ours.convert_ids_to_tokens(ids[3]) == hf.convert_ids_to_tokens(ids[3])
    assert ours.eos_token_id == hf.eos_token_id == 2
    assert ours.vocab_size == len(hf) == 49152


@pytest.mark.parametrize("messages", CHATS, ids=["user", "system", "multi-turn"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template(pair, messages, add_generation_prompt):
    hf, ours = pair
    want = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == want
    assert ("You are a helpful AI assistant" in want) == (messages[0]["role"] != "system")
    assert want.endswith("<|im_start|>assistant\n") == add_generation_prompt


def test_chat_template_continue_final_message(pair):
    hf, ours = pair
    messages = CHATS[1] + [{"role": "assistant", "content": "It is"}]
    want = hf.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    assert want.endswith("<|im_start|>assistant\nIt is")
    assert ours.apply_chat_template(messages, continue_final_message=True) == want


def test_chat_template_from_tokenizer_config(bundled_tokenizer):
    """Older folders keep the template in tokenizer_config.json, sometimes as a named list."""
    files = tokenizer_files(bundled_tokenizer)
    template = files.pop("chat_template.jinja").decode()
    config = json.loads(files["tokenizer_config.json"])
    for stored in (template, [{"name": "tool_use", "template": "x"}, {"name": "default", "template": template}]):
        files["tokenizer_config.json"] = json.dumps({**config, "chat_template": stored}).encode()
        assert Tokenizer.from_files(files).chat_template == template
    assert Tokenizer.from_files({"tokenizer.json": files["tokenizer.json"]}).chat_template is None


def test_from_files_needs_tokenizer_json():
    with pytest.raises(ValueError, match="tokenizer.json"):
        Tokenizer.from_files({"tokenizer_config.json": b"{}"})


def tiny_word_level(clean_up: bool):
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    words = ["<pad>", "<s>", "</s>", "<unk>", "hello", "world", ".", ",", "?", "!", "do", "n't", "it", "'s"]
    backend = RustTokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                 unk_token="<unk>", clean_up_tokenization_spaces=clean_up)
    hf.chat_template = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {{ eos_token }}"
                        "{% endfor %}{% if add_generation_prompt %}assistant{% endif %}")
    return hf


def tiny_metaspace():
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    words = ["<pad>", "<s>", "</s>", "<unk>", "▁hello", "▁world", "▁", "."]
    backend = RustTokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>")


@pytest.mark.parametrize("build", [lambda: tiny_word_level(True), lambda: tiny_word_level(False), tiny_metaspace],
                         ids=["word-level-clean-up", "word-level", "metaspace"])
def test_tiny_tokenizers(build):
    hf = build()
    ours = Tokenizer.from_files(tokenizer_files(hf))
    texts = ["hello world . do n't it 's ?", "hello  world , hello !", "hello unknown words", "<s> hello </s>"]
    for text in texts:
        for special in (True, False):
            ids = hf.encode(text, add_special_tokens=special)
            assert ours.encode(text, add_special_tokens=special) == ids, text
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), text
        assert ours.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids)
    assert ours.eos_token_id == hf.eos_token_id == 2
    if hf.chat_template is not None:
        for gen in (True, False):
            want = hf.apply_chat_template(CHATS[1], tokenize=False, add_generation_prompt=gen)
            assert ours.apply_chat_template(CHATS[1], add_generation_prompt=gen) == want
        assert want.startswith("<s>system Be brief. </s>")  # bos and eos reach the template


def test_clean_up_spaces_only_where_transformers_does():
    ids = tiny_word_level(True).encode("do n't it 's ?")
    assert Tokenizer.from_files(tokenizer_files(tiny_word_level(True))).decode(ids) == "don't it's?"
    assert Tokenizer.from_files(tokenizer_files(tiny_word_level(False))).decode(ids) == "do n't it 's ?"


def test_bpe_ignores_clean_up_like_transformers(bundled_tokenizer, tmp_path):
    from transformers import AutoTokenizer
    files = tokenizer_files(bundled_tokenizer)
    config = json.loads(files["tokenizer_config.json"])
    files["tokenizer_config.json"] = json.dumps({**config, "clean_up_tokenization_spaces": True}).encode()
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    ids = hf.encode("Don't stop . , ? ! it 's")
    assert Tokenizer.from_dir(tmp_path).decode(ids) == hf.decode(ids) == "Don't stop . , ? ! it 's"
