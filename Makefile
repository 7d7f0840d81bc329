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

# The first install takes minutes (README: measured), so each step says what it does and pip shows
# its download progress.
$(STAMP): $(PY) pyproject.toml
	@echo "make: installing into $(VENV), once (about 3.5 min on the 2-core development machine, mostly downloads)"
	@echo "make: [1/3] upgrading pip"
	$(PY) -m pip install -q --upgrade pip
	@echo "make: [2/3] $(TORCH_SPEC), the largest download"
	$(PY) -m pip install --progress-bar on "$(TORCH_SPEC)"
	@echo "make: [3/3] ops-transformer with its test, profiler, checkpoint and lora extras"
	$(PY) -m pip install --progress-bar on -e ".[test,profiler,checkpoint,lora,yaml]"
	touch $(STAMP)
	@echo "make: installed; the next make demo / make test start at once"

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
