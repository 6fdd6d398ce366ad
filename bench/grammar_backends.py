"""`python -m bench.grammar_backends`: llguidance against xgrammar for structured output.

On the bundled model's tokenizer (SmolLM2-135M-Instruct, vocab 49,152), for each library:
  - compile: a cold compile of each grammar (a fresh matcher, or a fresh compiler with its
    cache off), and compile plus the first mask: llguidance builds its lexer lazily, so
    its first mask pays part of what xgrammar pays up front;
  - mask: the token bitmask filled at every step of a valid JSON document for the nested
    schema, for 1 matcher and for 8 and 32 filled one after another (per-step totals), and
    8/32 filled by the library's own parallel batch call;
  - apply: the bitmask applied to [B, 49152] float32 logits on the CPU;
  - install weight: the installed size of the library and its requirement closure as found
    on sys.path, and, given `--wheel-dir NAME=DIR` (a `pip download NAME -d DIR`), the
    downloaded wheels.
xgrammar is optional: without it (or if it fails to import) its columns say why.
Medians; prints tables and writes JSON to bench/results.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import sys
import sysconfig
import time
from pathlib import Path

from bench.reporting import machine_info, median, print_table, write_result

VOCAB = 49152  # SmolLM2's LM head rows (= its tokenizer's size)

NESTED = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 99999},
        "name": {"type": "string", "maxLength": 40},
        "status": {"enum": ["active", "inactive", "pending"]},
        "phone": {"type": "string", "pattern": r"^\d{3}-\d{4}$"},
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string", "maxLength": 60}, "city": {"type": "string"},
                           "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["street", "city", "zip"], "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 5},
        "scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 100}, "maxItems": 8},
    },
    "required": ["id", "name", "status", "address", "tags"],
    "additionalProperties": False,  # explicit: the libraries' defaults differ
}
# What the mask benchmark decodes: valid for NESTED, properties in schema order, compact.
NESTED_DOC = {"id": 4521, "name": "Ada Lovelace", "status": "active", "phone": "555-0199",
              "address": {"street": "12 Analytical Engine Row", "city": "London", "zip": "10001"},
              "tags": ["math", "computing", "poetry"], "scores": [98, 87, 100, 75]}
TOOL_CALL = {
    "type": "object",
    "properties": {
        "name": {"const": "get_weather"},
        "arguments": {"type": "object",
                      "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
                      "required": ["city", "unit"], "additionalProperties": False},
    },
    "required": ["name", "arguments"], "additionalProperties": False,
}
CHOICES = ["positive", "negative", "neutral", "mixed"]
# The same language twice: arithmetic over integers, no whitespace.
LARK = """start: expr
expr: term (("+" | "-") term)*
term: factor (("*" | "/") factor)*
factor: NUMBER | "(" expr ")"
NUMBER: /[0-9]+/
"""
EBNF = """root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= number | "(" expr ")"
number ::= [0-9]+
"""
GRAMMARS = {  # name -> (kind, value)
    "nested_json": ("json", NESTED),
    "tool_call": ("json", TOOL_CALL),
    "json_object": ("json", {"type": "object"}),
    "regex_phone": ("regex", r"\d{3}-\d{4}"),
    "regex_email": ("regex", r"[a-zA-Z0-9._%+-]+@[a-zA-Z0-9.-]+\.[a-zA-Z]{2,}"),
    "choice4": ("choice", CHOICES),
    "grammar_arith": ("grammar", (LARK, EBNF)),
}
BATCHES = (1, 8, 32)


class LLGuidance:
    name = "llguidance"

    def __init__(self, tok) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch
        self.ll, self.lt = llguidance, llguidance.torch
        start = time.perf_counter()
        self.tokenizer = llguidance.hf.from_tokenizer(tok, n_vocab=VOCAB)
        self.setup_ms = (time.perf_counter() - start) * 1e3
        self.version = importlib.metadata.version("llguidance")
        self.executor = llguidance.LLExecutor()

    def compile(self, kind: str, value):
        """The matcher at the grammar's start (what the engine's backend calls compile), and the
        seconds it took (turning a schema into grammar text is a cheap rewrite, not timed)."""
        M = self.ll.LLMatcher
        # Compact JSON, as the engine's backend configures it (xgrammar: any_whitespace=False).
        text = (M.grammar_from_json_schema(value, defaults={"whitespace_flexible": False}) if kind == "json"
                else M.grammar_from_regex(value) if kind == "regex"
                else M.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in value)) if kind == "choice"
                else M.grammar_from_lark(value[0]))
        start = time.perf_counter()
        matcher = M(self.tokenizer, text, log_level=0)
        elapsed = time.perf_counter() - start
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher, elapsed

    def matcher(self, compiled):
        return compiled.deep_copy()

    def allocate(self, batch: int):
        return self.lt.allocate_token_bitmask(batch, VOCAB)

    def fill(self, matcher, bitmask, row: int) -> None:
        self.lt.fill_next_token_bitmask(matcher, bitmask, row)

    def fill_parallel(self, matchers, bitmask) -> None:
        self.lt.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)], bitmask)

    def accept(self, matcher, token: int) -> bool:
        return matcher.consume_token(token)

    def apply(self, logits, bitmask) -> None:
        self.lt.apply_token_bitmask_inplace(logits, bitmask)  # a torch.compile'd kernel


class XGrammar:
    name = "xgrammar"

    def __init__(self, tok) -> None:
        import xgrammar
        self.xg = xgrammar
        start = time.perf_counter()
        self.info = xgrammar.TokenizerInfo.from_huggingface(tok, vocab_size=VOCAB)
        self.setup_ms = (time.perf_counter() - start) * 1e3
        self.version = importlib.metadata.version("xgrammar")
        self.batch = xgrammar.BatchGrammarMatcher()

    def compile(self, kind: str, value):
        # Cold: a new compiler with its cache off (the one built here is not timed: once per process).
        compiler = self.xg.GrammarCompiler(self.info, cache_enabled=False)
        start = time.perf_counter()
        compiled = (compiler.compile_json_schema(value, any_whitespace=False, separators=(",", ":"))
                    if kind == "json"
                    else compiler.compile_regex(value) if kind == "regex"
                    else compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in value))
                    if kind == "choice" else compiler.compile_grammar(value[1]))
        return compiled, time.perf_counter() - start

    def matcher(self, compiled):
        return self.xg.GrammarMatcher(compiled)

    def allocate(self, batch: int):
        return self.xg.allocate_token_bitmask(batch, VOCAB)

    def fill(self, matcher, bitmask, row: int) -> None:
        matcher.fill_next_token_bitmask(bitmask, row)

    def fill_parallel(self, matchers, bitmask) -> None:
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def accept(self, matcher, token: int) -> bool:
        return matcher.accept_token(token)

    def apply(self, logits, bitmask) -> None:
        self.xg.apply_token_bitmask_inplace(logits, bitmask)


def compile_times(lib, repeats: int) -> dict:
    """Per grammar: median cold compile ms, and compile + first mask ms."""
    out = {}
    bitmask = lib.allocate(1)
    for name, (kind, value) in GRAMMARS.items():
        compile_s, first_s = [], []
        for _ in range(repeats):
            compiled, elapsed = lib.compile(kind, value)
            start = time.perf_counter()
            lib.fill(lib.matcher(compiled), bitmask, 0)
            compile_s.append(elapsed)
            first_s.append(elapsed + time.perf_counter() - start)
        out[name] = {"compile_ms": round(median(compile_s) * 1e3, 3),
                     "first_mask_ms": round(median(first_s) * 1e3, 3)}
    return out


def mask_times(lib, tokens: list[int], repeats: int) -> dict:
    """Fill every row's mask at each step of `tokens` (then EOS), `repeats` passes pooled."""
    import numpy as np
    compiled, _ = lib.compile("json", NESTED)
    out = {}
    for batch in BATCHES:
        modes = ["sequential"] + (["parallel"] if batch > 1 else [])
        for mode in modes:
            bitmask, passes, allowed = lib.allocate(batch), [], []
            for pass_no in range(repeats + 1):  # pass 0 warms up caches, and is dropped
                matchers = [lib.matcher(compiled) for _ in range(batch)]
                pass_steps = []
                for token in tokens:
                    start = time.perf_counter()
                    if mode == "parallel":
                        lib.fill_parallel(matchers, bitmask)
                    else:
                        for row, m in enumerate(matchers):
                            lib.fill(m, bitmask, row)
                    pass_steps.append(time.perf_counter() - start)
                    if batch == 1 and pass_no == 0:  # allowed tokens per step: the libraries should agree
                        allowed.append(int(np.unpackbits(bitmask[0].numpy().view(np.uint8)).sum()))
                    if not all(lib.accept(m, token) for m in matchers):
                        raise RuntimeError(f"{lib.name} rejected token {token} of the valid document")
                if pass_no:
                    passes.append(pass_steps)
            us = sorted(s * 1e6 for p in passes for s in p)
            row = {"batch": batch, "mode": mode, "steps": len(tokens), "step_median_us": round(median(us), 1),
                   "step_mean_us": round(sum(us) / len(us), 1),  # the tail dominates a document's total
                   "step_p99_us": round(us[min(len(us) - 1, int(0.99 * len(us)))], 1),
                   "per_matcher_median_us": round(median(us) / batch, 1)}
            if allowed:  # where the time goes: a few steps (bounded strings) cost 10-1000x the rest
                row["allowed_tokens_per_step"] = allowed
                row["median_us_per_step"] = [round(median(col) * 1e6, 1) for col in zip(*passes)]
            out[f"{batch}-{mode}"] = row
    return out


def apply_times(lib, repeats: int) -> dict:
    """Median µs to apply a sparse mask (a regex's first step: digit tokens) to [B, VOCAB] logits."""
    import torch
    compiled, _ = lib.compile("regex", r"\d{3}-\d{4}")
    out = {}
    for batch in BATCHES:
        bitmask = lib.allocate(batch)
        for row in range(batch):
            lib.fill(lib.matcher(compiled), bitmask, row)
        logits = torch.randn(batch, VOCAB)
        start = time.perf_counter()
        lib.apply(logits, bitmask)  # llguidance: the first call compiles its kernel
        warmup = time.perf_counter() - start
        times = []
        for _ in range(max(20, repeats * 10)):
            logits.normal_()  # fresh logits: applying a mask to -inf rows would be a different cost
            start = time.perf_counter()
            lib.apply(logits, bitmask)
            times.append(time.perf_counter() - start)
        out[str(batch)] = {"median_us": round(median(times) * 1e6, 1), "first_call_ms": round(warmup * 1e3, 1)}
    return out


def install_weight(dist_name: str, wheel_dir: str | None) -> dict:
    """Installed bytes of `dist_name` and of its requirement closure on sys.path (extras left
    out); `base_venv` marks what the project's environment already has."""
    from packaging.requirements import Requirement
    purelib = Path(sysconfig.get_paths()["purelib"]).resolve()
    seen, todo, rows = set(), [dist_name], []
    while todo:
        name = todo.pop().lower().replace("_", "-")
        if name in seen:
            continue
        seen.add(name)
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            rows.append({"name": name, "missing": True})
            continue
        size = sum(f.size or 0 for f in dist.files or [])
        where = Path(str(dist.locate_file(""))).resolve()
        rows.append({"name": name, "version": dist.version, "bytes": size, "location": str(where),
                     "base_venv": where == purelib})
        for spec in dist.requires or []:
            req = Requirement(spec)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    out = {"installed_bytes": rows[0].get("bytes"), "closure_bytes": sum(r.get("bytes", 0) for r in rows),
           "closure_outside_venv_bytes": sum(r.get("bytes", 0) for r in rows if not r.get("base_venv", True)),
           "closure": sorted(rows, key=lambda r: -r.get("bytes", 0))}
    if wheel_dir:
        wheels = sorted(Path(wheel_dir).glob("*.whl"), key=lambda p: -p.stat().st_size)
        own = [w for w in wheels if w.name.lower().startswith(dist_name.replace("-", "_") + "-")]
        out["wheels"] = {"dir": wheel_dir, "count": len(wheels), "total_bytes": sum(w.stat().st_size for w in wheels),
                         "own_bytes": sum(w.stat().st_size for w in own),
                         "files": {w.name: w.stat().st_size for w in wheels}}
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--repeats", type=int, default=7, help="compiles per grammar, and mask passes (median)")
    # One thread: filling a mask is single-threaded in both libraries, and applying one is a small
    # op that more torch threads only slow down on a shared machine (OpenMP spin-waits).
    p.add_argument("--threads", type=int, default=1, help="torch threads (default: 1)")
    p.add_argument("--model", default=None, help="model whose tokenizer to use (default: the bundled SmolLM2)")
    p.add_argument("--wheel-dir", action="append", default=[], metavar="NAME=DIR",
                   help="a `pip download NAME -d DIR` folder, to report download sizes (repeatable)")
    p.add_argument("--output-dir", default=None, help="where to write JSON (default: bench/results)")


def run(args: argparse.Namespace) -> int:
    import torch
    torch.set_num_threads(args.threads)
    from engine.models.loader import eos_token_ids, load_tokenizer
    from engine.models.source import model_files
    tok = load_tokenizer(model_files(args))
    doc = json.dumps(NESTED_DOC, separators=(",", ":"))
    tokens = tok.encode(doc, add_special_tokens=False) + list(eos_token_ids(tok))
    wheel_dirs = dict(w.split("=", 1) for w in args.wheel_dir)
    results = {}
    for cls, dist in ((LLGuidance, "llguidance"), (XGrammar, "xgrammar")):
        try:
            lib = cls(tok)
        except Exception as e:  # an ImportError, or a broken install (triton, tvm-ffi)
            results[cls.name] = {"error": f"not installed: {type(e).__name__}: {e}"}
            continue
        print(f"{cls.name} {lib.version}: compiling, masking, applying", file=sys.stderr)
        results[cls.name] = {"version": lib.version, "tokenizer_setup_ms": round(lib.setup_ms, 1),
                             "compile": compile_times(lib, args.repeats), "mask": mask_times(lib, tokens, args.repeats),
                             "apply": apply_times(lib, args.repeats),
                             "install": install_weight(dist, wheel_dirs.get(dist))}
    report(results)
    path = write_result("grammar-backends", {
        "machine": machine_info("cpu"), "vocab": VOCAB, "repeats": args.repeats, "threads": args.threads,
        "document": doc, "document_tokens": len(tokens), "grammars": GRAMMARS, "results": results,
    }, args.output_dir)
    print(f"\nwrote {path}")
    return 0


def report(results: dict) -> None:
    libs = [name for name, r in results.items() if "error" not in r]
    for name, r in results.items():
        if "error" in r:
            print(f"{name}: {r['error']}")
    if not libs:
        return
    print("\ncompile (ms, median; cold) and compile + first mask (ms)")
    print_table(["grammar", *[f"{n} {c}" for n in libs for c in ("compile", "+mask")]],
                [[g, *[results[n]["compile"][g][k] for n in libs for k in ("compile_ms", "first_mask_ms")]]
                 for g in GRAMMARS])
    print("\nmask fill per decode step, nested_json document (µs): the B matchers' total")
    print_table(["library", "B", "mode", "median", "p99", "mean", "median per matcher"],
                [[n, m["batch"], m["mode"], m["step_median_us"], m["step_p99_us"], m["step_mean_us"],
                  m["per_matcher_median_us"]]
                 for n in libs for m in results[n]["mask"].values()])
    print("\napply bitmask to [B, 49152] float32 logits (µs, median; first call ms)")
    print_table(["library", *[f"B={b}" for b in BATCHES], *[f"first B={b}" for b in BATCHES]],
                [[n, *[results[n]["apply"][str(b)]["median_us"] for b in BATCHES],
                  *[results[n]["apply"][str(b)]["first_call_ms"] for b in BATCHES]] for n in libs])
    mb = 1 / 2**20
    print("\ninstall weight (MiB): the library, its closure on this path, and the part outside the venv")
    print_table(["library", "installed", "closure", "outside venv", "wheel", "wheels (closure)", "n wheels"],
                [[n, (i := results[n]["install"])["installed_bytes"] * mb, i["closure_bytes"] * mb,
                  i["closure_outside_venv_bytes"] * mb, i["wheels"]["own_bytes"] * mb if "wheels" in i else "-",
                  i["wheels"]["total_bytes"] * mb if "wheels" in i else "-",
                  i["wheels"]["count"] if "wheels" in i else "-"] for n in libs])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
