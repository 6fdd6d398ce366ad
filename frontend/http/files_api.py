"""OpenAI's /v1/files, for batch input and output (frontend/batch/files.py keeps them on disk):

    POST   /v1/files               multipart/form-data: file, purpose=batch  -> FileObject
    GET    /v1/files               ?purpose= &order=desc|asc &limit= &after= -> a list, newest first
    GET    /v1/files/{id}          -> FileObject
    GET    /v1/files/{id}/content  -> the file's bytes
    DELETE /v1/files/{id}          -> {"id", "object": "file", "deleted": true}
"""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from starlette.datastructures import UploadFile

from frontend.batch.files import FileStore
from frontend.http.errors import bad_request, not_found

MAX_FILE_BYTES = 200 * 1024 * 1024  # OpenAI's limit for a batch input file
MULTIPART_SLACK = 64 * 1024  # the form's own bytes around the file, in Content-Length
CHUNK = 1024 * 1024


def add_file_routes(app: FastAPI, files: FileStore) -> None:
    @app.post("/v1/files")
    async def upload_file(request: Request):
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > MAX_FILE_BYTES + MULTIPART_SLACK:
            raise _too_big(int(length))  # before the form parser spools it all to disk
        async with request.form(max_files=1, max_fields=8) as form:
            upload, purpose = form.get("file"), form.get("purpose")
            if not isinstance(upload, UploadFile):
                raise bad_request("file: missing; send the file as a multipart/form-data part named file", "file")
            if purpose != "batch":
                raise bad_request(f"purpose: only 'batch' is supported, got {purpose!r}", "purpose")
            scratch = files.scratch()
            try:
                size = await asyncio.to_thread(_copy, upload.file, scratch)
                if size > MAX_FILE_BYTES:
                    raise _too_big(size)
                return files.publish(scratch, upload.filename or "upload.jsonl", purpose)
            finally:
                scratch.unlink(missing_ok=True)  # gone already once published

    @app.get("/v1/files")
    async def list_files(request: Request):
        order = request.query_params.get("order", "desc")
        if order not in ("asc", "desc"):
            raise bad_request(f"order: must be asc or desc, got {order!r}", "order")
        items = files.list(request.query_params.get("purpose"))
        return cursor_page(request, items[::-1] if order == "asc" else items, 10000, 10000)

    @app.get("/v1/files/{file_id}")
    async def get_file(file_id: str):
        obj = files.get(file_id)
        if obj is None:
            raise _unknown(file_id)
        return obj

    @app.get("/v1/files/{file_id}/content")
    async def file_content(file_id: str):
        path = files.path(file_id)
        if path is None:
            raise _unknown(file_id)
        try:
            f = open(path, "rb")  # an open file stays readable if it is deleted meanwhile
        except FileNotFoundError:  # deleted since
            raise _unknown(file_id) from None
        return StreamingResponse(_chunks(f), media_type="application/octet-stream",
                                 headers={"content-length": str(os.fstat(f.fileno()).st_size)})

    @app.delete("/v1/files/{file_id}")
    async def delete_file(file_id: str):
        if not files.delete(file_id):
            raise _unknown(file_id)
        return {"id": file_id, "object": "file", "deleted": True}


def cursor_page(request: Request, items: list[dict], default_limit: int, max_limit: int) -> dict:
    """OpenAI's cursor page of `items` (in their order): `limit` of them after the one whose id
    is `after`."""
    text = request.query_params.get("limit", str(default_limit))
    if not text.isdigit() or not 1 <= int(text) <= max_limit:
        raise bad_request(f"limit: must be an integer from 1 to {max_limit}, got {text!r}", "limit")
    start, after = 0, request.query_params.get("after")
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise bad_request(f"after: {after!r} is not in this list", "after")
        start = ids.index(after) + 1
    page = items[start:start + int(text)]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": start + len(page) < len(items)}


def _copy(source, target: Path) -> int:
    """Copy the upload (the form parser's spooled temporary file) into the store; its size."""
    source.seek(0)
    with open(target, "wb") as out:
        shutil.copyfileobj(source, out, CHUNK)
        return out.tell()


def _chunks(f):
    with f:
        while chunk := f.read(CHUNK):
            yield chunk


def _too_big(size: int):
    return bad_request(f"file: {size} bytes is more than the {MAX_FILE_BYTES} allowed", "file")


def _unknown(file_id: str):
    return not_found(f"No such File object: {file_id}", "file_id")
