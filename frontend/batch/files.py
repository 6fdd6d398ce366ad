"""The files of /v1/files, on disk under the data dir (`--data-dir`, default a folder under the
cache): <dir>/files/<id> holds a file's bytes and <id>.json its FileObject, written last, so
a file exists once its object does. So every frontend process given the same data dir sees
the same files, and they outlive a restart."""

from __future__ import annotations

import json
import os
import re
import time
import uuid
from pathlib import Path

from common.paths import cache_dir

FILE_ID = re.compile(r"file-[0-9a-f]{32}")  # also what keeps an id from naming a path outside the folder


def files_dir(data_dir: str | None) -> Path:
    return (Path(data_dir) if data_dir else cache_dir() / "data") / "files"


class FileStore:
    def __init__(self, root: Path) -> None:
        self.root = root  # made at the first write: a frontend that stores nothing leaves no folder

    def scratch(self) -> Path:
        """A fresh path to write a file's bytes to, then publish(): in the same folder, so the
        rename that publishes it is atomic. A dot-name, never listed."""
        self.root.mkdir(parents=True, exist_ok=True)
        return self.root / f".{uuid.uuid4().hex}.part"

    def publish(self, scratch: Path, filename: str, purpose: str) -> dict:
        """Make the bytes at `scratch` a file; returns its FileObject."""
        file_id = f"file-{uuid.uuid4().hex}"
        os.replace(scratch, self.root / file_id)
        created_ns = time.time_ns()
        obj = {"id": file_id, "object": "file", "bytes": (self.root / file_id).stat().st_size,
               "created_at": created_ns // 10**9, "filename": filename, "purpose": purpose,
               "status": "processed", "expires_at": None, "status_details": None}
        meta = self.root / f".{file_id}.json.part"
        # created_ns orders files made within one second (created_at is whole seconds)
        meta.write_text(json.dumps({"file": obj, "created_ns": created_ns}))
        os.replace(meta, self.root / f"{file_id}.json")
        return obj

    def get(self, file_id: str) -> dict | None:
        entry = self._entry(file_id)
        return entry["file"] if entry else None

    def path(self, file_id: str) -> Path | None:
        """Where a file's bytes are; None for an unknown id."""
        return self.root / file_id if self._entry(file_id) else None

    def list(self, purpose: str | None = None) -> list[dict]:
        """Newest first."""
        entries = [self._entry(p.stem) for p in self.root.glob("file-*.json")] if self.root.is_dir() else []
        entries = [e for e in entries if e and (purpose is None or e["file"]["purpose"] == purpose)]
        return [e["file"] for e in sorted(entries, key=lambda e: e["created_ns"], reverse=True)]

    def delete(self, file_id: str) -> bool:
        """Its object goes first: from then on the file is gone for every reader. A batch
        reading it keeps its open handle."""
        if not self._entry(file_id):
            return False
        (self.root / f"{file_id}.json").unlink(missing_ok=True)
        (self.root / file_id).unlink(missing_ok=True)
        return True

    def _entry(self, file_id: str) -> dict | None:
        if not FILE_ID.fullmatch(file_id):
            return None
        try:
            return json.loads((self.root / f"{file_id}.json").read_text())
        except FileNotFoundError:  # unknown, or deleted meanwhile
            return None
