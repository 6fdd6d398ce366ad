"""Workloads for `bench serve`: each dataset turns into a list of `BenchRequest`s.

- random: token ids drawn from [100, vocab) (the lowest ids are special tokens in most
  vocabularies), input and output lengths uniform in [len*(1-r), len*(1+r)] as in vLLM's
  benchmark_serving.
- prefix-repetition: --num-prefixes random prefixes shared by many prompts, each with its
  own random suffix; a server with a prefix cache prefills each prefix once.
- sharegpt: text prompts from a ShareGPT-format JSON file (vLLM's format):

      [{"conversations": [{"from": "human", "value": "How do magnets work?"},
                          {"from": "gpt", "value": "Magnets work because ..."}, ...]}, ...]

  The first turn is the prompt; the reply that follows it sets the output length. Other
  keys ("id", ...) are ignored. Token counts come from the server's Tokenize RPC, so they
  are the served model's own.
- structured: chat prompts asking for JSON (data/structured_tasks.json: extraction, listings,
  calendar entries, reviews, orders, recipes), each with the JSON Schema its reply must
  validate against; a share of them carry that schema as their constraint.
- embeddings: texts for /v1/embeddings, each a run of words from our own prose
  (data/perplexity.txt and the ShareGPT sample) starting at a random word, as long in tokens
  (special ones included) as a length drawn uniformly from a range; several per request.

Everything is seeded: the same seed gives the same prompts and lengths.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

SHAREGPT_SAMPLE = Path(__file__).resolve().parent / "data" / "sharegpt_sample.json"
STRUCTURED_TASKS = Path(__file__).resolve().parent / "data" / "structured_tasks.json"
PROSE = Path(__file__).resolve().parent / "data" / "perplexity.txt"
MIN_TOKEN_ID = 100  # as bench offline's random_prompts: skip the special tokens
MIN_SHAREGPT_PROMPT_TOKENS = 4  # vLLM's filter: shorter prompts say little about serving


@dataclass(slots=True)
class BenchRequest:
    """One request of the workload; the server is asked for exactly `output_len` tokens."""

    prompt: list[int] | str  # token ids, or text the server tokenizes
    prompt_len: int  # in tokens (for text: as the server's Tokenize counts them)
    output_len: int


@dataclass(slots=True)
class JsonRequest(BenchRequest):
    """A chat prompt that asks for JSON; `prompt` is the user message, `output_len` a cap
    (the reply ends on its own: at eos, or when the constrained JSON completes)."""

    task: str  # which of STRUCTURED_TASKS
    schema: dict  # what the reply must validate against, constrained or not
    constrained: bool  # sent with `schema` as its json_schema constraint


@dataclass(slots=True)
class EmbedRequest(BenchRequest):
    """One /v1/embeddings call of several texts: `prompt` is unused (""), `prompt_len` their
    tokens in all (special tokens included), `output_len` 0."""

    texts: list[str]


def length_range(length: int, range_ratio: float) -> tuple[int, int]:
    """Inclusive [low, high] of lengths around `length`, never below 1 (vLLM's rounding)."""
    if not 0 <= range_ratio < 1:
        raise ValueError(f"range ratio: must be in [0, 1), got {range_ratio}")
    return max(1, math.floor(length * (1 - range_ratio))), max(1, math.ceil(length * (1 + range_ratio)))


def random_requests(num: int, input_len: int, output_len: int, range_ratio: float, vocab_size: int,
                    seed: int | str) -> list[BenchRequest]:
    rng = random.Random(f"random:{seed}")
    in_low, in_high = length_range(input_len, range_ratio)
    out_low, out_high = length_range(output_len, range_ratio)
    requests = []
    for _ in range(num):
        n_in, n_out = rng.randint(in_low, in_high), rng.randint(out_low, out_high)
        requests.append(BenchRequest(_random_ids(rng, n_in, vocab_size), n_in, n_out))
    return requests


def prefix_repetition_requests(num: int, prefix_len: int, suffix_len: int, num_prefixes: int,
                               output_len: int, vocab_size: int, seed: int | str) -> list[BenchRequest]:
    """Prompt i is prefix[i % num_prefixes] + its own suffix; the order is shuffled so that
    prompts sharing a prefix do not all arrive together."""
    if num_prefixes < 1 or prefix_len < 0 or suffix_len < 0 or prefix_len + suffix_len < 1:
        raise ValueError("prefix-repetition: need --num-prefixes >= 1 and a prompt of at least one token")
    rng = random.Random(f"prefix-repetition:{seed}")
    prefixes = [_random_ids(rng, prefix_len, vocab_size) for _ in range(num_prefixes)]
    requests = [BenchRequest(prefixes[i % num_prefixes] + _random_ids(rng, suffix_len, vocab_size),
                             prefix_len + suffix_len, output_len) for i in range(num)]
    rng.shuffle(requests)
    return requests


def load_sharegpt(path: Path) -> list[tuple[str, str]]:
    """(prompt, reply) of every conversation whose first turn has a reply after it."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a readable JSON file: {e}") from e
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of {{\"conversations\": [...]}} objects")
    pairs = []
    for i, item in enumerate(data):
        turns = item.get("conversations") if isinstance(item, dict) else None
        if not isinstance(turns, list):
            raise ValueError(f"{path}: item {i} has no \"conversations\" list")
        if len(turns) >= 2 and all(isinstance(t, dict) and isinstance(t.get("value"), str) for t in turns[:2]):
            prompt, reply = turns[0]["value"], turns[1]["value"]
            if prompt.strip() and reply.strip():
                pairs.append((prompt, reply))
    return pairs


def sharegpt_requests(pairs: list[tuple[str, str]], num: int, count_tokens: Callable[[str, bool], int],
                      max_model_len: int, output_len_cap: int | None, seed: int | str
                      ) -> tuple[list[BenchRequest], int]:
    """`num` requests from shuffled conversations, and how many conversations were usable.

    `count_tokens(text, add_special_tokens)` is the server's tokenizer. Prompts are counted
    as Generate will tokenize them (special tokens added), replies without special tokens
    (they are what the model generates). When fewer conversations are usable than `num`,
    they are drawn again (as vLLM oversamples): repeats may then hit a prefix cache.
    """
    order = list(pairs)
    random.Random(f"sharegpt:{seed}").shuffle(order)
    usable = []
    for prompt, reply in order:
        prompt_len = count_tokens(prompt, True)
        output_len = count_tokens(reply, False)
        if output_len_cap is not None:
            output_len = min(output_len, output_len_cap)
        if prompt_len < MIN_SHAREGPT_PROMPT_TOKENS or output_len < 1 or prompt_len + output_len > max_model_len:
            continue
        usable.append(BenchRequest(prompt, prompt_len, output_len))
        if len(usable) == num:
            return usable, len(usable)
    if not usable:
        raise ValueError("sharegpt: no usable conversation (each needs a reply, a prompt of at least "
                         f"{MIN_SHAREGPT_PROMPT_TOKENS} tokens, and to fit in {max_model_len} tokens)")
    extra = random.Random(f"sharegpt-oversample:{seed}").choices(usable, k=num - len(usable))
    return usable + extra, len(usable)


def load_structured_tasks(path: Path = STRUCTURED_TASKS) -> list[tuple[str, dict, str]]:
    """(task name, schema, prompt) for every input of every task."""
    tasks = json.loads(Path(path).read_text())["tasks"]
    return [(t["name"], t["schema"], t["prompt"].replace("{input}", text)) for t in tasks for text in t["inputs"]]


def structured_requests(prompts: list[tuple[str, dict, str]], num: int, ratio: float, output_len: int,
                        count_tokens: Callable[[str], int], seed: int | str) -> list[JsonRequest]:
    """`num` requests over the shuffled prompts (cycled past their number), round(num * ratio) of
    them constrained. The same seed draws the same prompts whatever the ratio, so runs at
    several ratios differ only in which requests are constrained. `count_tokens(message)` counts
    a user message as the server renders it with the chat template."""
    order = list(prompts)
    random.Random(f"structured:{seed}").shuffle(order)
    constrained = set(random.Random(f"structured-constrained:{seed}").sample(range(num), round(num * ratio)))
    counts: dict[str, int] = {}
    requests = []
    for i in range(num):
        task, schema, prompt = order[i % len(order)]
        if prompt not in counts:
            counts[prompt] = count_tokens(prompt)
        requests.append(JsonRequest(prompt, counts[prompt], output_len, task, schema, i in constrained))
    return requests


def sized_texts(count_tokens: Callable[[str, bool], int], num: int, min_len: int, max_len: int,
                seed: int | str) -> list[tuple[str, int]]:
    """`num` (text, token count) pairs, each count drawn uniformly from [min_len, max_len] and
    met as closely as whole words allow, never above max_len. `count_tokens(text,
    add_special_tokens)` is the model's tokenizer: words are counted one by one (a BERT
    tokenizer splits on spaces first, so their sum is the text's) and every text once whole."""
    if not 1 <= min_len <= max_len:
        raise ValueError(f"text lengths: need 1 <= min <= max, got {min_len}, {max_len}")
    words = _prose_words()
    rng = random.Random(f"embeddings:{seed}")
    specials, counts, out = count_tokens("", True), {}, []
    for _ in range(num):
        target, start = rng.randint(min_len, max_len), rng.randrange(len(words))
        taken, size = [], specials
        for i in range(start, start + len(words)):
            word = words[i % len(words)]
            if word not in counts:
                counts[word] = count_tokens(word, False)
            if size + counts[word] <= target:
                taken.append(word)
                size += counts[word]
            elif size >= min_len:
                break  # (a word too long for a short text is skipped)
        text = " ".join(taken)
        size = count_tokens(text, True)
        while size > max_len and taken:  # a tokenizer that counts a joined text otherwise
            taken.pop()
            text = " ".join(taken)
            size = count_tokens(text, True)
        out.append((text, size))
    return out


def embedding_requests(texts: list[tuple[str, int]], per_request: int) -> list[EmbedRequest]:
    """`texts` in order, `per_request` to a request (the last one may hold fewer)."""
    chunks = [texts[i:i + per_request] for i in range(0, len(texts), per_request)]
    return [EmbedRequest("", sum(n for _, n in chunk), 0, [t for t, _ in chunk]) for chunk in chunks]


def _prose_words() -> list[str]:
    """Our own prose, word by word: perplexity.txt, then every turn of the ShareGPT sample."""
    turns = [turn for pair in load_sharegpt(SHAREGPT_SAMPLE) for turn in pair]
    return " ".join([PROSE.read_text(), *turns]).split()


def _random_ids(rng: random.Random, length: int, vocab_size: int) -> list[int]:
    return [rng.randrange(MIN_TOKEN_ID, vocab_size) for _ in range(length)]
