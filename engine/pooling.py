"""Pooling models: what a model serves (its task) and how a sequence's hidden states become
one vector (its pooler), read as sentence-transformers and vLLM read them.

- task `generate`: text generation (every decoder; the default).
- task `embed`: one vector per input. An encoder (BERT) or a decoder (Qwen3-Embedding: the
  last token's hidden state, causal). The model folder's sentence-transformers files say how
  to pool (`modules.json`, then its Pooling module's `config.json`) and whether to normalize
  (a `Normalize` module); without them an encoder pools its CLS token and a decoder its last
  token, normalized, as vLLM does. `--pooling` overrides the mode.
- task `score`: a cross-encoder (`*ForSequenceClassification` with one label): a pair of
  texts in, one relevance logit out (the frontend applies the sigmoid, as
  `CrossEncoder.predict` does).

`auto` picks score for a classification head, embed for an encoder or a folder with
sentence-transformers modules, else generate.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

TASKS = ("auto", "generate", "embed", "score")
POOLING_MODES = ("mean", "cls", "last")
# sentence-transformers' pooling modes -> ours. Its Pooling config says `"pooling_mode": "mean"`
# (as 6.x saves it) or, in folders saved before, one `pooling_mode_*_token(s)` flag per mode.
_ST_MODES = {"cls": "cls", "mean": "mean", "lasttoken": "last"}
_ST_LEGACY_MODES = {"pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max",
                    "pooling_mode_mean_tokens": "mean", "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                    "pooling_mode_weightedmean_tokens": "weightedmean", "pooling_mode_lasttoken": "lasttoken"}
# Modules that leave the vector as the transformer, pooling and normalization make it; any
# other (Dense, LayerNorm...) changes it, and we do not run it.
_ST_MODULES = ("Transformer", "Pooling", "Normalize")


@dataclass(frozen=True)
class Pooler:
    """How the engine's model serves requests (sent to the frontend in Welcome.pooler)."""

    task: str  # generate | embed | score
    mode: str = ""  # embed: mean | cls | last; score: cls; generate: ""
    normalize: bool = False  # embed: L2-normalize the pooled vector
    dimensions: int = 0  # the pooled vector's size (embed), or the labels (score)
    matryoshka: bool = False  # embed: a prefix of the vector is itself an embedding (`dimensions`)
    sigmoid: bool = False  # score: the relevance is the sigmoid of the logit (else the logit itself)

    @property
    def pools(self) -> bool:
        return self.task != "generate"


def resolve_pooler(path: Path, encoder: bool, classifier_labels: int, hidden_size: int,
                   task: str = "auto", pooling: str | None = None) -> Pooler:
    """The task and pooler of the model at `path` (a folder or a GGUF file). Raises
    ValueError naming the flag when the model cannot serve `task`."""
    if task not in TASKS:
        raise ValueError(f"task: must be one of {', '.join(TASKS)}, got {task!r}")
    if pooling is not None and pooling not in POOLING_MODES:
        raise ValueError(f"pooling: must be one of {', '.join(POOLING_MODES)}, got {pooling!r}")
    st_mode, st_normalize = _sentence_transformers_pooling(path)
    if task == "auto":
        task = ("score" if classifier_labels else "embed" if encoder or st_mode is not None else "generate")
    if task == "generate":
        if encoder or classifier_labels:
            raise ValueError(f"task: {path.name} is an encoder model; it serves "
                             f"{'score' if classifier_labels else 'embed'}, not generate")
        if pooling is not None:
            raise ValueError("pooling: only for --task embed (or a model that embeds)")
        return Pooler("generate")
    if task == "score":
        if classifier_labels != 1:
            raise ValueError(f"task: score needs a cross-encoder with one label (a *ForSequenceClassification "
                             f"model); {path.name} has {classifier_labels or 'no'} classification head")
        return Pooler("score", "cls", False, 1, sigmoid=_cross_encoder_sigmoid(path))
    if classifier_labels:
        raise ValueError(f"task: {path.name} is a cross-encoder; it serves score, not embed")
    mode = pooling or st_mode or ("cls" if encoder else "last")
    if not encoder and mode != "last":
        # A decoder's earlier hidden states may come from the prefix cache or earlier chunks.
        raise ValueError(f"pooling: a decoder embeds with its last token only, got {mode!r}")
    normalize = st_normalize if st_mode is not None else True
    return Pooler("embed", mode, normalize, hidden_size, _matryoshka(path))


def _sentence_transformers_pooling(path: Path) -> tuple[str | None, bool]:
    """(pooling mode, normalize) from a sentence-transformers folder; (None, False) without one."""
    modules_file = path / "modules.json" if path.is_dir() else None
    if modules_file is None or not modules_file.is_file():
        return None, False
    modules = json.loads(modules_file.read_text())
    mode, normalize = None, False
    for module in modules:
        kind = module.get("type", "").rpartition(".")[2]
        if kind not in _ST_MODULES:
            raise ValueError(f"{path}: sentence-transformers module {module.get('type')!r} is not supported "
                             f"(only {', '.join(_ST_MODULES)})")
        if kind == "Pooling":
            config = json.loads((path / module.get("path", "") / "config.json").read_text())
            st_mode = config.get("pooling_mode") or _st_legacy_mode(config)
            mode = _ST_MODES.get(st_mode) if isinstance(st_mode, str) else None
            if mode is None:
                raise ValueError(f"{path}: sentence-transformers pooling {st_mode!r} is not supported "
                                 f"(only {', '.join(_ST_MODES)})")
        elif kind == "Normalize":
            normalize = True
    return mode, normalize


def _st_legacy_mode(config: dict) -> str | list[str]:
    """The mode of a Pooling config with `pooling_mode_*` flags, as sentence-transformers reads
    it: mean when none is set, a list (the vectors concatenated) when several are."""
    modes = [mode for key, mode in _ST_LEGACY_MODES.items() if config.get(key)]
    return modes[0] if len(modes) == 1 else modes or "mean"


def _cross_encoder_sigmoid(path: Path) -> bool:
    """CrossEncoder.predict's activation for one label: a sigmoid, unless the model's config
    names another (`sentence_transformers.activation_fn`; Identity: the raw logit)."""
    config = _read_json(path / "config.json") if path.is_dir() else {}
    activation = (config.get("sentence_transformers") or {}).get("activation_fn") or "Sigmoid"
    if activation.rpartition(".")[2] not in ("Sigmoid", "Identity"):
        raise ValueError(f"{path}: cross-encoder activation {activation!r} is not supported (Sigmoid or Identity)")
    return activation.endswith("Sigmoid")


def _matryoshka(path: Path) -> bool:
    """Whether the model says its embeddings may be truncated (vLLM reads the same keys)."""
    config_file = path / "config.json" if path.is_dir() else None
    if config_file is None or not config_file.is_file():
        return False
    config = json.loads(config_file.read_text())
    return bool(config.get("is_matryoshka") or config.get("matryoshka_dimensions"))


def sentence_transformers_max_len(path: Path) -> int | None:
    """`max_seq_length` of a sentence-transformers folder: what it truncates inputs to, and so
    the longest input served by default (as vLLM reads it). Folders saved by sentence-transformers
    6 keep it as the tokenizer's `model_max_length` instead (capped, as there, by the model's
    positions)."""
    config_file = path / "sentence_bert_config.json" if path.is_dir() else None
    if config_file is None or not config_file.is_file():
        return None
    max_len = json.loads(config_file.read_text()).get("max_seq_length")
    if max_len is not None:
        return max_len
    tokenizer_config, model_config = (_read_json(path / name) for name in ("tokenizer_config.json", "config.json"))
    max_len = tokenizer_config.get("model_max_length")
    if not isinstance(max_len, int):
        return None
    positions = model_config.get("max_position_embeddings")
    return min(max_len, positions) if isinstance(positions, int) and positions > 0 else max_len


def _read_json(file: Path) -> dict:
    return json.loads(file.read_text()) if file.is_file() else {}


def pool(hidden: torch.Tensor, mode: str, normalize: bool) -> torch.Tensor:
    """One sequence's hidden states [tokens, hidden] -> its vector [hidden], in float32."""
    if mode == "mean":
        vector = hidden.float().mean(dim=0)
    elif mode == "cls":
        vector = hidden[0].float()
    else:
        vector = hidden[-1].float()
    return torch.nn.functional.normalize(vector, dim=0) if normalize else vector
