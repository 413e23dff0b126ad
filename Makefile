# Two commands for a fresh machine: `make demo` (the main job) and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
OUT ?= $(CURDIR)/runs/gpu-check
BENCH ?=

.PHONY: setup demo test lint gpu-check bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,bench]'
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(PY) examples/train_llama.py $(DEMO_ARGS)

lint: setup
	$(PY) -m ruff check .

test: lint
	$(PY) -m pytest -q -n 2 -m "not gpu" tests

# On the GPU device: jax 0.11.2 is preinstalled and there is no network, so nothing is installed;
# the package is put on the path. Logs and results go under $(OUT).
gpu-check:
	mkdir -p $(OUT)
	set -o pipefail; PYTHONPATH=$(CURDIR) XLA_PYTHON_CLIENT_PREALLOCATE=false $(PYTHON) -m pytest -q -m gpu tests 2>&1 | tee $(OUT)/gpu_tests.log; \
	PYTHONPATH=$(CURDIR) XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 $(PYTHON) -m benchmarks.run $(BENCH) --out $(OUT) 2>&1 | tee $(OUT)/bench.log

bench:
	PYTHONPATH=$(CURDIR) $(PYTHON) -m benchmarks.run $(BENCH)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
