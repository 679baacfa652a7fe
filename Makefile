# hetc quickstart:  `make demo`  runs the demo job,  `make test`  runs the tests.
# Both create .venv and install hetc into it on first use.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# torch is installed first and pinned: pip takes the CPU build where a local
# wheel of it exists (our development machines) and the CUDA build from PyPI
# elsewhere. An environment that already has torch keeps it (TORCH= to skip).
TORCH ?= torch==2.13.0

.PHONY: demo test install

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e '.[test]'
	touch $@

demo: install
	$(BIN)/hetc demo

test: install
	$(BIN)/python -m pytest
