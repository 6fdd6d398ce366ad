"""The batches of /v1/batches: OpenAI's Batch objects, each run in the background of this
frontend process by a BatchRunner that sends its lines to the process's own app.

    validating ──► in_progress ──► finalizing ──► completed
        │   │           │
        │   └───────────┴──► cancelling ──► cancelled      (POST /v1/batches/{id}/cancel)
        └─► failed (the input file is empty or gone)

Results with status 200 go to the output file, the rest (error lines, refused bodies) to the
error file, both published in the file store (purpose "batch_output"); a cancelled batch
publishes what finished before the cancel. The batches live in this process's memory: another
frontend process (`--api-server-count`) does not know them, and a restart forgets them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from frontend.batch.files import FileStore
from frontend.batch.runner import BatchRunner, LineResult, count_requests

log = logging.getLogger("pagedserve.batch")
COMPLETION_WINDOW = "24h"  # the only one OpenAI takes; a batch here runs until it is done
COMPLETION_WINDOW_S = 24 * 3600
# Invalid UTF-8 in a line becomes lone surrogates, which the route refuses with a 400 for
# that line alone (a strict decode would fail the whole file).
ENCODING = {"encoding": "utf-8", "errors": "surrogateescape"}


@dataclass
class BatchJob:
    id: str
    input_file_id: str
    endpoint: str
    metadata: dict[str, str] | None
    created_at: int = field(default_factory=lambda: int(time.time()))
    status: str = "validating"
    times: dict[str, int] = field(default_factory=dict)  # "<status>_at": when it began
    total: int = 0
    completed: int = 0
    failed: int = 0
    output_file_id: str | None = None
    error_file_id: str | None = None
    errors: list[dict] = field(default_factory=list)
    usage: dict[str, int] = field(default_factory=lambda: dict.fromkeys(("input", "cached", "output", "reasoning"), 0))
    task: asyncio.Task | None = None

    def set_status(self, status: str) -> None:
        self.status = status
        self.times[f"{status}_at"] = int(time.time())

    def fail(self, code: str, message: str) -> None:
        self.errors.append({"code": code, "message": message, "param": None, "line": None})
        self.set_status("failed")

    def count(self, result: LineResult) -> None:
        if not result.ok:
            self.failed += 1
            return
        self.completed += 1
        body = result.record["response"]["body"]
        usage = (body.get("usage") if isinstance(body, dict) else None) or {}
        # Chat and completions name them prompt/completion, the Responses API input/output.
        self.usage["input"] += usage.get("prompt_tokens") or usage.get("input_tokens") or 0
        self.usage["output"] += usage.get("completion_tokens") or usage.get("output_tokens") or 0
        details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details") or {}
        self.usage["cached"] += details.get("cached_tokens") or 0
        details = usage.get("completion_tokens_details") or usage.get("output_tokens_details") or {}
        self.usage["reasoning"] += details.get("reasoning_tokens") or 0

    def to_dict(self) -> dict:
        """OpenAI's Batch object."""
        times = {f"{s}_at": self.times.get(f"{s}_at")
                 for s in ("in_progress", "finalizing", "completed", "failed", "expired", "cancelling", "cancelled")}
        u = self.usage
        return {"id": self.id, "object": "batch", "endpoint": self.endpoint,
                "errors": {"object": "list", "data": self.errors} if self.errors else None,
                "input_file_id": self.input_file_id, "completion_window": COMPLETION_WINDOW, "status": self.status,
                "output_file_id": self.output_file_id, "error_file_id": self.error_file_id,
                "created_at": self.created_at, "expires_at": self.created_at + COMPLETION_WINDOW_S, **times,
                "request_counts": {"total": self.total, "completed": self.completed, "failed": self.failed},
                "metadata": self.metadata, "model": None,
                "usage": {"input_tokens": u["input"], "input_tokens_details": {"cached_tokens": u["cached"]},
                          "output_tokens": u["output"], "output_tokens_details": {"reasoning_tokens": u["reasoning"]},
                          "total_tokens": u["input"] + u["output"]}}


class BatchJobs:
    """This process's batches. `max_in_flight`: lines of all its batches together sent at once."""

    def __init__(self, files: FileStore, app, api_key: str | None, max_in_flight: int) -> None:
        self.files, self.app, self.api_key = files, app, api_key
        self.slots = asyncio.Semaphore(max_in_flight)
        self.jobs: dict[str, BatchJob] = {}  # in the order they were made

    def create(self, input_file_id: str, endpoint: str, metadata: dict[str, str] | None) -> BatchJob:
        job = BatchJob(f"batch_{uuid.uuid4().hex}", input_file_id, endpoint, metadata)
        self.jobs[job.id] = job
        job.task = asyncio.ensure_future(self._run(job))
        # Cancelled before it ever ran, _run could not say so.
        job.task.add_done_callback(lambda _: job.status == "cancelling" and job.set_status("cancelled"))
        return job

    def get(self, batch_id: str) -> BatchJob | None:
        return self.jobs.get(batch_id)

    def newest_first(self) -> list[BatchJob]:
        return list(reversed(self.jobs.values()))

    def cancel(self, job: BatchJob) -> bool:
        """Stop sending its lines and abort those in flight; it turns cancelled once they have
        stopped. False if it is past being cancelled (finalizing or done)."""
        if job.status in ("cancelling", "cancelled"):
            return True
        if job.status not in ("validating", "in_progress"):
            return False
        job.set_status("cancelling")
        job.task.cancel()
        return True

    async def _run(self, job: BatchJob) -> None:
        output, errors = self.files.scratch(), self.files.scratch()
        try:
            try:
                await self._process(job, output, errors)
            except asyncio.CancelledError:
                if job.status != "cancelling":
                    raise  # the process is stopping: nobody will ask for this batch again
            if job.status in ("in_progress", "cancelling"):
                cancelled = job.status == "cancelling"
                if not cancelled:
                    job.set_status("finalizing")
                job.output_file_id = self._publish(output, f"{job.id}_output.jsonl")
                job.error_file_id = self._publish(errors, f"{job.id}_error.jsonl")
                job.set_status("cancelled" if cancelled else "completed")
        except Exception:  # noqa: BLE001 - a bug or a full disk: the batch fails, the process goes on
            log.exception("batch %s failed", job.id)
            job.fail("internal_error", "the batch failed on the server; see its log")
        finally:
            output.unlink(missing_ok=True)
            errors.unlink(missing_ok=True)

    async def _process(self, job: BatchJob, output: Path, errors: Path) -> None:
        path = self.files.path(job.input_file_id)
        if path is None:
            return job.fail("file_not_found", f"input_file_id: {job.input_file_id} was deleted before the batch ran")
        job.total = await asyncio.to_thread(_count, path)
        if not job.total:
            return job.fail("empty_file", "the input file holds no requests")
        job.set_status("in_progress")
        runner = BatchRunner(self.app, self.slots, job.endpoint, self.api_key)
        with open(path, **ENCODING) as lines, open(output, "w") as out, open(errors, "w") as err:
            def on_result(result: LineResult) -> None:
                (out if result.ok else err).write(json.dumps(result.record) + "\n")
                job.count(result)
            await runner.run(lines, on_result)

    def _publish(self, path: Path, filename: str) -> str | None:
        """The file's id; None when it holds nothing (no such results)."""
        if not path.exists() or not path.stat().st_size:
            return None
        return self.files.publish(path, filename, "batch_output")["id"]


def _count(path: Path) -> int:
    with open(path, **ENCODING) as lines:
        return count_requests(lines)
