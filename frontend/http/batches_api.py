"""OpenAI's /v1/batches (frontend/batch/jobs.py runs them; each line goes to this app's own
route, in-process), and /v1/files for their input and output (frontend/http/files_api.py):

    POST /v1/batches              {"input_file_id", "endpoint", "completion_window": "24h", "metadata"}
    GET  /v1/batches              ?limit= &after=    newest first
    GET  /v1/batches/{id}
    POST /v1/batches/{id}/cancel
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict

from frontend.batch.files import FileStore, files_dir
from frontend.batch.jobs import COMPLETION_WINDOW, BatchJob, BatchJobs
from frontend.batch.runner import BATCH_URLS, served_urls
from frontend.http.context import HttpContext, parse_body
from frontend.http.errors import bad_request, not_found
from frontend.http.files_api import add_file_routes, cursor_page
from frontend.pooling import served_task

# OpenAI's limits on a batch's metadata
MAX_METADATA_KEYS, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 16, 64, 512


class CreateBatchRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None


def add_batch_routes(app: FastAPI, ctx: HttpContext) -> None:
    files = FileStore(files_dir(ctx.options.data_dir))
    add_file_routes(app, files)
    # All batches together take at most half the generation slots: live requests keep the rest.
    jobs = BatchJobs(files, app, ctx.api_key, max(1, ctx.llm.max_concurrent_streams // 2))

    @app.post("/v1/batches")
    async def create_batch(request: Request):
        body = await parse_body(request, CreateBatchRequest)
        welcome = ctx.llm.welcome  # the model's task decides the endpoints (none yet: any route)
        _check(body, served_urls(app, served_task(welcome.pooler) if welcome is not None else None))
        input_file = files.get(body.input_file_id)
        if input_file is None:
            raise not_found(f"No such File object: {body.input_file_id}", "input_file_id")
        if input_file["purpose"] != "batch":
            raise bad_request(f"input_file_id: {body.input_file_id} has purpose {input_file['purpose']!r}, "
                              "not 'batch'", "input_file_id")
        return jobs.create(body.input_file_id, body.endpoint, body.metadata).to_dict()

    @app.get("/v1/batches")
    async def list_batches(request: Request):
        return cursor_page(request, [job.to_dict() for job in jobs.newest_first()], 20, 100)

    @app.get("/v1/batches/{batch_id}")
    async def get_batch(batch_id: str):
        return _job(jobs, batch_id).to_dict()

    @app.post("/v1/batches/{batch_id}/cancel")
    async def cancel_batch(batch_id: str):
        job = _job(jobs, batch_id)
        if not jobs.cancel(job):
            raise bad_request(f"batch {batch_id} is {job.status}: too late to cancel")
        return job.to_dict()


def _check(body: CreateBatchRequest, served: list[str]) -> None:
    if body.endpoint not in served:
        why = "is not served by this server" if body.endpoint in BATCH_URLS else "is not a batch endpoint"
        raise bad_request(f"endpoint: {body.endpoint!r} {why}; use one of {', '.join(served)}", "endpoint")
    if body.completion_window != COMPLETION_WINDOW:
        raise bad_request(f"completion_window: must be {COMPLETION_WINDOW!r}, got {body.completion_window!r}",
                          "completion_window")
    metadata = body.metadata or {}
    if len(metadata) > MAX_METADATA_KEYS:
        raise bad_request(f"metadata: at most {MAX_METADATA_KEYS} pairs, got {len(metadata)}", "metadata")
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY_CHARS or len(value) > MAX_METADATA_VALUE_CHARS:
            raise bad_request(f"metadata: keys may have at most {MAX_METADATA_KEY_CHARS} characters and values "
                              f"{MAX_METADATA_VALUE_CHARS}; {key[:80]!r} has more", "metadata")


def _job(jobs: BatchJobs, batch_id: str) -> BatchJob:
    job = jobs.get(batch_id)
    if job is None:
        raise not_found(f"No such Batch object: {batch_id}", "batch_id")
    return job
