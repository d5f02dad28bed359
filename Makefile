# dist_checkpointing: install, lint, test, docs, demo, benchmarks.
# `make test` (lint, docs, the whole suite) is exactly what CI runs (.ci/run). Works on a fresh clone with PyPI access only.

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# Exact pin on purpose: any other spec resolves to the CUDA build and pulls GBs of wheels.
TORCH_VERSION := 2.13.0
STAMP := $(VENV)/.install-stamp
NPROC ?= 2
PYTEST_ARGS ?=
BENCH_ARGS ?=
# Megatron-Core for the live interop tests (tests/compat/test_megatron_live.py, which put
# one release on their ranks' path) and the table's "megatron" row (the newest release),
# kept out of $(VENV) (the rest of the suite never sees it): each release in its own folder
# under $(MCORE_SITE), without dependencies (torch, numpy, packaging come from $(VENV)).
# 0.13.1 is the oldest release we promise, 0.16.1 the newest on PyPI. Without a package
# index the tests skip and the row reads n/a.
MCORE_VERSIONS := 0.13.1 0.16.1
MCORE_BENCH_VERSION := 0.16.1
MCORE_SITE := .mcore-site
DOCS_BUILD := docs/_build

.PHONY: help venv install lint format test test-fast demo docs bench clean distclean

help:
	@echo "make demo       save and load a sharded checkpoint on $(NPROC) ranks (torchrun)"
	@echo "make test       lint, docs, then the whole test suite (what CI runs)"
	@echo "make test-fast  the test suite without tests marked slow"
	@echo "make lint       ruff check, ruff format --check, mypy --strict"
	@echo "make format     apply ruff fixes and formatting"
	@echo "make docs       build the HTML docs into $(DOCS_BUILD)/html"
	@echo "make bench      the benchmark table on 1, 2 and 4 ranks (BENCH_ARGS=--quick: small)"
	@echo "make install    create $(VENV); install the package, its dev tools and extras"
	@echo "                (nvrx, msc) and the test servers (moto[server], boto3)"
	@echo "make clean      remove build, cache and docs output (distclean: also $(VENV))"

$(STAMP): setup.py pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install "torch==$(TORCH_VERSION)"
	$(BIN)/python -m pip install -e ".[dev,nvrx,cli,msc,isal]"
	touch $@

venv install: $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy dist_checkpointing

format: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

test: $(STAMP) $(MCORE_SITE)/.stamp lint docs
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(BIN)/python -m pytest -m "not slow" $(PYTEST_ARGS)

demo: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python examples/demo.py

docs: $(STAMP)
	$(BIN)/sphinx-build -W --keep-going -b html docs $(DOCS_BUILD)/html
	@echo "docs: open $(DOCS_BUILD)/html/index.html"

# The benchmark table (bench/table.py): every method and case on 1, 2 and 4 ranks, one
# torchrun per rank count, one merged table. Quick smoke run: make bench BENCH_ARGS="--quick".
# The other bench/*.py scripts are run by hand with torchrun (see docs/performance.rst).
bench: $(STAMP) $(MCORE_SITE)/.stamp
	PYTHONPATH=$(MCORE_SITE)/$(MCORE_BENCH_VERSION)$${PYTHONPATH:+:$$PYTHONPATH} \
		$(BIN)/python bench/table.py $(BENCH_ARGS)

$(MCORE_SITE)/.stamp: $(STAMP)
	for v in $(MCORE_VERSIONS); do \
		$(BIN)/python -m pip install --no-deps --target $(MCORE_SITE)/$$v "megatron-core==$$v" \
			|| echo "megatron-core $$v not installed: its interop tests skip"; \
	done
	touch $@

clean:
	rm -rf build dist *.egg-info $(DOCS_BUILD) .pytest_cache .mypy_cache .ruff_cache .hypothesis
	find . -path ./$(VENV) -prune -o -path ./.git -prune -o -name __pycache__ -type d -print \
		| xargs rm -rf

distclean: clean
	rm -rf $(VENV) $(MCORE_SITE)
