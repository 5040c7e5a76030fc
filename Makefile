# The two commands a new user runs: `make demo` and `make test` (README).
PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# Tests and benchmarks are type-checked too (the packages' strict settings, and the
# bodies of any function without annotations); they are scripts, not packages.
MYPY_TESTS := --check-untyped-defs --explicit-package-bases tests bench
# How many of the slowest tests `make test` lists (0: every one), so that a run that
# grows past its time budget shows where the time went.
DURATIONS ?= 30

.PHONY: install demo test test-fast lint typecheck bench clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[all,dev]'
	# basic-pitch ships its model in three formats; its declared deps would replace
	# the pinned TensorFlow, so it is installed without them.
	$(PY) -m pip install --quiet --no-deps basic-pitch==0.4.0
	# Headless Chromium for the dashboard's screenshot test (Debian's package; a
	# browser download such as `playwright install` cannot work offline).
	command -v chromium >/dev/null || command -v chromium-browser >/dev/null || \
	  { [ "$$(id -u)" = 0 ] && apt-get update -qq && \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } || \
	  echo "warning: chromium not installed (needs root: apt-get install chromium)"
	touch $(STAMP)

install: $(STAMP)

## Start the embedded stack (nats-server + chDB), evaluate digits_cnn online and batched.
demo: install
	$(VENV)/bin/mlscope demo

## Format check, lint, type-check (strict; tests and benchmarks too), then the whole test suite against real services and runtimes.
test: install
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	$(VENV)/bin/mypy $(MYPY_TESTS)
	$(PY) -m pytest --durations=$(DURATIONS)

## The fast part: pure unit tests only (under a minute).
test-fast: install
	$(PY) -m pytest -m unit -q

lint: install
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .

typecheck: install
	$(VENV)/bin/mypy
	$(VENV)/bin/mypy $(MYPY_TESTS)

bench: install
	$(PY) bench/run_all.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
