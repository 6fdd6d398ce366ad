"""`pagedserve download`: fetch a Hub model into the Hugging Face cache ahead of serving (as
`ollama pull` does), or list what the cache holds.

The files are those `serve` would read (common/hub.py), checked as `serve` checks them, so a
model that downloads here starts there with no network (HF_HUB_OFFLINE=1 too)."""

from __future__ import annotations

import argparse
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", metavar="MODEL",
                   help="a Hub repo id: ORG/NAME, or ORG/NAME:TAG for one GGUF file of a GGUF repo by its "
                        "quantization tag (e.g. :Q4_K_M)")
    p.add_argument("--revision", help="a branch, tag or commit (default: main)")
    p.add_argument("--hf-file", metavar="FILE", help="the GGUF file of a GGUF repo, by name (instead of a :TAG)")
    p.add_argument("--download-dir", metavar="DIR",
                   help="cache folder instead of the Hugging Face cache (HF_HUB_CACHE, else HF_HOME/hub)")
    p.add_argument("--hf-token", metavar="TOKEN", help="token for gated or private repos (default: HF_TOKEN)")
    p.add_argument("--list", action="store_true", help="list the models in the cache, with their sizes, and exit")


def check_args(args: argparse.Namespace) -> None:
    """Before anything is fetched: a model to fetch, or --list (argparse's usage error, exit 2)."""
    if (args.model is None) == (not args.list):
        raise SystemExit("pagedserve download: error: give a MODEL to fetch, or --list")


def run(args: argparse.Namespace) -> int:
    """The model was fetched and checked by the CLI's model check (pagedserve.cli): print where."""
    if args.list:
        return list_cache(args.download_dir)
    from engine.models.source import model_files
    print(model_files(args))
    return 0


def list_cache(download_dir: str | None) -> int:
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound
    try:
        cache = scan_cache_dir(download_dir)
    except CacheNotFound as e:
        print(f"no Hugging Face cache at {e.cache_dir}: nothing downloaded yet", file=sys.stderr)
        return 0
    repos = sorted((r for r in cache.repos if r.repo_type == "model"), key=lambda r: r.repo_id.lower())
    rows = [(r.repo_id, r.size_on_disk_str, str(r.nb_files), ", ".join(sorted(ref for rev in r.revisions
                                                                          for ref in rev.refs)) or "-",
             str(r.repo_path)) for r in repos]
    header = ("MODEL", "SIZE", "FILES", "REFS", "PATH")
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header) - 1)]
    for row in [header, *rows]:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[-1])
    from huggingface_hub import constants
    print(f"{len(rows)} model(s), {cache.size_on_disk / 1e9:.2f} GB, in {download_dir or constants.HF_HUB_CACHE}")
    return 0
