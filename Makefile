# Pin torch to the CPU build that these machines keep on disk; override with
#   make install TORCH_SPEC="torch==2.5.1"   (or any pip requirement string)
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: install demo test test-e2e test-slurm test-unit lint typecheck bench bench-install bench-quick bench-render gpu-check docs docs-install clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(PY) pyproject.toml Makefile
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e ".[dev,report,recipes,transformers,lightning]" "$(TORCH_SPEC)"
	touch $(STAMP)

install: $(STAMP)

demo: install
	OMP_NUM_THREADS=1 $(VENV)/bin/checkpointless demo --verify --out runs/demo

lint: install
	$(VENV)/bin/ruff check checkpointless tests bench examples
	$(VENV)/bin/ruff format --check checkpointless tests bench examples

typecheck: install
	$(VENV)/bin/mypy

# tests/unit: in-process, fast; tests/integration: real processes, real signals. `make test` keeps
# a test of every part, most of them real processes (at most 8 min here); the rest of the end-to-end
# matrix (tests/e2e.txt) is `make test-e2e`, which .ci/run runs too.
test: install lint typecheck
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -m "not e2e and not slurm" tests

test-e2e: install
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -m "e2e and not slurm" tests

# examples/slurm/train.sbatch on a Slurm cluster made on this machine (root: network namespaces;
# installs Debian's slurmctld, slurmd and munge if missing), through a real node death (2-4 min)
test-slurm: install
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -m slurm tests/slurm

test-unit: install
	OMP_NUM_THREADS=1 $(PY) -m pytest -q tests/unit

bench-install: install
	$(PIP) install -q -e ".[bench]" "$(TORCH_SPEC)"

bench: bench-install
	OMP_NUM_THREADS=1 $(PY) -m bench.run_all

bench-quick: bench-install
	OMP_NUM_THREADS=1 $(PY) -m bench.run_all --quick

# On a machine with CUDA (one GPU is enough; under 10 minutes on one H200): writes
# bench/results/gpu_check.json. Uses the venv where it exists, else python3 (a GPU image's torch);
# without CUDA it stops at once with one line. GPU_CHECK_ARGS="--quick" or "--cpu" (a rehearsal).
GPU_PY ?= $(shell test -x $(PY) && echo $(PY) || echo python3)
gpu-check:
	OMP_NUM_THREADS=1 PYTHONPATH=$(CURDIR) $(GPU_PY) -m bench.gpu_check $(GPU_CHECK_ARGS)

bench-render:
	$(PY) -m bench.run_all --render

# The documentation site (Sphinx, MyST Markdown, furo) into docs/_build/html, warnings as errors. The
# benchmark pages (from bench/results/*.json) and the command-line reference (from each command's
# --help) are written as the build starts (docs/_ext/); nothing is read from the network.
docs-install: install
	$(PIP) install -q -e ".[docs]" "$(TORCH_SPEC)"

docs: docs-install
	$(VENV)/bin/sphinx-build -E -W --keep-going -q -b html docs docs/_build/html
	@echo "docs: docs/_build/html/index.html"

clean:
	rm -rf $(VENV) runs .pytest_cache .mypy_cache .ruff_cache docs/_build
