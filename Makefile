# Rackplane: `make run` starts the service on its embedded default; `make test` runs the tests.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PYTEST_ARGS ?=

.PHONY: run test install services openapi lint clean

$(BIN)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $@

install: $(BIN)/.installed

run: install
	$(BIN)/rackplane up

services:
	bash scripts/ensure-services.sh

test: install services lint
	$(BIN)/python -m pytest $(PYTEST_ARGS)

openapi: install
	$(BIN)/rackplane openapi

lint: install
	$(BIN)/ruff check app workers tests benchmarks
	$(BIN)/mypy app/placement --ignore-missing-imports

clean:
	rm -rf .rackplane .pytest_cache
