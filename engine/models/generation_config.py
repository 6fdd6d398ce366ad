"""The model's sampling defaults, read once at start (`--generation-config`, vLLM's flag).

`auto` reads what the model carries: an HF folder's generation_config.json, or a GGUF's
`general.sampling.*` keys (llama.cpp's); `vllm` reads nothing; anything else is a folder
holding a generation_config.json. The engine hands the defaults to every frontend in its
Welcome, and common/sampling_defaults.py applies them to the fields a request leaves unset.

Only the fields every API takes are read (common/sampling_defaults.py's DEFAULTABLE). One
that SamplingParams would refuse is logged and left out: a quirky file must not fail every
request that leaves the field unset.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from common.errors import InvalidRequest
from common.sampling_defaults import DEFAULTABLE, describe
from common.sampling_params import SamplingParams
from engine.models.loader import is_gguf

log = logging.getLogger("pagedserve.engine")
FILE = "generation_config.json"
_INTEGERS = ("top_k", "max_tokens")
# generation_config.json's name where it differs from ours.
_HF_NAMES = {"max_new_tokens": "max_tokens"}
# llama.cpp's keys (gguf-py's Keys.General.SAMPLING_*; gguf is imported only to read GGUFs).
_GGUF_KEYS = {"general.sampling.temp": "temperature", "general.sampling.top_p": "top_p",
              "general.sampling.top_k": "top_k", "general.sampling.min_p": "min_p",
              "general.sampling.penalty_repeat": "repetition_penalty"}


def load_sampling_defaults(setting: str, model_path: Path) -> dict[str, float | int]:
    """{field: default}; raises ValueError for a folder without a generation_config.json."""
    if setting == "vllm":
        return {}
    if setting != "auto":
        source = Path(setting).expanduser() / FILE
        if not source.is_file():
            raise ValueError(f"generation_config: {source} does not exist (give auto, vllm, or a folder "
                             f"holding a {FILE})")
        raw = _read_json(source)
    elif is_gguf(model_path):
        from engine.models.gguf_loader import read_gguf_metadata
        source = model_path
        raw = {_GGUF_KEYS[key]: value for key, value in read_gguf_metadata(model_path, list(_GGUF_KEYS)).items()}
    else:
        source = model_path / FILE
        raw = _read_json(source) if source.is_file() else {}
    defaults = _checked(raw, source)
    if defaults:
        log.warning("using the model's generation config defaults: %s (from %s); a request's own values "
                    "override them, and --generation-config vllm ignores them", describe(defaults), source)
    return defaults


def _read_json(path: Path) -> dict[str, object]:
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"generation_config: cannot read {path}: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"generation_config: {path} is not a JSON object")
    return {_HF_NAMES.get(name, name): value for name, value in config.items()}


def _checked(raw: dict[str, object], source: Path) -> dict[str, float | int]:
    defaults: dict[str, float | int] = {}
    for name in DEFAULTABLE:
        value = raw.get(name)
        if value is None:
            continue
        if name not in _INTEGERS and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if isinstance(value, float) and name not in _INTEGERS:
            value = float(f"{value:.7g}")  # a GGUF's float32: 0.6, not 0.6000000238
        try:
            SamplingParams(**{name: value})
        except InvalidRequest as e:
            log.warning("generation config %s: ignoring %s=%r: %s", source, name, value, e)
            continue
        defaults[name] = value
    return defaults
