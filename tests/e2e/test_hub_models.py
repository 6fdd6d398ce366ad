"""Models named by their Hugging Face Hub id (issue 45): `pagedserve download` and `serve` fetch
them with the real huggingface_hub client from a Hub of our own on loopback (tests/hub_server.py),
into a Hugging Face cache in tmp. Every command runs as a real subprocess with HF_ENDPOINT,
HF_HOME, HF_TOKEN and HF_HUB_OFFLINE in its environment, as a user would set them."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from common.v1 import info_pb2
from conftest import drain, log_tail, start_serve, stop
from helpers import build_tiny_model, split_gguf

ORG = "pagedserve-tests"
TINY, GGUF, GATED = f"{ORG}/tiny-qwen3", f"{ORG}/SmolLM2-135M-Instruct-GGUF", f"{ORG}/gated-qwen3"
BIN_ONLY, GPT2, CUT = f"{ORG}/bin-only", f"{ORG}/gpt2", f"{ORG}/cut-qwen3"
GGUF_FILE = "SmolLM2-135M-Instruct-Q4_1.gguf"
COMMAND_S = 120
TINY_FLAGS = ("--dtype", "float32", "--num-kv-blocks", "64", "--max-model-len", "256", "--num-threads", "1")


@pytest.fixture(scope="module")
def repos(hub, tmp_path_factory, bundled_tokenizer, bundled_path):
    """The module's repos on the session's Hub: a tiny Qwen3 (safetensors, with files the engine
    must never fetch beside it) on main and on a branch `dev` of other weights, the bundled
    SmolLM2 as a GGUF repo with a second quantization beside it, and repos that must fail."""
    root = tmp_path_factory.mktemp("hub-repos")
    tiny = build_tiny_model("qwen3", root / "tiny", bundled_tokenizer)
    never = {"pytorch_model.bin": b"\0" * 4096, "original/consolidated.00.pth": b"\0" * 4096,
             "onnx/model.onnx": b"\0" * 4096, "README.md": b"# tiny\n"}
    files = {p.name: p for p in tiny.iterdir()}
    hub.add_repo(TINY, {**files, **never})
    dev = build_tiny_model("qwen3", root / "dev", bundled_tokenizer, initializer_range=0.5)
    dev_sha = hub.add_repo(TINY, {p.name: p for p in dev.iterdir()}, revision="dev", tags=("v2",))
    hub.add_repo(GGUF, {GGUF_FILE: bundled_path, "SmolLM2-135M-Instruct-Q8_0.gguf": b"GGUF" + b"\0" * 60,
                        "README.md": b"# gguf\n"})
    hub.add_repo(GATED, files, gated=True)
    hub.add_repo(BIN_ONLY, {"config.json": files["config.json"], "pytorch_model.bin": b"\0" * 4096})
    gpt2 = json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}).encode()
    hub.add_repo(GPT2, {"config.json": gpt2, "model.safetensors": b"\0" * 4096})
    hub.add_repo(CUT, files)
    return {"tiny": tiny, "dev": dev, "dev_sha": dev_sha}


def run(hub, home: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    """`pagedserve ARGS` against the test Hub, with `home` as HF_HOME (its cache: home/hub)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    return subprocess.run([sys.executable, "-m", "pagedserve", *args], capture_output=True, text=True,
                          timeout=COMMAND_S, env={**clean, "HF_ENDPOINT": hub.url, "HF_HOME": str(home), **env})


def fetched(hub, repo: str) -> set[str]:
    """The files of `repo` whose bytes were requested (GETs of resolve/ or the LFS "CDN")."""
    names = set()
    for method, path in hub.requests:
        if method == "GET" and f"/{repo}/resolve/" in path:
            names.add(path.split("/resolve/", 1)[1].split("/", 1)[1])
        elif method == "GET" and path.startswith("/lfs/"):
            names.add(path.split("/", 3)[3])
    return names


def test_download_fetches_only_what_the_engine_reads(hub, repos, tmp_path):
    hub.clear_requests()
    done = run(hub, tmp_path, "download", TINY, TQDM_POSITION="-1")  # progress bars, as on a terminal
    assert done.returncode == 0, done.stderr
    assert "model.safetensors: 100%" in done.stderr and "HTTP Request" not in done.stderr, done.stderr
    folder = Path(done.stdout.strip())
    assert folder.parent.name == "snapshots" and str(folder).startswith(str(tmp_path / "hub"))
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
        assert (folder / name).read_bytes() == (repos["tiny"] / name).read_bytes(), name
    got = fetched(hub, TINY)
    assert not got & {"pytorch_model.bin", "original/consolidated.00.pth", "onnx/model.onnx", "README.md"}, got
    assert f"downloaded {TINY}@" in done.stderr and " s (" in done.stderr, done.stderr  # bytes and time, logged
    # A second run finds everything in the cache: one request (the revision's commit), no bytes.
    hub.clear_requests()
    again = run(hub, tmp_path, "download", TINY)
    assert again.returncode == 0 and again.stdout == done.stdout, again.stderr
    assert fetched(hub, TINY) == set() and len(hub.requests) == 1, hub.requests
    listing = run(hub, tmp_path, "download", "--list")
    assert listing.returncode == 0 and TINY in listing.stdout and "1 model(s)" in listing.stdout, listing.stdout


def test_a_revision_by_branch_tag_or_commit(hub, repos, tmp_path):
    paths = set()
    for revision in ("dev", "v2", repos["dev_sha"]):
        done = run(hub, tmp_path, "download", TINY, "--revision", revision)
        assert done.returncode == 0, done.stderr
        paths.add(done.stdout.strip())
    [path] = paths
    assert Path(path).name == repos["dev_sha"]
    assert (Path(path) / "model.safetensors").read_bytes() == (repos["dev"] / "model.safetensors").read_bytes()
    missing = run(hub, tmp_path, "download", TINY, "--revision", "no-such-branch")
    assert missing.returncode == 2 and "no revision 'no-such-branch'" in missing.stderr, missing.stderr


def test_offline_serves_the_cache_with_no_request(hub, repos, tmp_path):
    assert run(hub, tmp_path, "download", TINY).returncode == 0
    hub.clear_requests()
    offline = run(hub, tmp_path, "download", TINY, HF_HUB_OFFLINE="1")
    assert offline.returncode == 0, offline.stderr
    assert hub.requests == []
    other = run(hub, tmp_path / "empty", "download", TINY, HF_HUB_OFFLINE="1")
    assert other.returncode == 2 and "HF_HUB_OFFLINE" in other.stderr and hub.requests == [], other.stderr


def test_a_gguf_repo_by_tag_resumes_a_cut_file(hub, repos, tmp_path, bundled_path):
    """The server drops the connection past the client's first 10 MiB chunk: huggingface_hub
    asks for the rest (a Range request) and the file arrives whole; the Q8_0 beside it is never
    fetched."""
    hub.clear_requests()
    hub.cut_after(GGUF_FILE, 10 * 2**20 + 1000)
    done = run(hub, tmp_path, "download", f"{GGUF}:Q4_1")
    assert done.returncode == 0, done.stderr
    path = Path(done.stdout.strip())
    assert path.name == GGUF_FILE and path.stat().st_size == bundled_path.stat().st_size
    assert _sha256(path) == _sha256(bundled_path)
    assert [r for r in hub.range_requests if r[0].endswith(GGUF_FILE) and r[2] == 206], hub.range_requests
    assert fetched(hub, GGUF) == {GGUF_FILE}, fetched(hub, GGUF)
    same = run(hub, tmp_path, "download", GGUF, "--hf-file", GGUF_FILE)
    assert same.returncode == 0 and same.stdout == done.stdout, same.stderr
    absent = run(hub, tmp_path, "download", f"{GGUF}:IQ2_XS")
    assert absent.returncode == 2 and "no GGUF file tagged 'IQ2_XS'" in absent.stderr and GGUF_FILE in absent.stderr


def test_a_split_gguf_by_tag_takes_all_its_parts(hub, repos, tmp_path, bundled_path):
    parts = split_gguf(bundled_path, tmp_path / "SmolLM2-Q4_1.gguf", 3)
    repo = f"{ORG}/SmolLM2-split-GGUF"
    hub.add_repo(repo, {p.name: p for p in parts})
    done = run(hub, tmp_path / "home", "download", f"{repo}:Q4_1")
    assert done.returncode == 0, done.stderr
    first = Path(done.stdout.strip())
    assert first.name == parts[0].name  # the engine finds the others beside it (the check did)
    assert [(first.parent / p.name).stat().st_size for p in parts] == [p.stat().st_size for p in parts]


def test_an_interrupted_download_fails_clearly_and_the_next_run_finishes_it(hub, repos, tmp_path):
    """Cut more often than the client retries: a clear error, no partial file or snapshot entry
    left for the weights, and the next run fetches only them."""
    hub.clear_requests()
    hub.cut_after("model.safetensors", 1000, times=6)
    first = run(hub, tmp_path, "download", CUT)
    assert first.returncode == 2, first.stderr
    assert "download failed" in first.stderr and "run again" in first.stderr, first.stderr
    assert "Traceback" not in first.stderr
    cache = tmp_path / "hub" / f"models--{CUT.replace('/', '--')}"
    assert not list(cache.rglob("*.incomplete")) and not list(cache.rglob("model.safetensors"))
    hub.clear_requests()
    second = run(hub, tmp_path, "download", CUT)
    assert second.returncode == 0, second.stderr
    assert fetched(hub, CUT) <= {"model.safetensors"}, fetched(hub, CUT)


def test_a_gated_repo_needs_a_token(hub, repos, tmp_path):
    refused = run(hub, tmp_path, "download", GATED)
    assert refused.returncode == 2 and "gated" in refused.stderr and "HF_TOKEN" in refused.stderr, refused.stderr
    wrong = run(hub, tmp_path, "download", GATED, HF_TOKEN="hf_wrong")
    assert wrong.returncode == 2 and "refused" in wrong.stderr, wrong.stderr
    assert run(hub, tmp_path, "download", GATED, "--hf-token", hub.token).returncode == 0
    assert run(hub, tmp_path / "env", "download", GATED, HF_TOKEN=hub.token).returncode == 0


@pytest.mark.parametrize("repo, words", [
    (f"{ORG}/no-such-model", "no such model repo"),
    (BIN_ONLY, "neither *.safetensors nor *.gguf weights (it has pytorch_model.bin)"),
    (GPT2, "architectures ['GPT2LMHeadModel'], model_type 'gpt2' is not supported (supported: "),
], ids=["404", "bin-only", "unsupported-architecture"])
def test_a_repo_the_engine_cannot_serve_is_refused_before_its_weights(hub, repos, tmp_path, repo, words):
    hub.clear_requests()
    done = run(hub, tmp_path, "serve", repo, "--grpc-port", "0", "--http-port", "0")
    assert done.returncode == 2 and words in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert not {f for f in fetched(hub, repo) if f.endswith((".safetensors", ".bin"))}


def test_a_full_disk_is_refused_before_downloading(hub, repos, tmp_path):
    repo = f"{ORG}/huge"
    hub.add_repo(repo, {**{p.name: p for p in repos["tiny"].iterdir() if p.name != "model.safetensors"},
                        "model-huge.safetensors": repos["tiny"] / "model.safetensors"})
    hub.claimed_size("model-huge.safetensors", 10**18)
    hub.clear_requests()
    done = run(hub, tmp_path, "download", repo)
    assert done.returncode == 2 and "needs 1000000.0 TB" in done.stderr and "free" in done.stderr, done.stderr
    assert "model-huge.safetensors" not in fetched(hub, repo)


def test_serve_by_name_equals_serve_by_path(hub, repos, tmp_path, monkeypatch):
    """`pagedserve serve ORG/NAME`: the APIs serve it as ORG/NAME, and its greedy tokens are
    those of the same files served by path (the offline LLM)."""
    import httpx
    from pagedserve import LLM, SamplingParams
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    frontend = start_serve(TINY, *TINY_FLAGS, timeout_s=COMMAND_S)
    try:
        drain(frontend.proc)
        frontend.wait_serving()
        assert frontend.info.GetModelInfo(info_pb2.GetModelInfoRequest(), timeout=5).model_name == TINY
        models = httpx.get(f"{frontend.http_url}/v1/models").json()
        assert [m["id"] for m in models["data"]] == [TINY], models
        prompts = [[5, 17, 200, 31], [400, 3, 3, 3, 90]]  # token ids: the tiny model's vocabulary is 512
        served = []
        for prompt in prompts:
            reply = httpx.post(f"{frontend.http_url}/v1/completions", json={
                "model": TINY, "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
            assert reply.status_code == 200, reply.text
            served.append(reply.json())
        frontend.wait_kv_free()
    finally:
        frontend.channel.close()
        assert stop(frontend.proc) == 0, log_tail(frontend.proc)
    llm = LLM(str(repos["tiny"]), dtype="float32", num_kv_blocks=64)
    local = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert [s["choices"][0]["text"] for s in served] == [o.outputs[0].text for o in local]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def test_a_tokenizer_and_a_lora_adapter_by_hub_id(hub, repos, tmp_path, monkeypatch):
    """In this process: --tokenizer (the engine's and a frontend's) and --lora-modules name
    Hub repos too, and only their own files are fetched."""
    from huggingface_hub import constants
    from common.tokenizer_files import check_tokenizer_dir, resolve_tokenizer_dir
    from engine.models.source import adapter_path, check_models
    hub.patch_endpoint(monkeypatch)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    adapter = f"{ORG}/tiny-lora"
    hub.add_repo(adapter, {"adapter_config.json": b'{"peft_type": "LORA", "r": 2}',
                           "adapter_model.safetensors": b"\0" * 64, "README.md": b"# lora\n"})
    hub.clear_requests()
    folder = resolve_tokenizer_dir(TINY, revision="dev")
    assert check_tokenizer_dir(TINY, folder) == folder and folder.name == repos["dev_sha"]
    assert fetched(hub, TINY) <= {f.name for f in repos["tiny"].iterdir() if not f.name.endswith(".safetensors")}
    check_models(SimpleNamespace(model=str(repos["tiny"]), tokenizer=TINY, tokenizer_revision="dev",
                                 lora_modules=[f"mine={adapter}"]))
    assert {f.name for f in adapter_path(adapter).iterdir()} == {"adapter_config.json", "adapter_model.safetensors"}
    assert fetched(hub, adapter) == {"adapter_config.json", "adapter_model.safetensors"}
