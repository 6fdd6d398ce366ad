"""A tiny random-weight gpt-oss with the real o200k_harmony tokenizer, for the harmony tests.

The tokenizer.json is built as transformers builds gpt-oss's own: its TikTokenConverter over
the o200k_base ranks (tests/o200k_vocab.py fetches them), with harmony's special tokens at
200,000 and up, as openai-harmony names them. The model's generation config stops on
`<|return|>` and `<|call|>`, as gpt-oss's does. Both are cached under the cache folder.
"""

from __future__ import annotations

import base64
import json
import shutil
from pathlib import Path

from transformers.convert_slow_tokenizer import TikTokenConverter

from common.paths import cache_dir
from o200k_vocab import fetch, vocab_path

# o200k_base's split pattern (tiktoken's, and gpt-oss's tokenizer.json).
PATTERN = "|".join([
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""", r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""", r"""\s*[\r\n]+""", r"""\s+(?!\S)""", r"""\s+""",
])
NUM_RANKS = 199_998  # o200k_base's ordinary tokens; the special ones follow
VOCAB_SIZE = 201_088  # gpt-oss's embedding rows
# gpt-oss's generation_config.json: <|return|>, <|endoftext|>, <|call|>.
EOS_TOKEN_IDS = [200002, 199999, 200012]


class _Ranks(TikTokenConverter):
    """transformers' converter, reading the ranks file itself (it would import tiktoken for that)."""

    @staticmethod
    def load_tiktoken_bpe(path: str) -> dict[bytes, int]:
        ranks = {}
        for line in Path(path).read_bytes().splitlines():
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
        return ranks


def tokenizer_folder() -> Path:
    """A folder with gpt-oss's tokenizer files (tokenizer.json, tokenizer_config.json)."""
    folder = cache_dir() / "o200k" / "harmony-tokenizer"
    if (folder / "tokenizer.json").is_file():
        return folder
    from openai_harmony import HarmonyEncodingName, load_harmony_encoding
    from transformers import PreTrainedTokenizerFast

    from frontend.harmony.encoding import use_vocabulary_folder
    use_vocabulary_folder(fetch().parent)
    encoding = load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
    specials = [encoding.decode([i]) for i in range(NUM_RANKS, VOCAB_SIZE)]
    backend = _Ranks(str(vocab_path()), pattern=PATTERN, extra_special_tokens=specials).converted()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|startoftext|>",
                                        eos_token="<|return|>", pad_token="<|endoftext|>")
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    tokenizer.save_pretrained(str(partial))
    shutil.rmtree(folder, ignore_errors=True)
    partial.replace(folder)
    return folder


def save_tiny_gpt_oss(folder: Path, **overrides) -> Path:
    """A random-weight gpt-oss (the tiny config of tests/helpers.py, the full vocabulary) with
    that tokenizer and gpt-oss's stop tokens, saved into `folder`."""
    import torch
    from transformers import AutoModelForCausalLM

    from helpers import tiny_hf_config
    torch.manual_seed(0)
    config = tiny_hf_config("gpt_oss", vocab_size=VOCAB_SIZE, eos_token_id=EOS_TOKEN_IDS,
                            pad_token_id=199999, **overrides)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(str(folder), safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_folder() / name, folder / name)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": EOS_TOKEN_IDS}))
    return folder
