# Two entry points for a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
PROMPT ?= Explain in two sentences why the sky is blue.

.PHONY: setup demo test bench clean

$(BIN)/ggufswarm: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# CPU PyTorch from the local wheel first (plain `torch` would pull a CUDA build).
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	touch $@

setup: $(BIN)/ggufswarm

demo: setup
	$(BIN)/ggufswarm demo "$(PROMPT)"

test: setup
	$(BIN)/python -m pytest -q

bench: setup
	$(BIN)/python bench/bench_generate.py

clean:
	rm -rf $(VENV) build src/*.egg-info
