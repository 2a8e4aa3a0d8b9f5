# moeprep: every target that needs Python depends on `setup`, which builds .venv/ once.
# Holds no logic: it calls pip, pytest and the CLI.

PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
MODEL ?= reference
MODEL_PATH ?=
DEVICE ?= cpu
BIN := $(VENV)/bin

GPU_PYTHON ?= python3
GPU_PY ?= 3.12
TRACES ?= ../shared/data/traces
HOW_FAST ?= artifacts/how-fast

.PHONY: setup test test-full test-times prepare eval accuracy bench how-fast reference-model reference-metrics lint loc gpu-carry gpu-check

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/pip install --quiet -e ".[dev,ray]"
	$(BIN)/python -m loader.kernels
	touch $@

# The suite in two parts (tests/helpers/suite.py): the tests in parallel on TEST_WORKERS workers, then the
# `alone` ones (they measure memory or time) one at a time; every test's and fixture's time, and a summary that
# flags slow tests, under TEST_TIMES/. `make test-full` adds the full-size checks marked `full`.
TEST_WORKERS ?= 2
TEST_TIMES ?= test-times

# The compiled expert kernels (loader/kernels) are built before the tests, so no test writes into the repository.
test: setup
	$(BIN)/python -m loader.kernels -q
	$(BIN)/python -m tests.helpers.suite --workers $(TEST_WORKERS) --times $(TEST_TIMES)

test-full: setup
	$(BIN)/python -m loader.kernels -q
	$(BIN)/python -m tests.helpers.suite --workers $(TEST_WORKERS) --times $(TEST_TIMES) --full

# The summary of the last `make test` again (the 30 slowest tests, time per file and per fixture, what is flagged).
test-times:
	$(BIN)/python -m tests.helpers.timing $(TEST_TIMES)/parallel $(TEST_TIMES)/alone

prepare: setup
	$(BIN)/moeprep prepare --recipe recipes/$(MODEL).yaml --device $(DEVICE) $(if $(MODEL_PATH),--set model.path=$(MODEL_PATH))

eval: setup
	$(BIN)/moeprep eval --artifact artifacts/$(MODEL)/artifact

# The shipped artifact's accuracy resolved to one point (after `make prepare`): accuracy.md under artifacts/$(MODEL)/accuracy.
accuracy: setup
	$(BIN)/moeprep accuracy --artifact artifacts/$(MODEL)/artifact

bench: setup
	$(BIN)/moeprep bench --device $(DEVICE)

# README's "How fast": the bench's headline rows, then that block (it says how long the bench took) and docs/bench.png.
how-fast: setup
	$(BIN)/moeprep bench --subject mixtral-shape,mixtral-shape-own --budgets 100%,25%,4bit-25% --repeats 2 --systems resident,accelerate,moeprep,llama.cpp --traces $(TRACES) --output $(HOW_FAST)
	$(BIN)/python -m prep.studies.bench.readme --bench $(HOW_FAST) --readme README.md

reference-model: setup
	$(BIN)/moeprep reference-model --out recipes/reference

reference-metrics: setup
	$(BIN)/moeprep reference-metrics --dir recipes/reference

lint: setup
	$(BIN)/ruff check prep loader tests

# The house's measures: the loader's code lines per file, functions over 80 lines, wide constructors.
loc: setup
	$(BIN)/python -m prep.studies.house

# Before a GPU run, on this machine: the wheels and traces a GPU machine without network lacks, into .gpu/.
gpu-carry: setup
	mkdir -p .gpu/whl .gpu/traces
	$(BIN)/pip wheel --quiet --no-deps -w .gpu/whl hqq==0.2.8.post1 termcolor
	$(BIN)/pip download --quiet --only-binary=:all: --no-deps --python-version $(GPU_PY) --platform manylinux_2_17_x86_64 -d .gpu/whl xxhash
	cp -r $(TRACES)/mixtral-8x7b .gpu/traces/

# On the GPU machine: its own python3 and the carried wheels, no setup (prep/studies/bench/gpu_check.py).
gpu-check:
	$(GPU_PYTHON) -m prep.studies.bench.gpu_check $(if $(OUT),--out $(OUT))
