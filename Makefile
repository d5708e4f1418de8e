# attention-int8: set-up, build, test and benchmark.
#
#   make / make run   set up, build, then (with a GPU) run the example model and the quick benchmark
#   make build        build/<variant>/attention_int8 with kernel-builder (Nix) if present, else nvcc
#   make test         set up, build, run the test suite (GPU tests skip without a GPU, each with its reason)
#   make check-abi    build, then kernel-abi-check the .so (Python 3.9 stable ABI)
#   make bench        the full benchmark (GPU)
#   make hub-bench    benchmarks/benchmark*.py through `kernels benchmark` on this build (GPU)
#   make clean        remove build/ (`make distclean` also removes the .venv)
#
# Variables: PYTHON (default: python3 when it already has CUDA torch, pytest and numpy, as on a GPU
# box without network; else .venv/bin/python, created on demand), BENCH_ARGS (e.g. "--append-results
# benchmarks/results-log.md"), CUDA_CAPABILITIES="9.0" builds a
# subset of build.toml's capabilities, MAX_JOBS caps parallel compiles, CUDA_HOME, HOST_CXX (the binding's
# compiler, default g++), NIX_ENV.

SHELL := /bin/bash
.DEFAULT_GOAL := run

SYSTEM_PYTHON ?= python3
VENV ?= .venv
ifeq ($(origin PYTHON),undefined)
  PYTHON := $(shell $(SYSTEM_PYTHON) -c 'import numpy, pytest, torch; assert torch.version.cuda' >/dev/null 2>&1 \
                    && echo $(SYSTEM_PYTHON) || echo $(VENV)/bin/python)
endif

# Nix installs its profile script here; it puts `nix` on PATH when the shell has not.
NIX_PROFILE ?= $(HOME)/.nix-profile/etc/profile.d/nix.sh
NIX_ENV ?= $(if $(wildcard $(NIX_PROFILE)),. $(NIX_PROFILE);)
HAVE_NIX := $(shell $(NIX_ENV) command -v nix >/dev/null 2>&1 && echo yes)

HAVE_GPU = $(PYTHON) -c 'import sys, torch; sys.exit(not torch.cuda.is_available())'

# The kernels command line of the interpreter's environment (.venv/bin/kernels), else the one on PATH.
KERNELS_CLI ?= $(firstword $(wildcard $(dir $(PYTHON))kernels) kernels)

.PHONY: run setup build test check-abi bench hub-bench clean distclean

run: build
	@if $(HAVE_GPU); then \
	  $(PYTHON) benchmarks/example_model.py && $(PYTHON) benchmarks/bench_attention.py --quick; \
	else \
	  echo "No CUDA GPU present: the build and import check passed; skipping the example and benchmark."; \
	fi

# Only the venv needs setting up; a given PYTHON (or the GPU box's python3) is used as is.
setup: $(if $(filter $(VENV)/bin/python,$(PYTHON)),$(VENV)/.installed)

$(VENV)/.installed: requirements-dev.txt
	$(SYSTEM_PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q -r requirements-dev.txt
	touch $@

build: setup
ifeq ($(HAVE_NIX),yes)
	$(NIX_ENV) nix run -L .#build-and-copy
	$(PYTHON) scripts/build_local.py --import-check
else
	$(PYTHON) scripts/build_local.py
endif

test: build
	$(PYTHON) -m pytest -q -rs tests

check-abi: build
	$(PYTHON) scripts/check_abi.py

bench: build
	$(PYTHON) benchmarks/bench_attention.py $(BENCH_ARGS)

hub-bench: build
	$(KERNELS_CLI) benchmark .

clean:
	rm -rf build

distclean: clean
	rm -rf $(VENV)
