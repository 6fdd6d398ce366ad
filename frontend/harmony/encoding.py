"""openai-harmony's encoding for a model whose tokenizer is o200k_harmony (gpt-oss's).

openai-harmony reads the o200k_base ranks from a file, which it downloads from OpenAI's blob
store unless $TIKTOKEN_ENCODINGS_BASE names a folder holding it. A server may have no way
out, and needs none: the model's own tokenizer.json holds the same ranks (o200k_harmony is
o200k_base plus special tokens). The frontend writes them back as o200k_base.tiktoken in the
cache folder and checks the file against the SHA-256 openai-harmony checks, so a tokenizer
that is not o200k is refused here, by name, instead of rendering prompts the model can't read.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import os
from pathlib import Path

from openai_harmony import HarmonyEncoding, HarmonyEncodingName, HarmonyError, load_harmony_encoding
from transformers.convert_slow_tokenizer import bytes_to_unicode

from common.paths import cache_dir

log = logging.getLogger("pagedserve.frontend")

ARCHITECTURES = ("gpt_oss",)  # model types that speak harmony: chosen for them by "auto"
VOCABULARY_FOLDER_ENV = "TIKTOKEN_ENCODINGS_BASE"
FILE = "o200k_base.tiktoken"
SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
NUM_RANKS = 199_998  # o200k_base's tokens; harmony's special tokens follow
# The tokens the format is made of: a tokenizer must hold each at harmony's id.
STRUCTURE = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>")


def use_vocabulary_folder(folder: str | Path) -> None:
    os.environ[VOCABULARY_FOLDER_ENV] = str(folder)


def load(tokenizer) -> HarmonyEncoding:
    """The encoding for this frontend's tokenizer (frontend.tokenizer.Tokenizer); ValueError
    naming what is wrong when the tokenizer is not o200k_harmony."""
    if VOCABULARY_FOLDER_ENV not in os.environ:
        folder = cache_dir() / "o200k"
        if not _is_valid(folder / FILE):
            _write(folder / FILE, _ranks_file(tokenizer))
        use_vocabulary_folder(folder)
    try:
        encoding = load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
    except HarmonyError as e:  # a $TIKTOKEN_ENCODINGS_BASE without the file, or another one
        raise ValueError(f"harmony: {e} (the vocabulary folder: ${VOCABULARY_FOLDER_ENV} = "
                         f"{os.environ[VOCABULARY_FOLDER_ENV]})") from None
    for token in STRUCTURE:
        [expected] = encoding.encode(token, allowed_special="all")
        if tokenizer.backend_tokenizer.token_to_id(token) != expected:
            raise ValueError(f"harmony: the tokenizer does not hold {token} at id {expected}, as o200k_harmony "
                             "(gpt-oss's tokenizer) does; choose another --reasoning-parser / --tool-call-parser")
    return encoding


def _ranks_file(tokenizer) -> bytes:
    """The tokenizer's first NUM_RANKS tokens as o200k_base.tiktoken: `BYTES_B64 RANK` a line."""
    byte_of = {char: byte for byte, char in bytes_to_unicode().items()}
    by_id = {i: token for token, i in tokenizer.backend_tokenizer.get_vocab(with_added_tokens=False).items()}
    lines = []
    for rank in range(NUM_RANKS):
        token = by_id.get(rank)
        if token is None or any(c not in byte_of for c in token):
            raise ValueError(f"harmony: the tokenizer's token {rank} is not a byte-level BPE token, so it is "
                             "not o200k_harmony (gpt-oss's tokenizer)")
        lines.append(f"{base64.b64encode(bytes(byte_of[c] for c in token)).decode()} {rank}\n")
    data = "".join(lines).encode()
    if hashlib.sha256(data).hexdigest() != SHA256:
        raise ValueError("harmony: the tokenizer's vocabulary is not o200k_base's, which gpt-oss's tokenizer "
                         "holds; choose another --reasoning-parser / --tool-call-parser")
    return data


def _is_valid(path: Path) -> bool:
    return path.is_file() and hashlib.sha256(path.read_bytes()).hexdigest() == SHA256


def _write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")  # several frontends may start at once
    partial.write_bytes(data)
    partial.replace(path)


def for_model(architecture: str, tokenizer, wanted: bool | None):
    """The encoding where the model speaks harmony, else None. `wanted` None: by the model's
    architecture (gpt-oss does); True: named by hand (a failure to load raises); False: never.
    A gpt-oss with a tokenizer that is not o200k_harmony keeps its chat template, with a warning."""
    if wanted is False or (wanted is None and architecture not in ARCHITECTURES):
        return None
    try:
        return load(tokenizer)
    except ValueError as e:
        if wanted:
            raise
        log.warning("%s; its chat prompts go through its chat template instead", e)
        return None
