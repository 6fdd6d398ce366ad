"""The tokenizer's files, as the engine hands them to a frontend at the handshake: what
`save_pretrained` writes (frontend/tokenizer.py builds the tokenizer from them)."""

from __future__ import annotations

from pathlib import Path

from common.errors import ModelError
from common.hub import HubOptions, hub_name, hub_path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "chat_template.json",
                   "special_tokens_map.json")


def files_from_dir(path: str | Path) -> dict[str, bytes]:
    """The tokenizer's files in a `save_pretrained` folder, by name."""
    path = Path(path)
    if not (path / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{path} has no tokenizer.json (a fast tokenizer is needed)")
    return {name: (path / name).read_bytes() for name in TOKENIZER_FILES if (path / name).is_file()}


def resolve_tokenizer_dir(name: str, revision: str | None = None) -> Path:
    """A frontend's --tokenizer: a folder that exists, else a Hub repo id's tokenizer files in
    the Hub's cache (downloaded if missing: common/hub.py)."""
    hub = hub_name(name)
    if hub is None:
        return Path(name).expanduser()
    return hub_path(hub, "tokenizer", HubOptions(revision=revision), field="tokenizer")


def check_tokenizer_dir(name: str, path: Path | None = None, field: str = "tokenizer") -> Path:
    """A frontend's own --tokenizer folder (`path`, what `name` resolved to), once it is seen to
    hold what files_from_dir reads (the engine's --tokenizer may be any tokenizer transformers
    loads: engine.models.source)."""
    path = Path(name).expanduser() if path is None else path
    if not (path / "tokenizer.json").is_file():
        raise ModelError("no tokenizer.json there; give a fast tokenizer's folder, as save_pretrained writes it, "
                         "or a Hub repo id that has one", name, field)
    return path
