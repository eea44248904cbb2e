# STen: `make demo` runs the main job, `make test` the whole test suite.
# Both create .venv with the pinned CPU torch and install the core and every
# plugin in editable mode; both are idempotent.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH_SPEC ?= torch==2.13.0
PLUGINS := $(wildcard plugins/*/pyproject.toml)
STAMP := $(VENV)/.sten-installed

.PHONY: setup demo test bench docs clean

setup: $(STAMP)

$(STAMP): pyproject.toml $(PLUGINS) Makefile $(wildcard plugins/*/setup.py plugins/*/csrc/*)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip setuptools wheel
	$(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e ".[test,bench,docs]"
	for p in $(dir $(PLUGINS)); do $(PIP) install -q --no-build-isolation -e "$$p[test]" || exit 1; done
	touch $(STAMP)

demo: setup
	$(VENV)/bin/sten bench --quick --out bench-out

# The core's suite, then each plugin's own suite from its folder (its own pytest config).
test: setup
	$(PY) -m pytest -q
	for p in $(dir $(PLUGINS)); do (cd $$p && $(abspath $(PY)) -m pytest -q) || exit 1; done

bench: setup
	$(PY) benchmarks/bench_dispatch.py
	$(PY) benchmarks/bench_bert.py --out bench-out

docs: setup
	$(VENV)/bin/mkdocs build --strict

clean:
	rm -rf $(VENV) build site bench-out
