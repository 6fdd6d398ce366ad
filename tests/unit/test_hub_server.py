"""The real huggingface_hub client against tests/hub_server.py: every route the engine's Hub
downloads rely on, with real HTTP (no mock of the client)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
from huggingface_hub import HfApi, constants, hf_hub_download, snapshot_download
from huggingface_hub.errors import (
    EntryNotFoundError,
    GatedRepoError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from hub_server import HubServer

CONFIG = b'{"architectures": ["LlamaForCausalLM"]}'
WEIGHTS = bytes(range(256)) * 40  # an LFS file (by its suffix), 10 KiB


@pytest.fixture
def repo(hub, request) -> str:
    """A repo of its own for each test on the shared hub: config, tokenizer, weights, and a
    second copy of the weights (`.bin`, `original/`) that a download must skip."""
    repo_id = f"org/{request.node.name}"
    hub.add_repo(repo_id, {"config.json": CONFIG, "tokenizer.json": b'{"model": {}}',
                           "model.safetensors": WEIGHTS, "pytorch_model.bin": b"pickle",
                           "original/consolidated.pth": b"torch"}, tags=("v1.0",))
    return repo_id


def test_snapshot_download_with_patterns(hub, repo, tmp_path):
    hub.clear_requests()
    folder = Path(snapshot_download(repo, allow_patterns=["*.json", "*.safetensors"],
                                    cache_dir=tmp_path, endpoint=hub.url))
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert (folder / "config.json").read_bytes() == CONFIG
    assert (folder / "model.safetensors").read_bytes() == WEIGHTS
    requested = hub.requests
    assert ("GET", f"/api/models/{repo}/revision/main") in requested
    assert ("GET", f"/api/models/{repo}/tree/{folder.name}") in requested  # listed by commit sha
    assert not [path for _, path in requested if path.endswith((".bin", ".pth"))]
    # The LFS file: HEAD on /resolve (a 302), then its bytes from the "CDN" host.
    sha256 = hashlib.sha256(WEIGHTS).hexdigest()
    assert ("GET", f"/lfs/{sha256}/model.safetensors") in requested
    assert (tmp_path / f"models--org--{repo[4:]}" / "blobs" / sha256).is_file()  # the blob is named by its ETag


def test_hf_hub_download_one_file(hub, repo, tmp_path):
    path = hf_hub_download(repo, "model.safetensors", cache_dir=tmp_path, endpoint=hub.url)
    assert Path(path).read_bytes() == WEIGHTS
    path = hf_hub_download(repo, "original/consolidated.pth", cache_dir=tmp_path, endpoint=hub.url)
    assert Path(path).read_bytes() == b"torch"


def test_add_folder(hub, tmp_path):
    (tmp_path / "model" / "sub").mkdir(parents=True)
    (tmp_path / "model" / ".git").mkdir()
    (tmp_path / "model" / "config.json").write_bytes(CONFIG)
    (tmp_path / "model" / "sub" / "w.gguf").write_bytes(WEIGHTS)
    (tmp_path / "model" / ".git" / "HEAD").write_text("ref: refs/heads/main")
    hub.add_folder("org/folder", tmp_path / "model")
    folder = Path(snapshot_download("org/folder", cache_dir=tmp_path / "cache", endpoint=hub.url))
    assert sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()) == [
        "config.json", "sub/w.gguf"]
    assert (folder / "sub" / "w.gguf").read_bytes() == WEIGHTS


def test_revisions_by_branch_tag_and_sha(hub, repo, tmp_path):
    main_sha = hub.add_repo(repo, {"config.json": CONFIG}, tags=("v1.0",))
    dev_sha = hub.add_repo(repo, {"config.json": b'{"dev": true}'}, revision="dev")
    assert len(dev_sha) == 40 and dev_sha != main_sha

    def config(revision: str) -> bytes:
        return Path(hf_hub_download(repo, "config.json", revision=revision, cache_dir=tmp_path,
                                    endpoint=hub.url)).read_bytes()
    assert config("dev") == config(dev_sha) == b'{"dev": true}'
    assert config("v1.0") == config(main_sha) == CONFIG
    assert (tmp_path / f"models--org--{repo[4:]}" / "refs" / "dev").read_text() == dev_sha
    assert HfApi(endpoint=hub.url).model_info(repo, revision="v1.0").sha == main_sha


def test_listings(hub, repo):
    api = HfApi(endpoint=hub.url)
    assert sorted(api.list_repo_files(repo)) == ["config.json", "model.safetensors",
                                                  "original/consolidated.pth", "pytorch_model.bin",
                                                  "tokenizer.json"]
    top = {entry.path for entry in api.list_repo_tree(repo)}  # not recursive: the folder, not its files
    assert "original" in top and "original/consolidated.pth" not in top
    assert [f.rfilename for f in api.model_info(repo).siblings if f.size is not None] == []  # as on the Hub
    siblings = {f.rfilename: f for f in api.model_info(repo, files_metadata=True).siblings}
    assert siblings["model.safetensors"].size == len(WEIGHTS)
    assert siblings["model.safetensors"].lfs.sha256 == hashlib.sha256(WEIGHTS).hexdigest()
    assert siblings["config.json"].lfs is None


def test_claimed_size_shows_in_listings_only(tmp_path):
    with HubServer() as hub:
        hub.add_repo("org/big", {"model.safetensors": WEIGHTS})
        hub.claimed_size("model.safetensors", 10**15)
        api = HfApi(endpoint=hub.url)
        assert [f.size for f in api.list_repo_tree("org/big")] == [10**15]
        assert api.model_info("org/big", files_metadata=True).siblings[0].size == 10**15
        path = hf_hub_download("org/big", "model.safetensors", cache_dir=tmp_path, endpoint=hub.url)
        assert Path(path).read_bytes() == WEIGHTS


def test_gated_repo_needs_the_token(hub, tmp_path):
    hub.add_repo("org/gated", {"config.json": CONFIG}, gated=True)
    assert HfApi(endpoint=hub.url).model_info("org/gated", token=False).gated == "manual"  # info is public
    with pytest.raises(GatedRepoError) as missing:
        snapshot_download("org/gated", cache_dir=tmp_path, endpoint=hub.url, token=False)
    assert missing.value.response.status_code == 401
    with pytest.raises(GatedRepoError) as wrong:
        hf_hub_download("org/gated", "config.json", cache_dir=tmp_path, endpoint=hub.url, token="hf_wrong")
    assert wrong.value.response.status_code == 403
    folder = snapshot_download("org/gated", cache_dir=tmp_path, endpoint=hub.url, token=hub.token)
    assert (Path(folder) / "config.json").read_bytes() == CONFIG


def test_not_found_errors(hub, repo, tmp_path):
    with pytest.raises(RepositoryNotFoundError) as no_repo:
        snapshot_download("org/missing", cache_dir=tmp_path, endpoint=hub.url)
    assert not isinstance(no_repo.value, GatedRepoError)
    with pytest.raises(RevisionNotFoundError):
        snapshot_download(repo, revision="no-such-branch", cache_dir=tmp_path, endpoint=hub.url)
    with pytest.raises(RevisionNotFoundError):
        hf_hub_download(repo, "config.json", revision="0" * 40, cache_dir=tmp_path, endpoint=hub.url)
    with pytest.raises(EntryNotFoundError):
        hf_hub_download(repo, "missing.json", cache_dir=tmp_path, endpoint=hub.url)


def test_cut_mid_file_resumes_with_a_range(hub, repo, tmp_path):
    """The client retries a body cut short within the same call (1 s later). It keeps only what it
    has written, in whole 10 MiB chunks (constants.DOWNLOAD_CHUNK_SIZE), and asks for the rest."""
    chunk = constants.DOWNLOAD_CHUNK_SIZE
    weights = bytes(range(256)) * ((chunk + chunk // 4) // 256)
    hub.add_repo(repo, {"cut.gguf": weights})
    hub.cut_after("/cut.gguf", chunk + 1000)
    path = hf_hub_download(repo, "cut.gguf", cache_dir=tmp_path, endpoint=hub.url)
    assert Path(path).read_bytes() == weights
    cdn_path = f"/lfs/{hashlib.sha256(weights).hexdigest()}/cut.gguf"
    assert hub.requests.count(("GET", cdn_path)) == 2
    assert [r for r in hub.range_requests if r[0] == cdn_path] == [(cdn_path, f"bytes={chunk}-", 206)]


def test_offline_after_a_download_sends_nothing(hub, repo, tmp_path, monkeypatch):
    online = snapshot_download(repo, allow_patterns=["*.json"], cache_dir=tmp_path, endpoint=hub.url)
    hub.clear_requests()
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert snapshot_download(repo, allow_patterns=["*.json"], cache_dir=tmp_path, endpoint=hub.url) == online
    assert hf_hub_download(repo, "config.json", cache_dir=tmp_path, endpoint=hub.url) == f"{online}/config.json"
    assert hub.requests == []


def test_patch_endpoint_serves_calls_without_endpoint(hub, repo, tmp_path, monkeypatch):
    hub.patch_endpoint(monkeypatch)
    folder = snapshot_download(repo, allow_patterns=["config.json"], cache_dir=tmp_path)
    assert (Path(folder) / "config.json").read_bytes() == CONFIG


def test_environment_in_a_subprocess(hub, repo, tmp_path):
    """What an engine process sees: HF_ENDPOINT, HF_HUB_CACHE and HF_TOKEN from its environment."""
    code = "from huggingface_hub import snapshot_download; print(snapshot_download('%s'))" % repo
    env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HUB_CACHE": str(tmp_path), "HF_TOKEN": hub.token}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert (Path(out.stdout.strip()) / "model.safetensors").read_bytes() == WEIGHTS
