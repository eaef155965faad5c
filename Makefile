# The two set-up commands of the README. Both work on a fresh machine: they create .venv and
# install the project with the pinned versions of constraints.txt.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test

.PHONY: demo test install clean gpu

# Python's compiled modules (.pyc) go under .venv/pycache, each written by the first process that
# imports its module. Where PYTHONDONTWRITEBYTECODE is set (as it is on the machines this project is
# developed on) every one of the suite's ~40 Python processes compiled what it imported again;
# compiling every installed file ahead instead (18,500, 34 s of a fresh install on 2 cores) compiled
# 2.4 times what the suite imports (7,600 files). The prefix keeps them out of the source tree and
# goes with the venv.
export PYTHONPYCACHEPREFIX := $(CURDIR)/$(VENV)/pycache
unexport PYTHONDONTWRITEBYTECODE

demo: $(STAMP)
	$(BIN)/rosetta check --preset tiny --report reports/demo

# The suite on every core (at most 4 workers: each imports torch and JAX, tests/conftest.py gives
# each one thread), a test at a time to whichever worker is free, but the tests of a module's
# once-made fixture (a matrix run, a Ray cluster) in one worker (tests/conftest.py groups them).
# The slowest tests are listed at the end, so CI's log says where the suite's time goes.
test: $(TEST_STAMP)
	$(BIN)/python -m pytest -n auto --maxprocesses 4 --dist loadgroup --durations=30

install: $(TEST_STAMP)

# The GPU report (rosetta gpu) on whatever CUDA device is present. No venv is insisted on: a lent
# GPU machine has the frameworks in its own Python, so .venv is used only where it exists, and
# the project runs from PYTHONPATH (whatever PYTHONPATH already holds is kept after it).
GPU_PYTHON = $(if $(wildcard $(BIN)/python),$(BIN)/python,$(PYTHON))
gpu:
	PYTHONPATH="$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH}" $(GPU_PYTHON) -m rosetta gpu --out reports/gpu

# A venv left half-made by an interrupted run has python but no pip: it is made again.
# jax2onnx declares the CPU 'onnxruntime' package, which would overwrite onnxruntime-gpu's module;
# it is installed with --no-deps, what it really needs (jax, flax, onnx, onnx-ir, ml_dtypes) above.
# The demo needs the project alone; the tests add pytest, hypothesis and transformers (the
# Hugging Face importers' tests run its models), about 20 more packages, and onnxruntime-genai
# (the CUDA build of it: the plain package declares the CPU onnxruntime; with --no-deps it runs on
# our onnxruntime-gpu, and its model builder needs only torch, transformers, onnx and onnx-ir).
# torchao (the torchao-int8 quantized column) declares nothing it needs beyond torch; --no-deps keeps
# it from ever asking pip for another torch than the pinned CPU wheel.
# pip installs without compiling: it would compile its ~18,000 files one at a time (41 s of an 83 s
# install on 2 cores), where the imports compile what is used (PYTHONPYCACHEPREFIX above).
PIP_INSTALL := $(BIN)/python -m pip install --quiet --no-compile -c constraints.txt

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/pip || $(PYTHON) -m venv --clear $(VENV)
	$(PIP_INSTALL) -e .
	$(PIP_INSTALL) --no-deps jax2onnx
	touch $(STAMP)

$(TEST_STAMP): $(STAMP)
	$(PIP_INSTALL) -e '.[test,hf]'
	$(PIP_INSTALL) --no-deps onnxruntime-genai-cuda torchao
	touch $(TEST_STAMP)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
