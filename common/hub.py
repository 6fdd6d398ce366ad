"""Model names on the Hugging Face Hub -> local files, through `huggingface_hub` and its cache.

    "ORG/NAME"          a repo: config, tokenizer, generation config and *.safetensors weights
    "ORG/NAME:TAG"      one GGUF file of a GGUF repo, by its quantization tag (llama.cpp's -hf)
    hf_file="F.gguf"    that GGUF file of the repo, by name

Files land in the Hub's cache (HF_HOME, HF_HUB_CACHE; `download_dir` instead if given), so a
second start, any tool reading that cache, and HF_HUB_OFFLINE=1 find them. Only the files the
engine reads are fetched: never *.bin, *.pth, original/, nor a second copy of the weights (with
a model.safetensors.index.json, exactly the files it maps).

    online:  model_info (1 request: files, sizes, commit) -> small files -> `check(folder)`
             (the caller's: the architecture, before any weight byte) -> disk space -> weights
    offline: the snapshot the cache's ref names; no request (HF_HUB_OFFLINE=1, or the Hub
             unreachable while the cache has the repo)

Every failure is a ModelError with what to do: a repo or revision that does not exist, a gated
repo without a token, no network and no cache, a full disk (checked against the listed sizes
first), a repo with neither format, an interrupted download. huggingface_hub resumes a cut file
within its call (Range requests, 5 tries); a run that still fails leaves no partial file and no
snapshot entry for it, and the next run fetches only the files that did not arrive whole.
This module imports neither torch nor the engine: the frontend resolves its --tokenizer here.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from common.errors import ModelError

log = logging.getLogger("pagedserve")

# An ORG/NAME repo id as the Hub spells them (huggingface_hub.utils.validate_repo_id), and an
# optional :TAG. A local path wins over it: callers look at the disk first.
_REPO_ID = re.compile(r"^(?P<repo>[\w][\w.-]{0,95}/[\w.-]{1,96})(?::(?P<tag>[\w.-]+))?$")
DEFAULT_GGUF_TAG = "Q4_K_M"  # llama.cpp's default for -hf without a tag
_GGUF_SHARD = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")

# What each kind of repo is downloaded for. Small files: any top-level file with these endings
# (tokenizers come as tokenizer.json, tokenizer.model, vocab.txt, merges.txt, ...), and the
# configs of a sentence-transformers model's modules (1_Pooling/config.json).
_SMALL_SUFFIXES = (".json", ".jinja", ".txt", ".model", ".tiktoken")
_MODULE_CONFIG = re.compile(r"^\d+_\w+/config\.json$")


@dataclass(frozen=True)
class HubName:
    repo_id: str
    tag: str | None = None  # a GGUF quantization tag

    def __str__(self) -> str:
        return f"{self.repo_id}:{self.tag}" if self.tag else self.repo_id


def parse_hub_name(name: str | None) -> HubName | None:
    """ORG/NAME[:TAG] -> HubName; None for anything else (a path, a bare name)."""
    if not name or name.startswith((".", "~", "/")) or ".." in name or "--" in name:
        return None
    match = _REPO_ID.match(name)
    return HubName(match["repo"], match["tag"]) if match else None


def hub_name(name: str | None) -> HubName | None:
    """The Hub repo `name` names, unless a local file or folder of that name exists (it wins)."""
    if name is None or Path(name).expanduser().exists():
        return None
    return parse_hub_name(name)


@dataclass(frozen=True)
class HubOptions:
    """Which files: a revision (branch, tag or commit), another cache folder than the Hub's, a
    GGUF file by name. The token is huggingface_hub's: HF_TOKEN, else the saved login."""
    revision: str | None = None
    download_dir: str | None = None
    hf_file: str | None = None


def hub_path(name: HubName, kind: str = "model", options: HubOptions = HubOptions(),
             check: Callable[[Path], None] | None = None, field: str = "model") -> Path:
    """The local folder (or, for a GGUF repo, the .gguf file) of `name`, downloaded if the
    cache lacks it. `check(folder)` runs once the small files are there, before any weight is
    downloaded: it raises ValueError for a model the caller cannot run. Raises ModelError."""
    if options.download_dir is None:  # the cache in the key of _resolve's memo
        options = dataclasses.replace(options, download_dir=_cache(options))
    try:
        return _resolve(name, kind, options, check)
    except ValueError as e:  # check() refused the model, or no file of the repo fits
        raise ModelError(str(e), str(name), field) from None
    except Exception as e:  # noqa: BLE001 - every way a download fails becomes one clear line
        raise ModelError(_explain(e, name, options), str(name), field) from None


@lru_cache(maxsize=64)
def _resolve(name: HubName, kind: str, options: HubOptions, check) -> Path:
    # Cached per process: the engine, its tokenizer and the offline LLM resolve the same name.
    from huggingface_hub import constants
    if constants.HF_HUB_OFFLINE:
        return _from_cache(name, kind, options)
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError
    import httpx2
    try:
        info = HfApi().model_info(name.repo_id, revision=options.revision, files_metadata=True)
    except (httpx2.ConnectError, httpx2.TimeoutException, ConnectionError) as e:
        return _cache_instead(name, kind, options, e)
    except HfHubHTTPError as e:
        if e.response is not None and e.response.status_code >= 500:  # the Hub is down, not the name wrong
            return _cache_instead(name, kind, options, e)
        raise
    sizes = {s.rfilename: s.size or 0 for s in info.siblings or []}
    return _download(name, kind, options, info.sha, sizes, check)


def _download(name: HubName, kind: str, options: HubOptions, commit: str, sizes: dict[str, int],
              check) -> Path:
    small = [f for f in sizes if _is_small(f, kind)]
    gguf = _gguf_files(name, options, sizes) if kind == "model" else []
    folder = _fetch(name, options, commit, small)  # the configs, then what they say
    if gguf:
        weights = gguf
    else:
        weights = _weight_files(name, kind, folder, sizes)
        if check is not None:
            check(folder)
    missing = _check_space(folder, {f: sizes.get(f, 0) for f in weights})
    start = time.monotonic()
    folder = _fetch(name, options, commit, weights)
    _write_ref(folder, options.revision or "main", commit)  # last: a failed download names no snapshot
    if missing:
        seconds = time.monotonic() - start
        log.info("downloaded %s@%s: %d file(s), %s in %.1f s (%s/s) to %s", name, commit[:7], len(weights),
                 _size(missing), seconds, _size(missing / max(seconds, 1e-3)), folder)
    return folder / gguf[0] if gguf else folder


def _fetch(name: HubName, options: HubOptions, commit: str, files: list[str]) -> Path:
    """`files` of the commit into the cache, each with its own progress bar (huggingface_hub
    shows one while it downloads a file; a cached file costs no request); the snapshot folder."""
    from huggingface_hub import hf_hub_download
    folder = _snapshot_folder(name, options, commit)
    for file in files:
        hf_hub_download(name.repo_id, file, revision=commit, cache_dir=options.download_dir)
    folder.mkdir(parents=True, exist_ok=True)  # (a repo with no file to fetch still has its snapshot)
    return folder


def _snapshot_folder(name: HubName, options: HubOptions, commit: str) -> Path:
    from huggingface_hub.file_download import repo_folder_name
    return Path(_cache(options)) / repo_folder_name(repo_id=name.repo_id, repo_type="model") / "snapshots" / commit


def _write_ref(snapshot: Path, revision: str, commit: str) -> None:
    """Files fetched by commit (so that they are those listed) leave no ref for the branch or
    tag that named it; offline runs look the name up there, as huggingface_hub does."""
    if revision == commit:
        return
    ref = snapshot.parent.parent / "refs" / revision
    try:
        ref.parent.mkdir(parents=True, exist_ok=True)
        if not ref.is_file() or ref.read_text() != commit:
            ref.write_text(commit)
    except OSError as e:  # a read-only cache still serves this run
        log.warning("could not record %s -> %s in the cache (%s)", revision, commit[:7], e)


def _is_small(file: str, kind: str) -> bool:
    if kind == "adapter":
        return file == "adapter_config.json"
    if "/" in file:
        return kind == "model" and bool(_MODULE_CONFIG.match(file))
    return file.endswith(_SMALL_SUFFIXES)


def _weight_files(name: HubName, kind: str, folder: Path, sizes: dict[str, int]) -> list[str]:
    """The safetensors the engine reads: those a model.safetensors.index.json maps, else
    model.safetensors, else every top-level *.safetensors; for a tokenizer, none."""
    if kind == "tokenizer":
        return []
    if kind == "adapter":
        files = [f for f in sizes if f == "adapter_model.safetensors"]
        if not files:
            raise ValueError(f"{name} has no adapter_model.safetensors (a PEFT LoRA adapter's weights)")
        return files
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        import json
        return sorted(set(json.loads(index.read_text())["weight_map"].values()))
    if "model.safetensors" in sizes:
        return ["model.safetensors"]
    files = sorted(f for f in sizes if f.endswith(".safetensors") and "/" not in f)
    if not files:
        others = sorted(f for f in sizes if f.endswith((".bin", ".pth", ".pt", ".ckpt", ".h5", ".msgpack", ".onnx")))
        found = f" (it has {', '.join(others[:4])}{', ...' if len(others) > 4 else ''})" if others else ""
        raise ValueError(f"the repo has neither *.safetensors nor *.gguf weights{found}: pagedserve reads "
                         "safetensors or GGUF; pick a repo that has them, or convert it")
    return files


def _gguf_files(name: HubName, options: HubOptions, sizes: dict[str, int]) -> list[str]:
    """The GGUF file (all its parts, first first) that the tag or hf_file picks; [] for a repo
    of safetensors, unless a tag or file asked for GGUF."""
    ggufs = sorted(f for f in sizes if f.endswith(".gguf"))
    wanted = options.hf_file or name.tag
    if wanted is None and (not ggufs or any(f.endswith(".safetensors") for f in sizes)):
        return []
    if options.hf_file is not None:
        picked = [f for f in ggufs if f == options.hf_file]
    else:
        picked = _by_tag(ggufs, name.tag or DEFAULT_GGUF_TAG)
        if not picked and name.tag is None:
            picked = [ggufs[0]]  # no tag asked for and no Q4_K_M: the first, as llama.cpp does
    if not picked:
        have = ", ".join(ggufs) or "no .gguf files"
        raise ValueError(f"no GGUF file {'named ' + repr(wanted) if options.hf_file else 'tagged ' + repr(wanted)} "
                         f"in the repo (it has {have})")
    return _with_shards(picked[0], ggufs)


def _by_tag(ggufs: list[str], tag: str) -> list[str]:
    """Files whose name holds the tag as a word (Q4_K_M in model-Q4_K_M.gguf, not in
    model-Q4_K_M_XL.gguf), case-insensitively; multimodal projectors (mmproj) are not models."""
    pattern = re.compile(rf"(?<![A-Za-z0-9]){re.escape(tag)}(?![A-Za-z0-9_])", re.IGNORECASE)
    return [f for f in ggufs if pattern.search(Path(f).name) and "mmproj" not in f.lower()]


def _with_shards(file: str, ggufs: list[str]) -> list[str]:
    match = _GGUF_SHARD.search(file)
    if not match:
        return [file]
    prefix, count = file[:match.start()], match[2]
    parts = [f"{prefix}-{i:05d}-of-{count}.gguf" for i in range(1, int(count) + 1)]
    missing = [p for p in parts if p not in ggufs]
    if missing:
        raise ValueError(f"the GGUF {file} has {int(count)} parts and the repo lacks {', '.join(missing)}")
    return parts


def _check_space(folder: Path, files: dict[str, int]) -> int:
    """The bytes of `files` (name -> listed size) not in `folder` yet; ValueError if the disk
    has less free."""
    needed = sum(size for f, size in files.items() if not (folder / f).exists())
    free = shutil.disk_usage(folder).free
    if needed > free:
        raise ValueError(f"the download needs {_size(needed)} and {folder} has {_size(free)} free: free some "
                         "space, or give --download-dir on a larger disk")
    return needed


def _from_cache(name: HubName, kind: str, options: HubOptions, reason: str = "HF_HUB_OFFLINE=1 forbids downloads"
                ) -> Path:
    """The snapshot that the cache's ref for the revision names (or the commit given), with no
    request. Whether it holds every file is for the caller's check to say."""
    revision = options.revision or "main"
    snapshots = _snapshot_folder(name, options, revision).parent
    ref = snapshots.parent / "refs" / revision
    commit = ref.read_text().strip() if ref.is_file() else revision
    folder = snapshots / commit
    if not folder.is_dir():
        raise ValueError(f"not in the Hugging Face cache ({_cache(options)}) and {reason}: download it first "
                         f"(`pagedserve download {name}`) where the Hub is reachable", str(name))
    if kind != "model":
        return folder
    sizes = {p.relative_to(folder).as_posix(): 0 for p in folder.rglob("*") if p.is_file()}
    gguf = _gguf_files(name, options, sizes)
    return folder / gguf[0] if gguf else folder


def _cache_instead(name: HubName, kind: str, options: HubOptions, error: Exception) -> Path:
    """The Hub cannot be reached: serve the cached copy if there is one, as transformers does."""
    log.warning("cannot reach the Hub for %s (%s); using the cached copy", name, _short(error))
    return _from_cache(name, kind, options, f"the Hub cannot be reached ({_short(error)}; HF_ENDPOINT, or "
                                            "HF_HUB_OFFLINE=1 to serve only from the cache)")


def _explain(error: Exception, name: HubName, options: HubOptions) -> str:
    """What went wrong, and what to do about it, in one line."""
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError
    if isinstance(error, GatedRepoError):
        return (f"a gated repo: accept its terms on its Hub page, then give a token with access to it in "
                f"HF_TOKEN (or --hf-token){'; the token given was refused' if _token_given() else ''}")
    if isinstance(error, RepositoryNotFoundError):
        return ("no such model repo on the Hub (or a private one: give a token with access in HF_TOKEN or "
                "--hf-token)")
    if isinstance(error, RevisionNotFoundError):
        return f"the repo has no revision {options.revision!r} (a branch, tag or commit)"
    if isinstance(error, HfHubHTTPError) and error.response is not None and error.response.status_code in (401, 403):
        return f"the Hub refused access ({error.response.status_code}): check HF_TOKEN (or --hf-token)"
    if isinstance(error, OSError) and error.errno == errno.ENOSPC:
        return f"no space left on the disk of {_cache(options)}: free some, or give --download-dir on a larger disk"
    return (f"the download failed ({_short(error)}); run again to finish it (the files that arrived whole "
            f"are kept in {_cache(options)})")


def _token_given() -> bool:
    from huggingface_hub.utils import get_token
    return bool(get_token())


def _cache(options: HubOptions) -> str:
    from huggingface_hub import constants
    return options.download_dir or constants.HF_HUB_CACHE


def _short(error: Exception) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__


def _size(num_bytes: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if num_bytes < 1000 or unit == "TB":
            return f"{num_bytes:.1f} {unit}" if unit != "B" else f"{int(num_bytes)} B"
        num_bytes /= 1000
    return ""
