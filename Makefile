# The README's two commands: `make run` (main job on the shipped model) and
# `make test` (whole suite). Both create .venv and install the pinned
# dependencies on first use; afterwards the install step is a no-op.
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
EXTRAS_STAMP := $(VENV)/.installed-extras

.PHONY: setup run test bench mutation clean chromium

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' || \
		{ echo "error: Python 3.11+ is required ($(PYTHON) is too old); set PYTHON=/path/to/python3.11" >&2; exit 2; }
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[test]'
	@touch $(STAMP)

setup: $(STAMP)

run: $(STAMP)
	./capture_first_layer.sh essential -- --report
	$(PY) compare_with_fp.py first_layer_io_all_modes.npz

test: $(STAMP) $(EXTRAS_STAMP) chromium
	$(PY) -m pytest -q

# The optional extras the tests exercise: [cluster] (ray: tests/runner/test_ray.py starts a local cluster),
# [formats] (torchao: the MX/NVFP4 reference), [quamba2] (scikit-learn: Quamba2's grouping) and [eval]
# (lm-eval and accelerate: tests/lmeval/ compare quamba-harness with lm-eval's hf model). Installed
# on first use (a no-op afterwards); where they cannot be installed (offline) those tests skip and say why.
$(EXTRAS_STAMP): pyproject.toml $(STAMP)
	@$(PY) -m pip install --quiet --disable-pip-version-check -e '.[test,cluster,formats,quamba2,eval]' && touch $(EXTRAS_STAMP) || \
		echo "note: the extras (ray, torchao, scikit-learn, lm-eval) could not be installed; their tests will be skipped"

# The HTML report's browser test needs Debian's chromium; install it when missing (root + apt-get),
# otherwise say why the test will be skipped.
chromium:
	@command -v chromium >/dev/null 2>&1 || { \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
			echo "installing chromium for the HTML report's browser test"; \
			apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
		else echo "note: chromium is missing and cannot be installed here (needs root and apt-get); the browser test will be skipped"; fi; }

# Mutation testing (mutmut, the `dev` extra, installed on first use): writes docs/mutation.md.
# A seeded 3 % of every module's mutants (about 600, an hour on 2 cores; FRACTION=1: all, days); mutants with a
# result in mutants/ are not run again, so a stopped run resumes. MODULES=harness.kernels.quant limits the
# run; CHILDREN workers (default: one per core, each with one torch thread) run mutants side by side;
# all modules go through one mutmut run (one clean-test pass).
DEV_STAMP := $(VENV)/.installed-dev
MODULES ?=
CHILDREN ?= $(shell nproc 2>/dev/null || echo 1)
FRACTION ?= 0.03
SEED ?= 1

$(DEV_STAMP): pyproject.toml $(STAMP)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[test,dev]'
	@touch $(DEV_STAMP)

mutation: $(DEV_STAMP)
	$(PY) tools/mutation.py --max-children $(CHILDREN) --one-call --fraction $(FRACTION) --seed $(SEED) $(MODULES)
	-$(PY) tools/mutation_check.py --tested
	$(PY) tools/mutation_report.py

bench: $(STAMP)
	$(PY) benchmarks/bench_modes.py
	$(PY) benchmarks/bench_report.py

clean:
	rm -rf $(VENV) .pytest_cache .harness_cache mutants first_layer_io_all_modes.npz first_layer_io_all_modes_stats.json \
		first_layer_io_all_modes_report.html
