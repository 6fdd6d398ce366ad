"""A Hugging Face tokenizer without torch: the `tokenizers` library plus transformers' own
chat-template renderer.

transformers' AutoTokenizer imports torch as soon as torch is installed (through its config
and RoPE modules), and a frontend that imports torch starts seconds slower and carries
hundreds of MB it never uses. TGI's router makes the same choice: the Rust tokenizer and
the chat template, nothing else.

The files are what `save_pretrained` writes (tokenizer.json, tokenizer_config.json,
chat_template.jinja). The engine hands them over at the handshake, so the frontend needs no
model files of its own (common.tokenizer_files / `Tokenizer.from_files`).
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as RustTokenizer
# At start-up, not on the first chat request: importing transformers takes 1-3 s, and
# in a request it would stall the event loop (and with it every stream and heartbeat).
from transformers.utils.chat_template_utils import render_jinja_template

from common.tokenizer_files import files_from_dir

_SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class Tokenizer:
    """The part of a transformers tokenizer the frontend uses, with the same names and results:
    encode, decode, convert_ids_to_tokens, apply_chat_template, eos_token_id."""

    def __init__(self, backend: RustTokenizer, config: dict, chat_template: str | None) -> None:
        # A tokenizer.json may carry padding and truncation (all-MiniLM-L6-v2's pads every
        # text to 128 tokens); transformers sets both per call, and so do we (`encode_truncated`).
        backend.no_padding()
        backend.no_truncation()
        self.backend = backend
        self.config = config
        self.chat_template = chat_template
        self.special_tokens_map = {k: _token_text(config[k]) for k in _SPECIAL if config.get(k)}
        eos = self.special_tokens_map.get("eos_token")
        self.eos_token_id = backend.token_to_id(eos) if eos is not None else None
        self.clean_up_tokenization_spaces = bool(config.get("clean_up_tokenization_spaces"))
        self._clean_up = cleans_up_spaces(backend, self.clean_up_tokenization_spaces)

    @classmethod
    def from_files(cls, files: dict[str, bytes]) -> Tokenizer:
        if "tokenizer.json" not in files:
            raise ValueError("tokenizer files: tokenizer.json is missing")
        config = json.loads(files.get("tokenizer_config.json", b"{}"))
        template = config.get("chat_template")
        if "chat_template.jinja" in files:
            template = files["chat_template.jinja"].decode()
        elif "chat_template.json" in files:
            template = json.loads(files["chat_template.json"]).get("chat_template")
        if isinstance(template, list):  # named templates: the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        return cls(RustTokenizer.from_str(files["tokenizer.json"].decode()), config, template)

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        return cls.from_files(files_from_dir(path))

    @property
    def backend_tokenizer(self) -> RustTokenizer:
        """transformers' name for it: the incremental detokenizer decodes with it directly."""
        return self.backend

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_truncated(self, text: str, max_tokens: int | None, pair: str | None = None) -> tuple[list[int], int]:
        """(ids, where `pair`'s tokens start or 0) of a text or a text pair with the special
        tokens, the longest part cut first to `max_tokens` in all (None: no limit), as
        transformers' `truncation=True` and sentence-transformers do."""
        if max_tokens is not None:
            self.backend.enable_truncation(max_tokens, strategy="longest_first")
        try:
            encoding = self.backend.encode(text, pair)
        finally:
            if max_tokens is not None:
                self.backend.no_truncation()
        types = encoding.type_ids
        start = types.index(1) if pair is not None and 1 in types else 0
        return encoding.ids, start

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        text = self.backend.decode(token_ids, skip_special_tokens=skip_special_tokens)
        return _clean_up(text) if self._clean_up else text

    def convert_ids_to_tokens(self, ids: int | list[int]) -> str | list[str]:
        if isinstance(ids, int):
            return self.backend.id_to_token(ids)
        return [self.backend.id_to_token(i) for i in ids]

    def apply_chat_template(self, messages: list[dict], *, add_generation_prompt: bool = False,
                            continue_final_message: bool = False, tools: list[dict] | None = None,
                            **kwargs: object) -> str:
        """The rendered prompt text (transformers' renderer; `tokenize=False` in its terms)."""
        if self.chat_template is None:
            raise ValueError("this model has no chat template")
        kwargs.pop("tokenize", None)  # always text here; accepted for transformers' signature
        rendered, _ = render_jinja_template(
            conversations=[messages], tools=tools, chat_template=self.chat_template,
            add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
            **{**self.special_tokens_map, **kwargs})
        return rendered[0]


def cleans_up_spaces(backend: RustTokenizer, clean_up_tokenization_spaces: bool) -> bool:
    """Whether decode cleans up spaces after the backend's decode, as transformers does. It
    skips this for BPE models: it deletes real spaces there."""
    return bool(clean_up_tokenization_spaces) and type(backend.model).__name__ != "BPE"


def _token_text(value: object) -> str:
    return value["content"] if isinstance(value, dict) else str(value)  # an AddedToken dict or a string


def _clean_up(text: str) -> str:
    for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                 (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(a, b)
    return text
