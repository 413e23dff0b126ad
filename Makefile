# Two commands for a fresh machine: `make demo` (the main job) and `make test`.
# `make test` runs the CPU suite twice: on the jax floor (PYTHON, Python 3.11, jax pinned by .ci/jax-floor.txt,
# in VENV) and on the newest jax that pyproject allows (PYTHON_NEW, Python 3.12, in VENV_NEW).
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PYTHON_NEW ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.12.*/bin/python) python3.12)
VENV_NEW ?= .venv-newest
PY_NEW := $(VENV_NEW)/bin/python
# --dist worksteal: an idle worker takes half of the other's queue, so the long tests (started first by
# tests/conftest.py) leave no worker idle at the end.
# --case-split (tests/conftest.py): the two legs share out each parametrized test's cases, the floor leg the even
# ones and the newest leg the odd ones, so every case runs on one jax version and every test on both (the sharded
# ops and optimizers come in two halves of their cases, each half one subprocess). Unparametrized tests, the longest
# among them the 2-process run of the example, run on both, so the two legs take about 80% of two full legs' time
# (cold, on 2 cores: 656 + 444 s against 797 + 590 s, measured before the sharding halves).
# `make test-floor PYTEST_ARGS=...` without it runs every case on one version.
# --durations: each leg ends with its slowest tests, what to look at first when the suite grows.
PYTEST_ARGS ?= -q -n 2 --dist worksteal -m "not gpu" --case-split 0/2 --durations=15 tests
# The newest leg exists to catch jax-version differences (interpret-mode kernels, _backend/_sharding API moves,
# jax.distributed) and leaves out `slow`, the tests that repeat one of its checks at a larger scale: the 4-process run
# of the example (the 2-process test exercises every jax-version-dependent path of the multi-process code), the example
# on 2 simulated devices (the 2-process test runs it on the same meshes, data=2 and fsdp=2), the 40-step example run,
# its --compare run and its int8 QDoRA fine-tune (the 2-process test runs the same pipeline for a few steps, the nf4
# QDoRA test the quantized model and checkpoint; the baseline's optax / flax parts are pure jax), the multi-GPU
# launcher's run on CPU processes (plain Python over the example on jax.distributed, which the 2-process test runs), the
# random-shape fuzz of every kernel (the unit tests cover each shape class), GaLore's and the FP8 recipes' 300-step
# trainings and rotary at 2^24 positions (their unit tests on both legs), and the third-party models whose path another
# test's model takes on both legs (adapt's larger zoo architectures, HF's GPT-2 and Llama under adapt and the loss: the
# zoo's other architectures and our own models run on both).
PYTEST_NEW_ARGS ?= -q -n 2 --dist worksteal -m "not gpu and not slow" --case-split 1/2 --durations=15 tests
# jax's persistent compilation cache, shared by the two workers and the tests' subprocesses: the same programs
# (interpret-mode kernels at the same shapes, the example's steps) compile once per leg, ~7% of a cold run's time.
# Keyed by the program, the compile options and jax's version, so a changed kernel or another jax compiles anew.
JAX_CACHE ?= $(CURDIR)/.jax-cache
TEST_ENV = JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0.2 JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=0
OUT ?= $(CURDIR)/runs/gpu-check
BENCH ?=

.PHONY: setup demo test test-floor test-newest lint typecheck docs perf-docs perf-docs-check package-check plots gpu-check bench clean

$(VENV)/.installed: pyproject.toml .ci/jax-floor.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c .ci/jax-floor.txt -e '.[test,bench,examples,docs]'
	touch $@

$(VENV_NEW)/.installed: pyproject.toml
	$(PYTHON_NEW) -m venv $(VENV_NEW)
	$(PY_NEW) -m pip install -q --upgrade pip
	$(PY_NEW) -m pip install -q -e '.[test,bench]'
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(PY) examples/train_llama.py $(DEMO_ARGS)

lint: setup
	$(PY) -m ruff check .

test: lint typecheck perf-docs-check docs package-check test-floor test-newest

# mypy on the public modules (the files and settings are in pyproject's [tool.mypy]).
typecheck: setup
	$(PY) -m mypy

# The user guide and API reference (mkdocs.yml), warnings as errors; the site goes to site/.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --quiet

# The measured tables of docs/performance.md, written from benchmarks/results/<device>.json
# (benchmarks/perf_docs.py); the check fails, with a diff, where a table no longer matches the JSON. No GPU.
perf-docs: setup
	$(PY) -m benchmarks.perf_docs

perf-docs-check: setup
	$(PY) -m benchmarks.perf_docs --check

# What a user gets from `pip install`: the wheel built from this tree, installed with its runtime
# dependencies into a fresh venv, imported from outside the tree, one op run on the CPU, then every python
# block of the README run from the installed wheel.
PKG_DIR ?= $(CURDIR)/.package-check
package-check: setup
	rm -rf $(PKG_DIR) && mkdir -p $(PKG_DIR)
	$(PY) -m pip wheel -q --no-deps -w $(PKG_DIR) .
	rm -rf build  # setuptools' staging directory, not part of the tree
	$(PYTHON) -m venv $(PKG_DIR)/venv
	$(PKG_DIR)/venv/bin/python -m pip install -q -c .ci/jax-floor.txt $(PKG_DIR)/pallas_fused-*.whl
	cd $(PKG_DIR) && venv/bin/python $(CURDIR)/.ci/wheel_smoke.py $(CURDIR)/README.md

# The README's pictures, from the committed results: ours vs peers (ratios) and the example's loss curves.
plots: setup
	$(PY) -m benchmarks.plots

test-floor: setup
	$(PY) -c 'import jax, sys; print("floor leg: Python", sys.version.split()[0], "jax", jax.__version__)'
	$(TEST_ENV) JAX_COMPILATION_CACHE_DIR=$(JAX_CACHE)/floor $(PY) -m pytest $(PYTEST_ARGS)

test-newest: $(VENV_NEW)/.installed
	$(PY_NEW) -c 'import jax, sys; print("newest leg: Python", sys.version.split()[0], "jax", jax.__version__)'
	$(TEST_ENV) JAX_COMPILATION_CACHE_DIR=$(JAX_CACHE)/newest $(PY_NEW) -m pytest $(PYTEST_NEW_ARGS)

# On the GPU device: jax 0.11.2 is preinstalled and there is no network, so nothing is installed;
# the package is put on the path. Logs and results go under $(OUT).
gpu-check:
	mkdir -p $(OUT)
	set -o pipefail; PYTHONPATH=$(CURDIR) XLA_PYTHON_CLIENT_PREALLOCATE=false $(PYTHON) -m pytest -q -m gpu tests 2>&1 | tee $(OUT)/gpu_tests.log; \
	PYTHONPATH=$(CURDIR) XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 $(PYTHON) -m benchmarks.run $(BENCH) --out $(OUT) 2>&1 | tee $(OUT)/bench.log

bench:
	PYTHONPATH=$(CURDIR) $(PYTHON) -m benchmarks.run $(BENCH)

clean:
	rm -rf $(VENV) $(VENV_NEW) .pytest_cache .ruff_cache .hypothesis .mypy_cache .package-check site build .jax-cache
