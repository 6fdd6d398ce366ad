"""The two workloads of `bench spec`, and the Generate call that sends them.

- edit: our own paragraphs (data/edit_tasks.json), each in a chat user message asking for it
  back with one phrase changed and the rest word for word. The reply mostly copies the
  prompt: what prompt-lookup (ngram) drafts are for. Greedy, eos honoured, max_tokens
  `edit_output_ratio` x the paragraph's tokens (the reply ends at eos when the model is done).
- random: random token ids (bench.datasets.random_requests), greedy with eos ignored, so every
  reply has exactly its planned length: little to look up, the method's overhead shows.

Every run of a (workload, concurrency) sends the same requests to every config's server, and
the records keep each reply's token ids so that a config's replies can be compared with `off`'s
(greedy verification is lossless: they should match).
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from bench.datasets import BenchRequest, random_requests
from bench.load import RequestRecord, timed_stream

EDIT_TASKS = Path(__file__).resolve().parent / "data" / "edit_tasks.json"
WORKLOADS = ("edit", "random")
WARMUP_OUTPUT_LEN = 16  # long enough for a few verification steps


@dataclass(slots=True)
class SpecRequest(BenchRequest):
    """`prompt` text goes as one chat user message; `output_len` is max_tokens."""

    ignore_eos: bool
    task: str = ""  # edit: which paragraph


@dataclass(slots=True)
class SpecRecord(RequestRecord):
    """A request's record with its reply's token ids (compared across configs)."""

    task: str = ""
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = ""  # FinishReason's name, e.g. FINISH_REASON_EOS


@dataclass(slots=True)
class EditTask:
    name: str
    prompt: str  # the instruction with the paragraph in it
    text: str  # the paragraph alone: its length sets max_tokens


def load_edit_tasks(path: Path = EDIT_TASKS) -> list[EditTask]:
    """Every task with its prompt; ValueError if a task's phrase to change is not in its text."""
    data = json.loads(Path(path).read_text())
    tasks = []
    for t in data["tasks"]:
        if t["from"] not in t["text"]:
            raise ValueError(f"{path}: task {t['name']!r}: {t['from']!r} is not in its text")
        prompt = data["instruction"].replace("{from}", t["from"]).replace("{to}", t["to"]).replace("{text}", t["text"])
        tasks.append(EditTask(t["name"], prompt, t["text"]))
    return tasks


def edit_requests(tasks: list[EditTask], num: int, start: int, output_ratio: float,
                  count_prompt: Callable[[str], int], count_text: Callable[[str], int],
                  max_output_len: int | None = None) -> list[SpecRequest]:
    """`num` tasks from index `start` on, cycling past the end: runs given disjoint ranges share
    no prompt, so a prefix cache carries nothing from one run to the next. max_tokens is
    ceil(output_ratio x the paragraph's tokens), at most `max_output_len`. `count_prompt` counts
    a user message as the chat template renders it; `count_text` a bare text's tokens."""
    requests = []
    for i in range(num):
        task = tasks[(start + i) % len(tasks)]
        output_len = math.ceil(output_ratio * count_text(task.text))
        if max_output_len is not None:
            output_len = min(output_len, max_output_len)
        requests.append(SpecRequest(task.prompt, count_prompt(task.prompt), output_len, False, task.name))
    return requests


def random_spec_requests(num: int, input_len: int, output_len: int, vocab_size: int, seed: str) -> list[SpecRequest]:
    return [SpecRequest(r.prompt, r.prompt_len, r.output_len, True)
            for r in random_requests(num, input_len, output_len, 0.0, vocab_size, seed)]


def warmup_requests(vocab_size: int, seed: str) -> list[SpecRequest]:
    """One of each kind, on prompts no timed run sends."""
    ids = random_spec_requests(1, 16, WARMUP_OUTPUT_LEN, vocab_size, f"{seed}:warmup")
    chat = SpecRequest("Repeat this sentence word for word: the old dog sleeps by the warm fire.", 0,
                       WARMUP_OUTPUT_LEN, False, "warmup")
    return [*ids, chat]


def shuffled_tasks(tasks: list[EditTask], seed: int) -> list[EditTask]:
    order = list(tasks)
    random.Random(f"edit:{seed}").shuffle(order)
    return order


async def generate_spec(stub, request: SpecRequest, run_start: float | None = None) -> SpecRecord:
    """One greedy Generate stream: token ids as they are, text as a chat user message."""
    from common.v1 import generation_pb2 as gen
    sampling = gen.SamplingParams(temperature=0, max_tokens=request.output_len, ignore_eos=request.ignore_eos)
    if isinstance(request.prompt, str):
        chat = gen.Chat(messages=[gen.ChatMessage(role="user", content=request.prompt)])
        message = gen.GenerateRequest(chat=chat, sampling=sampling)
    else:
        message = gen.GenerateRequest(token_ids=gen.TokenIds(ids=request.prompt), sampling=sampling)
    record = SpecRecord(prompt_tokens=request.prompt_len, expected_output_tokens=request.output_len,
                        task=request.task)

    def keep_reply(response) -> None:
        kind = response.WhichOneof("kind")
        if kind == "chunk":
            record.token_ids += response.chunk.token_ids
            record.text += response.chunk.text
        elif kind == "finished":
            record.finish_reason = gen.FinishReason.Name(response.finished.reason)

    return await timed_stream(stub, message, record, run_start, keep_reply)
