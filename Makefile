# Two commands for a fresh machine:  `make train` (set up + main job)  and  `make test` (set up + tests).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

$(BIN)/multicard: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch pinned first, so that nothing below pulls a CUDA build from the registry
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	# byte-compiled once here: where PYTHONDONTWRITEBYTECODE is set nothing is cached later, and a pip that left a
	# package uncompiled (sympy, here) has every process that builds a DDP (it imports sympy) compile its 1,500
	# modules again: ~1.2 s of CPU a rank (the few files only a newer Python parses are left as they are)
	$(BIN)/python -m compileall -q $(VENV)/lib > /dev/null || true
	touch $@

setup: $(BIN)/multicard

train: setup
	$(BIN)/multicard train

# two pytest workers, a test file each at a time (a file's module fixtures run once): a job's ranks spend much of
# their time waiting (imports, rendezvous, a rank that fails on purpose), and the other file's job runs meanwhile
test: setup
	$(BIN)/ruff check src tests benchmarks examples
	$(BIN)/pytest -n 2 --dist loadfile

# the slow end-to-end tests as well (CI runs these after make test)
test-all: test
	$(BIN)/pytest -m slow

.PHONY: setup train test test-all
