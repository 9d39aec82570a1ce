# The README's two commands: `make demo` and `make test`. Both create/reuse .venv and install
# everything from this repository's own files.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH := torch==2.13.0
# Debian's Chromium for the dashboard's browser test (Playwright drives it; no browser download).
CHROMIUM := /usr/bin/chromium
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: install demo test lint typecheck unit bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# Pin torch first: the CPU build on disk. An unpinned torch pulls a multi-GB CUDA build.
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e '.[workers,dev]' $(TORCH)
	touch $(STAMP)

$(CHROMIUM):
	@echo "installing Debian's chromium for the dashboard's browser test"
	@$(SUDO) apt-get update -qq >/dev/null
	@DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq chromium >/dev/null

install: $(STAMP) $(CHROMIUM)

demo: install
	$(BIN)/controlplane demo

lint: install
	$(BIN)/ruff check controlplane workers loadbench tests bench migrations
	$(BIN)/ruff format --check controlplane workers loadbench tests bench migrations

typecheck: install
	$(BIN)/mypy controlplane workers

test: lint typecheck
	$(BIN)/python -m pytest -q

bench: install
	$(BIN)/python bench/run_all.py

clean:
	rm -rf $(VENV) var .pytest_cache .mypy_cache .ruff_cache
