# Everything runs in a virtualenv this Makefile creates: `make demo`, `make test`, `make bench`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test bench clean certs

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $@

demo: $(STAMP)
	$(PY) examples/seed_dag.py

test: $(STAMP)
	$(PY) -m pytest -q

# Each benchmark prints its ratios and writes JSON to benchmarks/results/; QUICK=1 for smoke runs.
BENCH_FLAGS := $(if $(QUICK),--quick,)
bench: $(STAMP)
	$(PY) benchmarks/k_heads.py $(BENCH_FLAGS)
	$(PY) benchmarks/portable.py $(BENCH_FLAGS)
	$(PY) benchmarks/sweeps.py $(BENCH_FLAGS)

clean:
	rm -rf $(VENV) *.egg-info

# TLS certificates for the cluster recipes in deploy/ (deploy/README.md).
certs: $(STAMP)
	$(VENV)/bin/daskdag certs deploy/certs
