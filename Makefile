# Two entry points for a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
PROMPT ?=

.PHONY: setup demo test test-deps bench faults clean

$(BIN)/ggufswarm: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# CPU PyTorch from the local wheel first (plain `torch` would pull a CUDA build).
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	touch $@

setup: $(BIN)/ggufswarm

demo: setup
	$(BIN)/ggufswarm demo $(if $(PROMPT),"$(PROMPT)",)

# The tracker's status page is checked in headless Chromium (Debian package; needs root or sudo).
test-deps:
	@command -v chromium >/dev/null 2>&1 || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq chromium >/dev/null; }

test: setup test-deps
	$(BIN)/python -m pytest -q

# Fault suite alone, with its table: 20 trials SIGKILLing a random node of a live 3-node route.
faults: setup
	$(BIN)/python -m pytest -q -s tests/test_faults.py

bench: setup
	$(BIN)/python bench/bench_generate.py

clean:
	rm -rf $(VENV) build src/*.egg-info
