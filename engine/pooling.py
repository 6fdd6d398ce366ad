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
# sentence-transformers' Pooling config keys -> our modes (the first one set wins, as there)
_ST_MODES = (("pooling_mode_cls_token", "cls"), ("pooling_mode_mean_tokens", "mean"),
             ("pooling_mode_lasttoken", "last"))


@dataclass(frozen=True)
class Pooler:
    """How the engine's model serves requests (sent to the frontend in Welcome.pooler)."""

    task: str  # generate | embed | score
    mode: str = ""  # embed: mean | cls | last; score: cls; generate: ""
    normalize: bool = False  # embed: L2-normalize the pooled vector
    dimensions: int = 0  # the pooled vector's size (embed), or the labels (score)
    matryoshka: bool = False  # embed: a prefix of the vector is itself an embedding (`dimensions`)

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
        return Pooler("score", "cls", False, 1)
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
        kind = module.get("type", "")
        if kind.endswith(".Pooling"):
            config = json.loads((path / module.get("path", "") / "config.json").read_text())
            mode = next((ours for key, ours in _ST_MODES if config.get(key)), None)
            if mode is None:
                raise ValueError(f"{path}: sentence-transformers pooling {config} is not one of "
                                 f"{', '.join(POOLING_MODES)}")
        elif kind.endswith(".Normalize"):
            normalize = True
    return mode, normalize


def _matryoshka(path: Path) -> bool:
    """Whether the model says its embeddings may be truncated (vLLM reads the same keys)."""
    config_file = path / "config.json" if path.is_dir() else None
    if config_file is None or not config_file.is_file():
        return False
    config = json.loads(config_file.read_text())
    return bool(config.get("is_matryoshka") or config.get("matryoshka_dimensions"))


def sentence_transformers_max_len(path: Path) -> int | None:
    """`max_seq_length` of a sentence-transformers folder: what it truncates inputs to, and so
    the longest input served by default (as vLLM reads it)."""
    config_file = path / "sentence_bert_config.json" if path.is_dir() else None
    if config_file is None or not config_file.is_file():
        return None
    return json.loads(config_file.read_text()).get("max_seq_length")


def pool(hidden: torch.Tensor, mode: str, normalize: bool) -> torch.Tensor:
    """One sequence's hidden states [tokens, hidden] -> its vector [hidden], in float32."""
    if mode == "mean":
        vector = hidden.float().mean(dim=0)
    elif mode == "cls":
        vector = hidden[0].float()
    else:
        vector = hidden[-1].float()
    return torch.nn.functional.normalize(vector, dim=0) if normalize else vector
