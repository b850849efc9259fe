# The two commands of the README: `make test` and `make demo`. Both create .venv on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: install test lint demo bench

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e ".[dev]"
	touch $@

install: $(VENV)/.installed

test: install
	$(PY) -m ruff check ddp_ft scripts tests
	$(PY) -m pytest

lint: install
	$(PY) -m ruff check ddp_ft scripts tests
	$(PY) -m ruff format --check ddp_ft scripts tests

demo: bench

bench: install
	$(VENV)/bin/torchrun --standalone --nproc_per_node=2 scripts/bench_ddp.py --out bench_results/bench_ddp.json
