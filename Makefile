# The two commands of the README. Each installs what it needs into .venv first.
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/autopar demo

test: $(STAMP)
	$(VENV)/bin/python -m pytest

lint: $(STAMP)
	$(VENV)/bin/ruff check autopar cost_models benchmarks tests
	$(VENV)/bin/ruff format --check autopar cost_models benchmarks tests

bench: $(STAMP)
	$(VENV)/bin/python -m benchmarks
