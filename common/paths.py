"""Where pagedserve keeps what it builds and caches on this machine."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """$PAGEDSERVE_CACHE_DIR, else $XDG_CACHE_HOME/pagedserve (~/.cache/pagedserve): the
    compiled CPU kernels, random-weight model folders, converted checkpoints."""
    root = os.environ.get("PAGEDSERVE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "pagedserve")
    return Path(root)
