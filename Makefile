# `make bench` and `make test` each set the project up first (idempotent), so a fresh clone needs nothing else.
VENV  := .venv
BIN   := $(VENV)/bin
STAMP := $(VENV)/.setup-stamp

.PHONY: setup test test-long test-fast bench lint soak soak-serve

setup: $(STAMP)

$(STAMP): pyproject.toml scripts/setup.sh
	bash scripts/setup.sh
	touch $(STAMP)

test: setup
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/python -m pytest --durations=15

test-long: setup
	$(BIN)/python -m pytest -m long --durations=10

test-fast: setup
	$(BIN)/python -m pytest -m "not slow"

bench: setup
	$(BIN)/kvprefetch bench

lint: setup
	$(BIN)/ruff check src tests benchmarks

# not in CI (which runs a 24-kill cut of it): 1,000 random SIGKILLs of writers and readers on one DRAM pool and
# one disk directory, crash points armed at random, flipped file bytes, a full tmpfs (as root); one summary line
soak: setup
	PYTHONPATH=src $(BIN)/python -m tests.store.soak --kills 1000 --seed 20

# not in CI (which runs a 90-second cut of it): `kvprefetch serve` with every tier under a multi-turn load for
# SOAK_S seconds, faults injected on a seeded schedule, every answer checked against vLLM alone; one summary line
soak-serve: setup
	$(BIN)/kvprefetch soak-serve --seconds $${SOAK_S:-900} --out soak-serve-out
