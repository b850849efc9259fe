# The two commands of the README: `make test` and `make demo`. Both create .venv on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: install test lint demo bench train-reference

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

# The main job on the embedded default (tiny Qwen3, synthetic AMI-like data): one process, then two.
demo: install
	$(PY) scripts/train.py --preset tiny --output-dir runs/tiny-single
	$(VENV)/bin/torchrun --standalone --nproc_per_node=2 scripts/train.py --preset tiny --output-dir runs/tiny-ddp

bench: install
	$(VENV)/bin/torchrun --standalone --nproc_per_node=2 scripts/bench_ddp.py --out bench_results/bench_ddp.json

# The reference run on a machine with 2 GPUs and hub access (Qwen/Qwen3-4B, knkarthick/AMI).
train-reference: install
	$(VENV)/bin/torchrun --standalone --nproc_per_node=2 scripts/train.py --preset qwen3-4b-ami
