# NeoPP serving: `make serve` runs tritonserver on the tiny checkpoint, `make test` runs all tests.
SHELL := /bin/bash
PYTHON_BOOTSTRAP ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed
TINY_DIR ?= build/tiny

.PHONY: setup test bench tiny clean

setup: $(STAMP)

$(STAMP): requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON_BOOTSTRAP) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -r requirements.txt
	$(PIP) install -q --no-deps -e .
	touch $(STAMP)

tiny: setup
	test -f $(TINY_DIR)/dense/config.json || $(PY) -m neopp.tiny_checkpoint --out $(TINY_DIR)

test: setup
	$(PY) -m pytest -q

bench: setup
	$(PY) -m neopp.bench.step_efficiency --out bench

clean:
	rm -rf build
