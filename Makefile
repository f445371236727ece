# Two commands on a fresh machine: `make demo` (the main job, local embedded Ray)
# and `make test`. Both create .venv when missing, installing CPU torch first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH ?= torch==2.13.0

.PHONY: demo test lint bench gpu-check analysis clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e '.[test]'
	touch $@

demo: $(VENV)/.installed
	$(PY) jobs/demo.py

# Tests use tiny models: one intra-op thread each avoids oversubscribing the cores.
test: $(VENV)/.installed
	$(PY) -m ruff check platform jobs tests
	OMP_NUM_THREADS=1 $(PY) -m pytest -m "not gpu" $(PYTEST_ARGS)

lint: $(VENV)/.installed
	$(PY) -m ruff check platform jobs tests

bench: $(VENV)/.installed
	$(PY) jobs/bench_decode.py

# On a GPU machine, with that machine's own python3 and torch (no .venv, no Ray): every CUDA path once,
# within 6 minutes; one JSON report ($$OUT/gpu_check.json when OUT is set, else results/) and a summary table.
gpu-check:
	$(PYTHON) jobs/gpu_check.py

# Every notebook in analysis/ on a results folder (evaluations, benchmarks, load runs, Serve statistics, found
# by content); figures are written as PNG beside the files they read, executed notebooks into RESULTS/notebooks.
RESULTS ?= results
analysis: $(VENV)/.installed
	$(PY) jobs/analysis.py --results $(RESULTS)

clean:
	rm -rf $(VENV) runs results .pytest_cache
