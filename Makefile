# The README's commands. Every target creates .venv and installs what it needs first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
HOST ?= 127.0.0.1
PORT ?= 8765
PYTEST_ARGS ?=
# Test workers (pytest-xdist; each test file stays on one worker, the longest files first:
# tests/conftest.py). 2, the default: the end-to-end cases mostly wait on real processes and
# clocks, so two workers on two cores take about half the time of one process. 0: one process.
PYTEST_WORKERS ?= 2

.PHONY: run test lint typecheck pytest bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip setuptools wheel
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

## run: the service with its dashboard, a simulated collector and a demo job (SQLite).
run: $(STAMP)
	$(BIN)/forewarn demo --host $(HOST) --port $(PORT)

## test: lint, type check and the whole test suite.
test: lint typecheck pytest

lint: $(STAMP)
	$(BIN)/ruff check .

typecheck: $(STAMP)
	$(BIN)/mypy

pytest: $(STAMP)
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=25 $(PYTEST_ARGS)

## bench: every benchmark, each printing ratios against a baseline measured in the same run.
bench: $(VENV)/.bench-stamp
	@set -e; for b in benchmarks/*.py; do echo "== $$b"; $(BIN)/python $$b; done

# torchft, the line benchmarks/torchft_restart.py measures Forewarn's recovery against.
$(VENV)/.bench-stamp: $(STAMP)
	$(BIN)/python -m pip install -q -e '.[dev,bench]'
	touch $@

clean:
	rm -rf $(VENV) var .pytest_cache .mypy_cache .ruff_cache
