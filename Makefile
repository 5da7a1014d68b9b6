# Everything runs in a virtualenv this Makefile creates: `make demo`, `make test`, `make bench`.
VENV ?= .venv
PY := $(VENV)/bin/python
CORE_STAMP := $(VENV)/.installed-core
STAMP := $(VENV)/.installed
BENCH_STAMP := $(VENV)/.installed-bench

.PHONY: demo test test-fast coverage docs bench bench-test clean certs

# daskdag and what it needs, and the dashboard of the clusters the docs start: all `make demo` takes.
$(CORE_STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dashboard]'
	touch $@

# The test and docs extras too, for `make test`.
$(STAMP): $(CORE_STAMP)
	$(PY) -m pip install -q -e '.[test,docs]'
	touch $@

demo: $(CORE_STAMP)
	$(PY) examples/seed_dag.py

# The whole suite on WORKERS processes (pytest-xdist), file by file, the longest files first
# (tests/support/selection.py).
WORKERS ?= 2
XDIST := -n $(WORKERS) --dist loadgroup

test: $(STAMP)
	$(PY) -m pytest $(XDIST) -q --durations=25

# The inner loop: the tests that start no cluster and no other process (markers `cluster`,
# `subprocess`, `bench`), a few minutes.
test-fast: $(STAMP)
	$(PY) -m pytest $(XDIST) -q -m "not cluster and not subprocess and not bench"

# The whole suite with line coverage of daskdag/ (in the test processes), in htmlcov/.
coverage: $(STAMP)
	$(PY) -m pytest $(XDIST) -q --cov=daskdag --cov-report=term --cov-report=html

$(BENCH_STAMP): $(STAMP)
	$(PY) -m pip install -q -e '.[test,docs,bench]'
	touch $@

# Every scenario in one run: benchmarks/results/latest.{json,md} and PNGs (QUICK=1: a short run,
# several minutes, into benchmarks/results/quick/). DOCS=1 also updates docs/performance.md.
bench: $(BENCH_STAMP)
	$(PY) -m benchmarks $(if $(QUICK),--quick,) $(if $(DOCS),--update-docs,)

# The test that runs `python -m benchmarks --quick` and checks what it writes.
bench-test: $(BENCH_STAMP)
	DASKDAG_BENCH=1 $(PY) -m pytest -q -m bench

# The documentation site in site/, as CI checks it (--strict: a broken link or reference fails).
# Material for MkDocs is pinned below 10 (pyproject.toml, the docs extra) until its end of life
# in May 2027; its notice about that is silenced here.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir site

clean:
	rm -rf $(VENV) *.egg-info site .jax-cache

# TLS certificates for the cluster recipes in deploy/ (docs/guides/deployment.md).
certs: $(STAMP)
	$(VENV)/bin/daskdag certs deploy/certs
