# Two commands set up everything on a fresh machine:
#   make demo   - train the quickstart on this machine (local backend, tiny model, CPU)
#   make test   - run the whole test suite
# Each builds its own virtualenv in .venv (torch is installed first, pinned, so nothing pulls
# a different build).

PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin

.PHONY: demo test lint bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(VENV)/.train: $(BIN)/python pyproject.toml
	$(BIN)/pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/pip install --quiet -e ".[train]"
	touch $@

$(VENV)/.dev: $(VENV)/.train
	$(BIN)/pip install --quiet -e ".[train,dev]"
	touch $@

demo: $(VENV)/.train
	$(BIN)/rlx launch recipes/quickstart.yaml

test: $(VENV)/.dev
	@if [ "$$(id -u)" = 0 ] && [ -x .ci/setup-system ]; then .ci/setup-system; fi
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python -m pytest -q

lint: $(VENV)/.dev
	$(BIN)/ruff check rlx tests bench
	$(BIN)/ruff format --check rlx tests bench
	$(BIN)/rlx lint recipes

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
