"""The committed peer comparison: pagedserve against llama.cpp's llama-server on the same CPU.

    python -m bench.compare_peers --llama-server $(../shared/tools/build-llama-server.sh | tail -1)

On the bundled GGUF (or --model; `--model gemma3`: the packaged Gemma 3 270M), random prompts of --input-len tokens asking for exactly
--output-len tokens, each peer at every --concurrency (`bench serve --max-concurrency`):

- pagedserve-grpc: `bench serve --backend pagedserve`, which starts `pagedserve serve` itself.
- pagedserve-http: `pagedserve serve --grpc-port 0 --http-port PORT`, started here and driven
  by `bench serve --backend openai` (its OpenAI API).
- llama-server: `llama-server -t T -np SLOTS -c SLOTS*CTX`, started here, driven the same way.

One server at a time, each with --threads threads, and every run is a plain `bench serve`
that writes its own JSON into --output-dir, named by its label (`<peer>-c<concurrency>`).
With --offline, first the offline side: `pagedserve bench offline` (the engine in process:
all prompts at once, and one request's decode rate) against `llama-bench` (found next to
llama-server: prompt processing and one sequence's generation, tok/s).
Then a table of output tok/s and TTFT and TPOT (median, p99), saved as compare-peers-*.json
with the machine and its CPU flags and load average, and a PNG of the same.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from bench.reporting import RESULTS_DIR, machine_info, name_plot, print_table, write_result
from bench.servers import SERVER_START_TIMEOUT_S, SERVER_STOP_TIMEOUT_S, free_port, server_for

PEERS = ("pagedserve-grpc", "pagedserve-http", "llama-server")
METRICS = ("output_tok_s", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--llama-server", type=Path, default=os.environ.get("LLAMA_SERVER"),
                   help="the llama-server binary (default: $LLAMA_SERVER); "
                        "../shared/tools/build-llama-server.sh prints its path")
    p.add_argument("--peers", default=",".join(PEERS), help=f"a comma list of {', '.join(PEERS)} (default: all)")
    p.add_argument("--concurrency", default="1,32", help="a comma list of --max-concurrency values (default: 1,32)")
    p.add_argument("--num-prompts", type=int, default=None,
                   help="requests per run (default: 4 x the concurrency, at least 16)")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens (default: 128)")
    p.add_argument("--output-len", type=int, default=128, help="output tokens (default: 128)")
    p.add_argument("--threads", type=int, default=2, help="CPU threads of every server (default: 2)")
    p.add_argument("--slots", type=int, default=32, help="llama-server -np (default: 32)")
    p.add_argument("--ctx-per-slot", type=int, default=512,
                   help="llama-server context per slot; -c is slots x this (default: 512)")
    p.add_argument("--dtype", default="auto", help="pagedserve --dtype (default: auto)")
    p.add_argument("--cpu-arithmetic", default="auto", choices=["auto", "int8"],
                   help="pagedserve --cpu-arithmetic (default: auto)")
    p.add_argument("--model", default=None, help="a .gguf file, or gemma3 for the packaged Gemma 3 270M Q4_K_M "
                                                 "(default: the bundled SmolLM2-135M-Instruct)")
    p.add_argument("--offline", action="store_true",
                   help="also compare offline: `pagedserve bench offline` (with a pagedserve peer) and "
                        "llama-bench (with llama-server)")
    p.add_argument("--seed", type=int, default=0,
                   help="bench serve --seed of the first concurrency, +1 for each next (default: 0)")
    p.add_argument("--output-dir", type=Path, default=RESULTS_DIR, help="where every JSON and the PNG go")


def run(args: argparse.Namespace) -> int:
    from engine.models.loader import is_gguf
    from engine.models.source import model_files
    peers = [p.strip() for p in args.peers.split(",") if p.strip()]
    if not peers or set(peers) - set(PEERS):
        raise SystemExit(f"--peers: a comma list of {', '.join(PEERS)}, got {args.peers!r}")
    try:
        levels = [int(c) for c in args.concurrency.split(",")]
    except ValueError:
        levels = []
    if not levels or min(levels) < 1:
        raise SystemExit(f"--concurrency: a comma list of positive integers, got {args.concurrency!r}")
    if "llama-server" in peers and not (args.llama_server and args.llama_server.is_file()):
        raise SystemExit("llama-server: give its binary with --llama-server or $LLAMA_SERVER "
                         "(../shared/tools/build-llama-server.sh builds it and prints the path)")
    if args.model == "gemma3":
        from engine.models.source import gemma3_model_path
        args.model = str(gemma3_model_path())
    gguf = model_files(args)
    if not is_gguf(gguf):
        raise SystemExit(f"--model {gguf}: llama-server needs a .gguf file")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))  # stop the servers too
    args.loadavg_before = os.getloadavg()  # the machine may be shared: say how busy it was
    args.offline_results = _offline(args, gguf) if args.offline else None
    rows = []
    for peer in peers:
        with serving(peer, args, gguf) as (target, command):
            # Seed per level: a server kept between levels must not find the last level's prompts cached.
            rows += [run_bench(peer, target, command, c, args.seed + i, args, gguf) for i, c in enumerate(levels)]
    _report(rows, args, gguf, peers)
    return 0 if all(r.get("failed") == 0 for r in rows) else 1


@contextlib.contextmanager
def serving(peer: str, args: argparse.Namespace, gguf: Path) -> Iterator[tuple[str | None, list[str] | None]]:
    """(the peer's OpenAI base URL, its server's command) while the server runs; (None, None)
    for pagedserve-grpc, which `bench serve` starts itself."""
    if peer == "pagedserve-grpc":
        yield None, None
        return
    port = free_port()
    url = f"http://127.0.0.1:{port}/v1"
    if peer == "pagedserve-http":
        from engine.config import EngineConfig
        # Another form of the same weights where the peers read different files (bench/gpt_oss_peers.py).
        model = getattr(args, "pagedserve_model", None) or gguf
        config = EngineConfig(model=str(model), dtype=args.dtype, num_threads=args.threads,
                              cpu_arithmetic=args.cpu_arithmetic)
        server = server_for("pagedserve", config, max_concurrent_streams=256)
        server.cmd += ["--http-port", str(port)]  # the last --http-port wins
        print(f"starting {' '.join(server.cmd[1:])}", flush=True)
        server.start()  # returns once gRPC reports SERVING: the engine is up
        try:
            _wait_http(url, server.proc, lambda: "".join(server.tail))
            yield url, server.cmd[1:]
        finally:
            server.stop()
        return
    cmd = [str(args.llama_server), "-m", str(gguf), "-t", str(args.threads), "-np", str(args.slots),
           "-c", str(args.slots * args.ctx_per_slot), "--host", "127.0.0.1", "--port", str(port)]
    with tempfile.TemporaryFile("w+") as log:
        print(f"starting {' '.join(cmd)}", flush=True)
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            _wait_http(url, proc, lambda: _tail(log))
            yield url, cmd
        finally:
            _stop(proc)


def _wait_http(url: str, proc: subprocess.Popen, tail) -> None:
    """Until GET {url}/models answers 200 (llama-server answers 503 while it loads)."""
    deadline = time.monotonic() + SERVER_START_TIMEOUT_S
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"{url}/models", timeout=5, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass  # not listening yet
        time.sleep(0.5)
    _stop(proc)
    raise RuntimeError(f"{url}/models never answered 200; the server's last output:\n{tail()}")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(SERVER_STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _tail(log, num_lines: int = 40) -> str:
    log.flush()
    log.seek(0)
    return "".join(log.readlines()[-num_lines:])


def run_bench(peer: str, target: str | None, command: list[str] | None, concurrency: int, seed: int,
           args: argparse.Namespace, gguf: Path) -> dict:
    """One `bench serve` run; its JSON's numbers."""
    label = f"{peer}-c{concurrency}"
    num_prompts = args.num_prompts or max(16, 4 * concurrency)
    cmd = [sys.executable, "-m", "pagedserve", "bench", "serve", "--label", label, "--model", str(gguf),
           "--max-concurrency", str(concurrency), "--num-prompts", str(num_prompts),
           "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
           "--seed", str(seed), "--output-dir", str(args.output_dir)]
    if target is None:
        cmd += ["--backend", "pagedserve", "--num-threads", str(args.threads), "--dtype", args.dtype,
                "--cpu-arithmetic", args.cpu_arithmetic]
    else:
        cmd += ["--backend", "openai", "--target", target]
    print(f"\n== {label}: {' '.join(cmd[1:])}", flush=True)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    written = None
    for line in proc.stdout:
        print(line, end="", flush=True)
        match = re.match(r"wrote (\S+\.json)$", line.strip())
        written = Path(match.group(1)) if match else written
    proc.wait()
    row = {"peer": peer, "concurrency": concurrency, "num_prompts": num_prompts, "seed": seed,
           "returncode": proc.returncode}
    if written is None:
        return {**row, "error": "bench serve wrote no JSON"}
    payload = json.loads(written.read_text())
    summary = payload["results"][payload["api"]]
    return {**row, "file": written.name, "server_command": command or payload["server_command"],
            "model": payload["model"]["model_name"], "completed": summary["completed"],
            "failed": summary["failed"], "output_tokens": summary["output_tokens"],
            "expected_output_tokens": summary["expected_output_tokens"], **{k: summary[k] for k in METRICS}}


def _report(rows: list[dict], args: argparse.Namespace, gguf: Path, peers: list[str]) -> None:
    from bench.plots import plot_peers
    print()
    print_table(["peer", "concurrency", "ok / failed", "out tok/s", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99"],
                [[r["peer"], r["concurrency"], f"{r.get('completed', 0)} / {r.get('failed', 'n/a')}",
                  *(r.get(k, "n/a") for k in METRICS)] for r in rows])
    print("(latencies in ms)")
    machine = machine_info()
    payload = {"machine": machine, "model": str(gguf), "input_len": args.input_len, "output_len": args.output_len,
               "threads": args.threads, "dtype": args.dtype, "cpu_arithmetic": args.cpu_arithmetic,
               "llama_server": _llama_server_info(args) if "llama-server" in peers else None,
               "loadavg_before": args.loadavg_before, "loadavg_after": os.getloadavg(),
               "offline": args.offline_results, "runs": rows}
    path = write_result("compare-peers", payload, args.output_dir)
    title = (f"{gguf.name}: {args.input_len} in / {args.output_len} out random tokens, {args.threads} threads "
             f"each\n{machine['cpu']} ({' '.join(machine['cpu_flags'])})")
    chart = plot_peers([r for r in rows if "output_tok_s" in r], title, path.with_suffix(".png"))
    name_plot(path, chart)
    print(f"\nwrote {path} and {chart.name}")


def _offline(args: argparse.Namespace, gguf: Path) -> dict:
    """pagedserve's offline bench (when a pagedserve peer is chosen) and llama-bench (when
    llama-server is) on the same GGUF, workload and threads."""
    num_prompts, result = args.num_prompts or 16, {}
    if any(p.startswith("pagedserve") for p in args.peers.split(",")):
        result["pagedserve"] = _offline_pagedserve(args, gguf, num_prompts)
    bench = args.llama_server.parent / "llama-bench" if args.llama_server else None
    if "llama-server" in args.peers and bench and bench.is_file():
        cmd = [str(bench), "-m", str(gguf), "-t", str(args.threads), "-p", str(args.input_len),
               "-n", str(args.output_len), "-r", "2", "-o", "json"]
        print(f"== offline: {' '.join(cmd)}", flush=True)
        out = subprocess.run(cmd, capture_output=True, text=True)
        try:
            tests = json.loads(out.stdout)
            result["llama-bench"] = {("prompt_tok_s" if t["n_prompt"] else "single_decode_tok_s"): t["avg_ts"]
                                     for t in tests}
        except (json.JSONDecodeError, KeyError, TypeError):
            result["llama-bench"] = {"error": (out.stdout + out.stderr)[-500:]}
    print(json.dumps(result, indent=1), flush=True)
    return result


def _offline_pagedserve(args: argparse.Namespace, gguf: Path, num_prompts: int) -> dict:
    cmd = [sys.executable, "-m", "pagedserve", "bench", "offline", "--model", str(gguf), "--dtype", args.dtype,
           "--cpu-arithmetic", args.cpu_arithmetic,
           "--num-threads", str(args.threads), "--num-prompts", str(num_prompts), "--input-len",
           str(args.input_len), "--output-len", str(args.output_len), "--repeats", "1", "--single-repeats", "2",
           "--output-dir", str(args.output_dir)]
    print(f"\n== offline: {' '.join(cmd[1:])}", flush=True)
    out = subprocess.run(cmd, capture_output=True, text=True)
    print(out.stdout[-2000:], out.stderr[-2000:], flush=True)
    written = re.search(r"wrote (\S+\.json)", out.stdout)
    ours = json.loads(Path(written.group(1)).read_text())["results"] if written else {"error": out.stderr[-500:]}
    return {"file": Path(written.group(1)).name if written else None,
            "batch_output_tok_s": ours.get("engine_batch", {}).get("output_tok_s"),
            "single_decode_tok_s": ours.get("engine_single", {}).get("decode_tok_s"), "num_prompts": num_prompts}


def _llama_server_info(args: argparse.Namespace) -> dict:
    version = subprocess.run([str(args.llama_server), "--version"], capture_output=True, text=True, timeout=30)
    lines = (version.stdout + version.stderr).strip().splitlines()
    return {"version": next((line for line in lines if line.startswith("version")), lines[-1] if lines else ""),
            "slots": args.slots, "ctx_per_slot": args.ctx_per_slot}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.compare_peers", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
