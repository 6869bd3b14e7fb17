# Two commands do everything on a fresh machine with Python 3.11 and pip:
#   make demo   - create .venv, install ckptmgr, run examples/quickstart.py
#   make test   - the whole test suite (lint first), in the same .venv
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# pytest workers (pytest-xdist): one per core, at most 4; `make test PYTEST_WORKERS=0` runs serially
PYTEST_WORKERS ?= auto
STAMP := $(VENV)/.installed

.PHONY: demo test lint format bench clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/quickstart.py

lint: $(STAMP)
	$(PY) -m ruff check ckptmgr tests examples benchmarks
	$(PY) -m ruff format --check ckptmgr tests examples benchmarks

format: $(STAMP)
	$(PY) -m ruff format ckptmgr tests examples benchmarks
	$(PY) -m ruff check --fix ckptmgr tests examples benchmarks

# the whole suite (its 25 slowest tests listed: it runs close to CI's 20-minute limit), then
# tests/test_cuda.py once more on the CPU (skipped above without a GPU): the GPU tests are
# themselves checked on every run, not only on a machine with a GPU
test: lint
	$(PY) -m pytest -n $(PYTEST_WORKERS) --maxprocesses=4 --durations=25
	CKPTMGR_TEST_DEVICE=cpu $(PY) -m pytest -n $(PYTEST_WORKERS) --maxprocesses=4 tests/test_cuda.py

bench: $(STAMP)
	$(PY) benchmarks/bench_save.py

clean:
	rm -rf $(VENV) checkpoints .pytest_cache
