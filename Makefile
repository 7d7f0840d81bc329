# make demo / make test work on a fresh machine with nothing but Python.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# torch is installed first and pinned: a bare `torch` requirement resolved by pip with no torch
# present would pull a multi-GB CUDA build. pyproject.toml only declares torch>=2.4.
TORCH_SPEC ?= torch==2.13.0
STAMP  := $(VENV)/.installed

.PHONY: demo test test-all install bench gpu-check clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test,profiler,checkpoint,lora]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/ops-transformer demo

test: $(STAMP)
	$(PY) -m pytest -q

# Everything, the `slow` checks included (CI runs this through .ci/run).
test-all: $(STAMP)
	$(PY) -m pytest -q -m "slow or not slow"

bench: $(STAMP)
	$(PY) benchmarks/bench_mlp.py

# The prepared GPU check (benchmarks/gpu_check.py, <= 8 min on one GPU): one JSON file of results.
# Without a visible GPU it says so and exits non-zero.
gpu-check: $(STAMP)
	$(PY) benchmarks/gpu_check.py --out runs/gpu-check.json

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache runs
