"""`bench serve --dataset-name structured`: JSON replies, with and without their schema as
the constraint, in one run.

Each request is a chat prompt that asks for JSON (bench.datasets.structured_requests); a
share of them carry the schema as `json_schema`. Both groups are greedy with eos honoured and
--structured-output-len as max_tokens: a constrained reply ends when its JSON completes, an
unconstrained one at eos or the cap. So output lengths differ between groups and are reported,
and throughput and TPOT are split by group. Every reply is checked: does the whole text parse
as JSON, and does that validate against the request's schema (jsonschema)?

The mask's cost comes from the engine's own step timer: its /metrics histogram
`pagedserve:engine_step_seconds{phase}` read before and after the timed run. `grammar` (the
bitmask fill and apply, observed only in steps with a constrained row) is part of `sample`;
`model` is the forward.
"""

from __future__ import annotations

import collections
import json
import statistics
import urllib.request
from dataclasses import dataclass

from bench.datasets import JsonRequest
from bench.load import RequestRecord, timed_stream
from bench.serve_metrics import summarize

GROUPS = ("constrained", "unconstrained")
PHASES = ("grammar", "sample", "model", "schedule")
STEP_METRIC = "pagedserve:engine_step_seconds"
WARMUP_SCHEMA = {"type": "object"}  # loads the grammar library before the timed run, compiles none of its schemas


@dataclass(slots=True)
class JsonRecord(RequestRecord):
    """A request's record with its reply and what the reply is worth."""

    task: str = ""
    constrained: bool = False
    text: str = ""
    finish_reason: str = ""  # FinishReason's name, e.g. FINISH_REASON_EOS
    parsed: bool = False  # the whole reply is one JSON value
    valid: bool = False  # and it validates against the request's schema


async def generate_json(stub, request: JsonRequest, run_start: float | None = None) -> JsonRecord:
    """One greedy Generate stream of a chat prompt, constrained or not; ends on its own."""
    from common.v1 import generation_pb2 as gen
    message = gen.GenerateRequest(chat=gen.Chat(messages=[gen.ChatMessage(role="user", content=request.prompt)]),
                                  sampling=gen.SamplingParams(temperature=0, max_tokens=request.output_len))
    if request.constrained:
        message.json_schema = json.dumps(request.schema)
    record = JsonRecord(prompt_tokens=request.prompt_len, expected_output_tokens=request.output_len,
                        task=request.task, constrained=request.constrained)

    def keep_reply(response) -> None:
        kind = response.WhichOneof("kind")
        if kind == "chunk":
            record.text += response.chunk.text
        elif kind == "finished":
            record.finish_reason = gen.FinishReason.Name(response.finished.reason)

    await timed_stream(stub, message, record, run_start, keep_reply)
    if record.ok:
        _check_reply(record, request.schema)
    return record


def warmup_request(output_len: int) -> JsonRequest:
    return JsonRequest("Reply with an empty JSON object.", 0, output_len, "warmup", WARMUP_SCHEMA, True)


def _check_reply(record: JsonRecord, schema: dict) -> None:
    import jsonschema
    try:
        value = json.loads(record.text)
    except json.JSONDecodeError:
        return
    record.parsed = True
    record.valid = jsonschema.Draft202012Validator(schema).is_valid(value)


def group_summaries(records: list[JsonRecord], duration_s: float, slos: dict[str, float]) -> dict[str, dict]:
    """summarize() per group, plus its output lengths and valid replies. Rates (tok/s, req/s)
    are over the whole run's duration: in a mixed run, the group's share of the throughput."""
    groups = {}
    for name in GROUPS:
        members = [r for r in records if r.constrained == (name == "constrained")]
        if not members:
            continue
        done = [r for r in members if r.ok]
        groups[name] = {
            **summarize(members, duration_s, slos), "num_requests": len(members),
            "mean_output_len": statistics.fmean(r.num_output_tokens for r in done) if done else None,
            "num_parsed": sum(r.parsed for r in done), "num_valid": sum(r.valid for r in done),
            "finish_reasons": dict(collections.Counter(r.finish_reason for r in done)),
            "num_valid_by_task": _valid_by_task(done),
        }
    return groups


def _valid_by_task(done: list[JsonRecord]) -> dict[str, str]:
    """{"order": "3/4", ...}: which schemas the replies get right."""
    tasks = sorted({r.task for r in done})
    return {t: f"{sum(r.valid for r in done if r.task == t)}/{sum(r.task == t for r in done)}" for t in tasks}


def scrape_step_seconds(url: str) -> dict[str, tuple[float, float]]:
    """{phase: (seconds, steps)} of the engine's step histogram, summed over its series."""
    from prometheus_client.parser import text_string_to_metric_families
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    totals = {phase: [0.0, 0.0] for phase in PHASES}
    for family in text_string_to_metric_families(text):
        if family.name != STEP_METRIC:
            continue
        for sample in family.samples:
            phase = sample.labels.get("phase")
            if phase in totals and sample.name.endswith(("_sum", "_count")):
                totals[phase][sample.name.endswith("_count")] += sample.value
    return {phase: (s, n) for phase, (s, n) in totals.items()}


def step_phases(before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]) -> dict:
    """{phase: {"steps", "total_s", "mean_ms"}} between two scrapes; mean_ms None without steps."""
    phases = {}
    for phase in PHASES:
        seconds, steps = after[phase][0] - before[phase][0], round(after[phase][1] - before[phase][1])
        phases[phase] = {"steps": steps, "total_s": seconds, "mean_ms": seconds * 1000 / steps if steps else None}
    return phases
