# `make run` installs twinserve into .venv and runs the default experiment;
# `make test` installs it with the test extras and runs the test suite (what CI runs).
VENV ?= .venv
PYTHON ?= python3
BIN = $(VENV)/bin

$(BIN)/activate:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# torch first, pinned: it is the CPU build on this kind of machine, while an unpinned torch
# (asked for by the project) would pull a multi-GB CUDA build.
$(VENV)/.installed: $(BIN)/activate pyproject.toml
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $@

.PHONY: install run test bench
install: $(VENV)/.installed

run: install
	$(BIN)/twinserve

# Without a GPU, Triton kernels run (slowly, at tiny sizes) in its interpreter.
test: install
	$(if $(shell command -v nvidia-smi),,TRITON_INTERPRET=1) $(BIN)/python -m pytest -n 2

bench: install
	$(BIN)/python bench/sim_speed.py
