# moeprep: every target that needs Python depends on `setup`, which builds .venv/ once.
# Holds no logic: it calls pip, pytest and the CLI.

PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
MODEL ?= reference
MODEL_PATH ?=
DEVICE ?= cpu
BIN := $(VENV)/bin

.PHONY: setup test prepare eval bench reference-model reference-metrics lint

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/pip install --quiet -e ".[dev]"
	touch $@

test: setup
	$(BIN)/pytest -q -m "not gpu"

prepare: setup
	$(BIN)/moeprep prepare --recipe recipes/$(MODEL).yaml --device $(DEVICE) $(if $(MODEL_PATH),--set model.path=$(MODEL_PATH))

eval: setup
	$(BIN)/moeprep eval --artifact artifacts/$(MODEL)/artifact

bench: setup
	$(BIN)/moeprep bench --device $(DEVICE)

reference-model: setup
	$(BIN)/moeprep reference-model --out recipes/reference

reference-metrics: setup
	$(BIN)/moeprep reference-metrics --dir recipes/reference

lint: setup
	$(BIN)/ruff check prep loader tests
