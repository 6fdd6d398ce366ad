"""Per-request sampling parameters, with vLLM's field names and validation.

Every public field is checked in `__post_init__`; a bad value raises a
`InvalidRequest` (a ValueError) that names the field and the allowed range, so the frontend can
hand the message straight back to the caller as INVALID_ARGUMENT.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

from common.errors import InvalidRequest
from common.structured_output.params import StructuredOutputsParams

# Temperatures below this are treated as greedy, as vLLM does: dividing logits
# by a tiny temperature only overflows.
GREEDY_EPS = 1e-5
MAX_N = 64
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_SEED = 2**63 - 1
MAX_LOGIT_BIAS = 300  # entries, as OpenAI allows
MAX_BIAS = 100.0
MAX_BAD_WORDS = 128
MAX_BAD_WORD_CHARS = 256


@dataclass
class SamplingParams:
    """How to pick the next token and when to stop. Defaults follow vLLM."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) disables top-k
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: until the model's max length
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs per token; 0 = sampled token only
    prompt_logprobs: int | None = None  # top-N logprobs per prompt token; 0 = its own only
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Constrain the output to a JSON schema, regex, choice or grammar (a dict is taken too).
    structured_outputs: StructuredOutputsParams | None = None
    # Opt this request out of the engine's speculative decoding (its output is the same either
    # way; this only trades its latency for the others' throughput).
    disable_speculation: bool = False
    # Added to the logits before sampling: token id -> bias in [-100, 100] (OpenAI's logit_bias;
    # string keys, as JSON has them, are read as integers).
    logit_bias: dict[int, float] | None = None
    # Only these tokens may be sampled (vLLM's); None: any.
    allowed_token_ids: list[int] | None = None
    # Words the output may not contain (vLLM's bad_words). The engine has no tokenizer: the
    # frontend's InputProcessor tokenizes them into `bad_words_token_ids`, and the sampler bans
    # a word's last token wherever the output ends with the rest of it.
    bad_words: list[str] = field(default_factory=list)
    bad_words_token_ids: list[list[int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        self.bad_words = _as_list("bad_words", self.bad_words or [])
        self.bad_words_token_ids = [_as_list("bad_words_token_ids", ids)
                                    for ids in _as_list("bad_words_token_ids", self.bad_words_token_ids or [])]
        self.logit_bias = _token_keyed(self.logit_bias) or None
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _as_list("allowed_token_ids", self.allowed_token_ids)
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @functools.cached_property
    def plain_greedy(self) -> bool:
        """Argmax and nothing else (no penalties, logit rules or logprobs): the sampler's hot path. Cached:
        the runner asks every step, and a request's parameters do not change once it runs."""
        return self.greedy and not self.uses_penalties and not self.uses_logit_rules and self.logprobs is None

    @functools.cached_property
    def plain_random(self) -> bool:
        """A draw at a temperature (min_p allowed) and nothing else: no top-k or top-p (whose
        exact windowed filter looks at the logits on the host), penalties, logit rules or logprobs. With
        `plain_greedy`, what a step launched ahead can sample on the device (engine/async_step.py)."""
        return (not self.greedy and self.top_k == 0 and self.top_p >= 1.0 and not self.uses_penalties
                and not self.uses_logit_rules and self.logprobs is None)

    @functools.cached_property
    def columns(self) -> tuple[float, ...]:
        """These settings as one row of numbers, in engine/sampling_batch.py's column order: the
        sampler reads a step's rows as arrays (logprobs None is -1). Cached, as plain_greedy."""
        return (self.temperature, float(self.top_k), self.top_p, self.min_p, self.repetition_penalty,
                self.frequency_penalty, self.presence_penalty, -1.0 if self.logprobs is None else float(self.logprobs),
                float(self.min_tokens), float(self.greedy), float(self.uses_penalties), float(self.plain_greedy),
                float(self.uses_logit_rules))

    @property
    def uses_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    @property
    def uses_logit_rules(self) -> bool:
        """logit_bias, allowed_token_ids or bad_words: the sampler's stage of per-request logit
        edits (engine/logit_rules.py)."""
        return (self.logit_bias is not None or self.allowed_token_ids is not None or bool(self.bad_words)
                or bool(self.bad_words_token_ids))

    def _validate(self) -> None:
        _int("n", self.n, 1, MAX_N)
        _float("temperature", self.temperature, 0.0, 100.0)
        _float("top_p", self.top_p, 0.0, 1.0, low_open=True)
        _int("top_k", self.top_k, 0, 2**31 - 1, hint=" (0 or -1 disables it)")
        _float("min_p", self.min_p, 0.0, 1.0)
        if self.seed is not None:
            _int("seed", self.seed, 0, MAX_SEED)
        if self.max_tokens is not None:
            _int("max_tokens", self.max_tokens, 1, 2**31 - 1)
        _int("min_tokens", self.min_tokens, 0, self.max_tokens or 2**31 - 1,
             hint=" (and at most max_tokens)")
        if self.logprobs is not None:
            _int("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            _int("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS)
        _float("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _float("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _float("repetition_penalty", self.repetition_penalty, 0.0, 2.0, low_open=True)
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidRequest(f"stop: at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise InvalidRequest(f"stop: every stop string must be a non-empty string, got {s!r}")
        for t in self.stop_token_ids:
            _int("stop_token_ids", t, 0, 2**31 - 1)
        self._validate_logit_rules()
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise InvalidRequest("structured_outputs: must be a StructuredOutputsParams or a dict of its fields")
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output", "disable_speculation"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequest(f"{name}: must be true or false, got {getattr(self, name)!r}")

    def _validate_logit_rules(self) -> None:
        """Token ids are checked against the vocabulary where it is known (common/validation.py)."""
        if self.logit_bias is not None:
            if len(self.logit_bias) > MAX_LOGIT_BIAS:
                raise InvalidRequest(f"logit_bias: at most {MAX_LOGIT_BIAS} tokens, got {len(self.logit_bias)}")
            for token, bias in self.logit_bias.items():
                _token_id("logit_bias", token)
                if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -MAX_BIAS <= bias <= MAX_BIAS:
                    raise InvalidRequest(f"logit_bias: the bias of token {token} must be a number in "
                                         f"[{-MAX_BIAS:g}, {MAX_BIAS:g}], got {bias!r}")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise InvalidRequest("allowed_token_ids: must hold at least one token id (leave it unset to allow any)")
            for t in self.allowed_token_ids:
                _token_id("allowed_token_ids", t)
        if len(self.bad_words) > MAX_BAD_WORDS:
            raise InvalidRequest(f"bad_words: at most {MAX_BAD_WORDS} words, got {len(self.bad_words)}")
        for w in self.bad_words:
            if not isinstance(w, str) or not w.strip() or len(w) > MAX_BAD_WORD_CHARS:
                raise InvalidRequest(f"bad_words: every word must be a string of 1 to {MAX_BAD_WORD_CHARS} "
                                     f"characters, not only spaces; got {w!r}")
        for ids in self.bad_words_token_ids:
            if not ids:
                raise InvalidRequest("bad_words_token_ids: every word needs at least one token id")
            for t in ids:
                _token_id("bad_words_token_ids", t)


def _token_keyed(bias: object) -> dict:
    """`bias` with its keys as token ids: JSON objects (OpenAI's logit_bias) have string keys."""
    if bias is None:
        return {}
    if not isinstance(bias, dict):
        raise InvalidRequest(f"logit_bias: must be an object of token id -> bias, got {type(bias).__name__}")
    out = {}
    for key, value in bias.items():
        token = key
        if isinstance(key, str):
            try:
                token = int(key)
            except ValueError:
                raise InvalidRequest(f"logit_bias: keys must be token ids (integers), got {key!r}") from None
        out[token] = value
    return out


def _as_list(name: str, value: object) -> list:
    if not isinstance(value, (list, tuple)):
        raise InvalidRequest(f"{name}: must be a list, got {type(value).__name__}")
    return list(value)


def _token_id(name: str, value: object) -> None:
    """The vocabulary's size is checked later, where it is known (common/validation.py)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequest(f"{name}: token ids must be integers, got {value!r}")
    if value < 0:
        raise InvalidRequest(f"{name}: token id {value} is negative")


def _int(name: str, value: object, low: int, high: int, hint: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequest(f"{name}: must be an integer in [{low}, {high}]{hint}, got {value!r}")
    if not low <= value <= high:
        raise InvalidRequest(f"{name}: must be in [{low}, {high}]{hint}, got {value}")


def _float(name: str, value: object, low: float, high: float, low_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidRequest(f"{name}: must be a finite number, got {value!r}")
    bracket = "(" if low_open else "["
    if value > high or value < low or (low_open and value == low):
        raise InvalidRequest(f"{name}: must be in {bracket}{low}, {high}], got {value}")
