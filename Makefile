# `make train` and `make test` each set up .venv on first use, then run.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: train test lint explain bench bench-compile clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install torch==2.13.0
	$(PY) -m pip install -e ".[dev]"
	touch $(STAMP)

# one intra-op thread: on a shared 2-core machine two OpenMP threads crawl (README)
train: $(STAMP)
	$(PY) -m boost_compile.train trainer.threads=1

# the whole suite (tests/unit, tests/distributed) with its 25 slowest tests listed;
# PYTEST_ARGS adds to it, e.g. make test PYTEST_ARGS=tests/unit for the quick loop
test: $(STAMP)
	$(PY) -m pytest -q --durations=25 $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .

explain: $(STAMP)
	$(VENV)/bin/boost-explain --preset tiny --out explain_out

# every boost-bench benchmark (about 8 minutes on 2 cores), then benchmarks/RESULTS.md
bench: $(STAMP)
	$(VENV)/bin/boost-bench all

bench-compile: $(STAMP)
	$(PY) benchmarks/compile_overhead.py

clean:
	rm -rf $(VENV) explain_out .pytest_cache
