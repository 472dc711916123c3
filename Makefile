# The two commands of the README: `make demo` and `make test`. Each sets up .venv first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Pinned: an unpinned torch pulls gigabytes of CUDA packages.
TORCH := torch==2.13.0

.PHONY: setup demo test clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH)
	$(BIN)/python -m pip install -q -e '.[server,test]'
	# Independent oracles for the tests (their own pins are not needed): Z Lab's DFlash reference,
	# and speculators' DFlash 2 modules.
	$(BIN)/python -m pip install -q --no-deps dflash==0.1.0 speculators==0.9.0
	# The grammar engine for structured outputs, without the ~1 GB of GPU-only triton its wheel declares.
	$(BIN)/python -m pip install -q --no-deps xgrammar==0.2.8
	touch $@

demo: setup
	$(BIN)/blockspec demo

test: setup
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV)
