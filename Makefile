# Two commands on a fresh machine: `make demo` (the main job, local embedded Ray)
# and `make test`. Both create .venv when missing, installing CPU torch first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH ?= torch==2.13.0

.PHONY: demo demo-lm test test-cluster test-quick lint bench gpu-check analysis clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e '.[test]'
	touch $@

demo: $(VENV)/.installed
	$(PY) jobs/demo.py

# The same story with a decoder-only looped LM: next-token pretraining, finetuning on chat prompts, SPEED vs sequential.
demo-lm: $(VENV)/.installed
	$(PY) jobs/demo.py --model lm

# Tests use tiny models: one intra-op thread each avoids oversubscribing the cores, and a thread waiting for work
# sleeps instead of spinning (OMP_WAIT_POLICY: a test that asks for two threads beside a busy worker otherwise
# runs ~4x slower, measured: a 2-thread matmul loop 10.2 s spinning, 2.4 s passive). Two pytest-xdist workers
# (TEST_WORKERS; 0 runs in one process, in file order): each a session of its own (tests/conftest.py).
TEST_WORKERS ?= 2
XDIST = -n $(TEST_WORKERS) --dist loadfile
test: $(VENV)/.installed
	$(PY) -m ruff check platform jobs tests
	OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE $(PY) -m pytest -m "not gpu and not cluster" $(XDIST) $(PYTEST_ARGS)

# Several Ray nodes on this machine, one of them lost mid-run (the `cluster` mark, tests/test_nodes.py: Train, Serve
# and a sweep's trial): ~5 min on 2 cores (measured: 100, 60 and 125 s), so outside `make test`. One process: each test's cluster takes the machine's CPUs.
test-cluster: $(VENV)/.installed
	OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE $(PY) -m pytest -m cluster -n 0 $(PYTEST_ARGS)

# The inner loop: no Ray, no Serve, no training runs (the `ray` and `slow` marks), under 90 s.
test-quick: $(VENV)/.installed
	$(PY) -m ruff check platform jobs tests
	OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE $(PY) -m pytest -m "not gpu and not ray and not slow" $(XDIST) $(PYTEST_ARGS)

lint: $(VENV)/.installed
	$(PY) -m ruff check platform jobs tests

bench: $(VENV)/.installed
	$(PY) jobs/bench_decode.py

# On a GPU machine, with that machine's own python3 and torch (no .venv, no Ray): every CUDA path once,
# within 8 minutes; one JSON report ($$OUT/gpu_check.json when OUT is set, else results/) and a summary table.
gpu-check:
	$(PYTHON) jobs/gpu_check.py

# Every notebook in analysis/ on a results folder (evaluations, benchmarks, load runs, Serve statistics, found
# by content); figures are written as PNG beside the files they read, executed notebooks into RESULTS/notebooks.
RESULTS ?= results
analysis: $(VENV)/.installed
	$(PY) jobs/analysis.py --results $(RESULTS)

clean:
	rm -rf $(VENV) runs results .pytest_cache
