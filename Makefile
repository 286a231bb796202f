# Two entry points on a fresh machine: `make run` (the main job) and `make test`.
# Both create .venv and install the project with torch pinned to the CPU wheel.
VENV ?= .venv
BIN := $(VENV)/bin
PYTEST_ARGS ?=

.PHONY: setup run test lint proto bench gpu-wheels clean

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

# The packages a device machine's image lacks (bench/gpu_wheels.txt), as Python 3.12 wheels in
# .whl/ for bench/gpu_check.sh (docs/operations.md: "A GPU check").
gpu-wheels: setup
	$(BIN)/pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
		--platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl -r bench/gpu_wheels.txt
	$(BIN)/pip wheel --quiet --no-deps -w .whl -r bench/gpu_sdists.txt

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
