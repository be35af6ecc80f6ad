# The README's two commands: `make run` (main job on the shipped model) and
# `make test` (whole suite). Both create .venv and install the pinned
# dependencies on first use; afterwards the install step is a no-op.
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup run test bench mutation clean

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' || \
		{ echo "error: Python 3.11+ is required ($(PYTHON) is too old); set PYTHON=/path/to/python3.11" >&2; exit 2; }
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[test]'
	@touch $(STAMP)

setup: $(STAMP)

run: $(STAMP)
	./capture_first_layer.sh essential
	$(PY) compare_with_fp.py first_layer_io_all_modes.npz

test: $(STAMP)
	$(PY) -m pytest -q

# Mutation testing (mutmut, the `dev` extra, installed on first use): writes docs/mutation.md.
# MODULES=harness.ops.quant limits the run; CHILDREN=2 runs two mutants at a time.
DEV_STAMP := $(VENV)/.installed-dev
MODULES ?=
CHILDREN ?= 1

$(DEV_STAMP): pyproject.toml $(STAMP)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[test,dev]'
	@touch $(DEV_STAMP)

mutation: $(DEV_STAMP)
	$(PY) tools/mutation.py --max-children $(CHILDREN) $(MODULES)
	$(PY) tools/mutation_report.py

bench: $(STAMP)
	$(PY) benchmarks/bench_modes.py

clean:
	rm -rf $(VENV) .pytest_cache .harness_cache mutants first_layer_io_all_modes.npz first_layer_io_all_modes_stats.json
