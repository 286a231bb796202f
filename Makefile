# Two entry points on a fresh machine: `make run` (the main job) and `make test`.
# Both create .venv and install the project with torch pinned to the CPU wheel.
VENV ?= .venv
BIN := $(VENV)/bin
PYTEST_ARGS ?=

.PHONY: setup run test lint proto bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e ".[dev]"
	touch $@

run: setup
	$(BIN)/swarm up

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test: lint
	$(BIN)/python -m pytest $(PYTEST_ARGS)

proto: setup
	$(BIN)/python -m swarm.tools.gen_proto

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
