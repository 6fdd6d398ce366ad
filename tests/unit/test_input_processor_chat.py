"""The one chat renderer works with both tokenizers: the frontend's torch-free one and
transformers' (the offline LLM's), whose apply_chat_template returns ids unless told not to."""

from __future__ import annotations

from common.validation import PromptLimits
from frontend.input_processor import InputProcessor

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]


def test_tokenize_chat_with_a_transformers_tokenizer(bundled_tokenizer):
    processor = InputProcessor(bundled_tokenizer, PromptLimits(bundled_tokenizer.vocab_size, 2048, 128, 16))
    text = processor.render_chat(MESSAGES)
    assert isinstance(text, str) and text.rstrip().endswith("assistant"), text
    ids = processor.tokenize_chat(MESSAGES)
    assert ids == bundled_tokenizer.encode(text, add_special_tokens=False)
    assert all(isinstance(i, int) for i in ids)


def test_tokenize_chat_with_the_frontend_tokenizer(bundled_tokenizer, tmp_path):
    from frontend.tokenizer import Tokenizer
    bundled_tokenizer.save_pretrained(str(tmp_path))
    ours = Tokenizer.from_dir(tmp_path)
    hf = InputProcessor(bundled_tokenizer, PromptLimits(bundled_tokenizer.vocab_size, 2048, 128, 16))
    light = InputProcessor(ours, PromptLimits(bundled_tokenizer.vocab_size, 2048, 128, 16))
    assert light.render_chat(MESSAGES) == hf.render_chat(MESSAGES)
    assert light.tokenize_chat(MESSAGES) == hf.tokenize_chat(MESSAGES)
