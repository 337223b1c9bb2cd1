# `make bench` and `make test` each set the project up first (idempotent), so a fresh clone needs nothing else.
VENV  := .venv
BIN   := $(VENV)/bin
STAMP := $(VENV)/.setup-stamp

.PHONY: setup test test-fast bench lint

setup: $(STAMP)

$(STAMP): pyproject.toml scripts/setup.sh
	bash scripts/setup.sh
	touch $(STAMP)

test: setup
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/python -m pytest

test-fast: setup
	$(BIN)/python -m pytest -m "not slow"

bench: setup
	$(BIN)/kvprefetch bench

lint: setup
	$(BIN)/ruff check src tests benchmarks
