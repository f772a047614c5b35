# The README's commands. Every target creates .venv and installs what it needs first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
HOST ?= 127.0.0.1
PORT ?= 8765
PYTEST_ARGS ?=
# Test workers (pytest-xdist; each test file stays on one worker). 2, the default: on two
# cores the whole suite took 10.7-11.3 min with two workers against 16.4 min in one process
# (the end-to-end cases mostly wait on real processes and clocks). 0: one process.
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
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist loadfile --durations=25 $(PYTEST_ARGS)

## bench: every benchmark, each printing ratios against a baseline measured in the same run.
bench: $(STAMP)
	@set -e; for b in benchmarks/*.py; do echo "== $$b"; $(BIN)/python $$b; done

clean:
	rm -rf $(VENV) var .pytest_cache .mypy_cache .ruff_cache
