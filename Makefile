# hetc quickstart:  `make demo`  runs the demo job,  `make test`  runs the tests.
# Both create .venv and install hetc into it on first use. `make lint` (ruff) and
# `make typecheck` (mypy) install the pinned tools of the `dev` extra.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# torch is installed first and pinned: pip takes the CPU build where a local
# wheel of it exists (our development machines) and the CUDA build from PyPI
# elsewhere. An environment that already has torch keeps it (TORCH= to skip).
TORCH ?= torch==2.13.0
APT := DEBIAN_FRONTEND=noninteractive timeout 900 apt-get
APT_INSTALL := $(APT) install -y -q

.PHONY: demo test install browser lint typecheck

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e '.[test,dev]'
	touch $@

demo: install
	$(BIN)/hetc demo

test: install browser
	$(BIN)/python -m pytest -n 2 --dist loadgroup

# The visualizer's page tests want headless Chromium; tests never install software,
# so this does, best effort: only where none is on PATH and we are root with apt-get.
# It never fails the target (the page tests then skip, saying why) and says nothing
# when a browser is already there.
browser: install
	@$(BIN)/python -c "import sys; from hetc.tools.headless import find_chromium; sys.exit(find_chromium() is None)" \
	|| { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null \
	     && echo "make: installing Debian's chromium for the page tests" \
	     && { $(APT_INSTALL) chromium || { $(APT) update -q && $(APT_INSTALL) chromium; }; } >/dev/null 2>&1; } \
	|| echo "make: no headless Chromium; the page tests will skip"

lint: install
	$(BIN)/ruff check .

# mypy reads [tool.mypy] in pyproject.toml for what it checks.
typecheck: install
	$(BIN)/mypy
