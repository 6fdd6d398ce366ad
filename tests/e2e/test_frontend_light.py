"""The frontend process never imports torch or the engine's model code: it gets the tokenizer
from the engine's handshake and loads it with the `tokenizers` library.

The proof: run the real `pagedserve frontend` through runpy with an atexit hook that writes
its sys.modules, serve a text and a chat request, stop it with SIGTERM (it drains and exits
0, so the hook runs), then read the list."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from grpc_client import generate, greedy, user

ROOT = Path(__file__).resolve().parents[2]
# argv: the output file, then the `pagedserve` arguments.
RECORD_MODULES = (
    "import atexit, json, runpy, sys; out = sys.argv[1]; "
    "atexit.register(lambda: open(out, 'w').write(json.dumps(sorted(sys.modules)))); "
    "sys.argv = ['pagedserve', *sys.argv[2:]]; "
    "runpy.run_module('pagedserve', run_name='__main__', alter_sys=True)")
HEAVY = ("torch", "engine.models", "engine.model_runner")


def test_frontend_serves_without_torch(engine_address, procs, tmp_path):
    modules_file = tmp_path / "frontend-modules.json"
    proc = subprocess.Popen(
        [sys.executable, "-c", RECORD_MODULES, str(modules_file), "frontend", "--engine-address", engine_address,
         "--grpc-port", "0"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    fe = procs.Frontend(proc, procs.read_grpc_address(proc))
    try:
        fe.wait_serving()
        text = generate(fe, text="The capital of France is", sampling=greedy(8, ignore_eos=True))
        chat = generate(fe, chat=user("Say hello."), sampling=greedy(4, ignore_eos=True))
        assert len(text.tokens[0]) == 8 and text.texts[0].strip()
        assert len(chat.tokens[0]) == 4 and chat.started.prompt_tokens > 10  # the template ran
    finally:
        fe.channel.close()
        code = procs.stop(proc, signal.SIGTERM)
    assert code == 0, procs.log_tail(proc)
    modules = set(json.loads(modules_file.read_text()))
    assert {"frontend.server", "frontend.tokenizer", "tokenizers", "grpc"} <= modules  # the hook saw the server
    loaded = sorted(m for m in modules if any(m == h or m.startswith(h + ".") for h in HEAVY))
    assert loaded == [], f"the frontend imported {loaded}"
