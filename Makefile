# Fresh-machine entry points: `make demo` and `make test` need only python3.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The CPU wheel of torch goes in first so resolving the project pulls no multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0

.PHONY: setup demo test bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(VENV)/bin/autopar profile examples/gpt.py

test: setup
	$(PY) -m pytest -q tests

bench: setup
	$(PY) -m benchmarks.run

clean:
	rm -rf $(VENV) build *.egg-info
