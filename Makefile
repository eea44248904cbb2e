# STen: `make demo` runs the main job, `make test` the whole test suite.
# Both create .venv with the pinned CPU torch and install the core and every
# plugin in editable mode; both are idempotent.
# `make wheels` builds every package (core, plugins, example plugin) as users get it
# (`python -m build`: sdist, then the wheel from it, in an isolated build env with
# setuptools only, no torch); `make wheel-test` installs the core wheel and one
# plugin's wheel (WHEEL_PLUGIN, default sten_nm) into a fresh venv and runs that
# plugin's suite against the installed wheel.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH_SPEC ?= torch==2.13.0
PLUGINS := $(wildcard plugins/*/pyproject.toml)
STAMP := $(VENV)/.sten-installed
PACKAGES := . $(dir $(PLUGINS)) examples/sten_example_plugin/
DIST ?= dist
BUILD_VENV ?= .venv-build
WHEEL_VENV ?= .venv-wheel
WHEEL_PLUGIN ?= sten_nm
WHEEL_TESTS := build/wheel-test/$(WHEEL_PLUGIN)
# Plugins whose suites `make test` leaves to another target (CI: the one wheel-test runs).
SKIP_SUITES ?=
# pytest-xdist workers for the core's suite (0: one process). Two on a 2-core machine took
# 9 min instead of 17 (torch on one thread per worker: tests/conftest.py); the plugin suites
# stay in one process (sten_nm's OpenMP kernels ran 1.75x slower in two workers than in one).
TEST_WORKERS ?= 2
SUITES := $(filter-out $(addprefix plugins/,$(addsuffix /,$(SKIP_SUITES))),$(dir $(PLUGINS)))

.PHONY: setup demo test bench docs wheels wheel-test clean

setup: $(STAMP)

$(STAMP): pyproject.toml $(PLUGINS) Makefile $(wildcard plugins/*/setup.py plugins/*/csrc/*)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip setuptools wheel
	$(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e ".[test,bench,docs]"
	for p in $(dir $(PLUGINS)); do $(PIP) install -q -e "$$p[test]" || exit 1; done
	touch $(STAMP)

demo: setup
	$(VENV)/bin/sten bench --quick --out bench-out

# The core's suite (in TEST_WORKERS processes; tests of one xdist_group share one), then each
# plugin's own suite from its folder (its own pytest config).
test: setup
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup
	for p in $(SUITES); do (cd $$p && $(abspath $(PY)) -m pytest -q) || exit 1; done

bench: setup
	$(PY) benchmarks/bench_dispatch.py
	$(PY) benchmarks/bench_bert.py --out bench-out

docs: setup
	$(VENV)/bin/mkdocs build --strict

# The build front end lives in its own small venv: building needs neither torch nor .venv.
$(BUILD_VENV)/.ok:
	test -x $(BUILD_VENV)/bin/python || $(PYTHON) -m venv $(BUILD_VENV)
	$(BUILD_VENV)/bin/python -m pip install -q "build>=1.2"
	touch $@

wheels: $(BUILD_VENV)/.ok
	rm -rf $(DIST)
	for p in $(PACKAGES); do $(BUILD_VENV)/bin/python -m build -q --outdir $(DIST) "$$p" || exit 1; done
	ls -l $(DIST)

# A fresh venv each time: the pinned torch first, then only the two wheels (pip fetches
# their other dependencies); the plugin's tests run from a copy outside the source tree,
# so they import the installed wheel (its benchmarks come along: a smoke test runs one).
wheel-test: wheels
	rm -rf $(WHEEL_VENV) $(WHEEL_TESTS)
	$(PYTHON) -m venv $(WHEEL_VENV)
	$(WHEEL_VENV)/bin/python -m pip install -q "$(TORCH_SPEC)"
	$(WHEEL_VENV)/bin/python -m pip install -q $(DIST)/sten_core-*.whl "$$(ls $(DIST)/$(WHEEL_PLUGIN)-*.whl)[test]"
	mkdir -p $(WHEEL_TESTS)
	cp -R plugins/$(WHEEL_PLUGIN)/tests plugins/$(WHEEL_PLUGIN)/pyproject.toml $(wildcard plugins/$(WHEEL_PLUGIN)/benchmarks) $(WHEEL_TESTS)/
	cd $(WHEEL_TESTS) && $(abspath $(WHEEL_VENV))/bin/python $(abspath .ci/check_wheel_install.py) $(WHEEL_PLUGIN)
	cd $(WHEEL_TESTS) && $(abspath $(WHEEL_VENV))/bin/python -m pytest -q -p no:cacheprovider

clean:
	rm -rf $(VENV) $(BUILD_VENV) $(WHEEL_VENV) $(DIST) build site bench-out
