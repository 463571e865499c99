# Fresh-machine entry points: `make demo` and `make test` need only python3.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The CPU wheel of torch goes in first so resolving the project pulls no multi-GB CUDA build.
# Bytecode: pip's own pass compiles file by file on one core (--no-compile skips it), and Python
# writes a module's bytecode at its first import only where PYTHONDONTWRITEBYTECODE is unset; where
# it is set, every process (each test's subprocess, each rank) compiled torch again (4.7 s to import
# torch against 1.8 s). So setup compiles site-packages itself, on every core (19,000 files, ~25 s on
# 2 cores); the one file in torch's test helpers written in Python 3.12's syntax is skipped.
TORCH_SPEC ?= torch==2.13.0

.PHONY: setup demo test test-full lint wheel-check test-zoo bench bench-smoke clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet --no-compile "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet --no-compile -e ".[dev]"
	$(PY) -m compileall -q -j 0 -x 'py312_intrinsics' "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
	touch $(STAMP)

setup: $(STAMP)

# Plans a 1.3B GPT for 2 DGX H100 nodes and writes its module and launch scripts, then compiles
# a small byte-level GPT for this machine (2 gloo ranks) and trains it for 300 steps on real text
# every machine has: the Python standard library's asyncio sources (validation loss every 50 steps).
STDLIB = $(shell $(PYTHON) -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')
demo: setup
	$(VENV)/bin/autopar compile examples/gpt.py cluster=dgx_h100 cluster.nodes=2 model.layers=24 \
		model.hidden=2048 model.heads=16 model.seq_len=2048 train.global_batch_size=512 --out-dir demo/gpt_dgx_h100
	$(VENV)/bin/autopar compile examples/gpt.py cluster=cpu_gloo cluster.gpus_per_node=2 model.layers=4 \
		model.hidden=128 model.heads=4 model.seq_len=128 model.vocab=257 train.global_batch_size=16 \
		train.precision=fp32 data.path="$(STDLIB)/asyncio" data.val_fraction=0.05 train.eval_every=50 \
		optim.lr=3e-3 optim.warmup_steps=30 optim.min_lr=3e-4 --out-dir demo/gpt_cpu
	$(VENV)/bin/autopar run demo/gpt_cpu --steps 300

# The default tier (CI's): one pytest run spread over TEST_WORKERS processes (pytest-xdist, a
# file's tests together, in the order given): the suites that start ranks first, their longest
# files leading, and the single-process unit files after them, which fill in wherever a worker is
# free, so that neither worker waits at the end of one suite for the other to finish it
# (TEST_WORKERS=0 runs one test at a time). test-full adds the extended tier (tests marked
# `extended`, tests/tiers.py).
# One intra-op thread a process: the tests' tensors are tiny, and a second thread only spins beside
# the other worker (the unit suite 217 s -> 185 s); torchrun's ranks run so already.
TEST_WORKERS ?= 2
TEST_THREADS ?= 1
PYTEST = OMP_NUM_THREADS=$(TEST_THREADS) $(PY) -m pytest -q
test: setup
	$(PYTEST) -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder tests/dist tests/zoo tests/unit

# Undefined and unused names and pycodestyle's errors (pyproject.toml [tool.ruff]), and types
# ([tool.mypy]); CI runs it.
lint: setup
	$(PY) -m ruff check .
	$(PY) -m mypy

test-full: setup
	$(PYTEST) -n $(TEST_WORKERS) --dist loadfile tests/unit --extended
	$(PYTEST) tests/dist tests/zoo --extended

# The built wheel, installed with torch alone into a fresh venv (build/wheel-venv), plans,
# compiles, runs and reports a tiny GPT from a temporary folder outside the repository (~1 min).
wheel-check: setup
	TORCH_SPEC="$(TORCH_SPEC)" .ci/wheel-check $(PY)

# Every zoo case (75 models x 6 on 2 ranks: 5 pins and the first plan; 50 on 4 ranks: 8 models x 5 pins, TP layouts, GQA at tp4, the masked LM); `make test` runs a subset.
test-zoo: setup
	AUTOPAR_ZOO=all $(PY) -m pytest -q tests/zoo

bench: setup
	$(PY) -m benchmarks.run

# Every benchmark at its smallest size (one case, few steps): that they still run (CI runs it;
# one intra-op thread, as the tests, and SMOKE_JOBS benchmarks at a time: 110 s -> 72 s on 2 cores).
SMOKE_JOBS ?= 2
bench-smoke: setup
	OMP_NUM_THREADS=$(TEST_THREADS) SMOKE_JOBS=$(SMOKE_JOBS) $(PY) -m benchmarks.run --smoke

clean:
	rm -rf $(VENV) build *.egg-info demo
