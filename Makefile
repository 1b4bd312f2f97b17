# shoal: `make demo` and `make test` set everything up on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# torch first, pinned: the CPU wheel on disk; an unpinned torch would pull a multi-GB CUDA build.
TORCH_PIN := torch==2.13.0

.PHONY: venv demo test lint bench clean

venv: $(STAMP)

# _version.py too: the installed metadata carries the version (pyproject reads it from there)
$(STAMP): pyproject.toml src/shoal/_version.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH_PIN)
	$(PY) -m pip install --quiet -e '.[dev,s3,metrics,lightning,accelerate,torchtitan,megatron]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m shoal.demo

# Two workers (pytest-xdist): many tests wait on processes of their own, so two at once keep both cores busy.
test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -n 2 --dist worksteal

# ruff, mypy, then the import-layer contract in pyproject.toml ([tool.importlinter], docs/design.md section 2)
lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports --no-cache --no-logo

bench: $(STAMP)
	$(PY) benchmarks/stall.py

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache .mypy_cache .ruff_cache
