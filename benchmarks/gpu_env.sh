# Sourced by the GPU scripts (gpu_check.sh, vllm_gpu.sh) on a CUDA machine: makes certvllm importable.
#
# * the offline vLLM bundle, when its parts are in $KIT (default /tmp/kit; scripts/gpu_bundle.py builds it):
#   install.sh installs it once into $SITE (default /tmp/site) and prints the export line;
# * wheels in .whl/ (pydantic and its dependencies, for runs without the bundle);
# * certvllm itself: `pip install -e .`, or, where that fails, the package directory alone on PYTHONPATH
#   (never the repository root: our top-level triton_kernels/ would shadow vLLM's own triton_kernels module).
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1
KIT="${KIT:-/tmp/kit}"
SITE="${SITE:-/tmp/site}"
if [ -f "$KIT/install.sh" ]; then
  bundle_exports="$(bash "$KIT/install.sh" "$KIT" "$SITE")" || return 1 2>/dev/null || exit 1
  [ -n "$bundle_exports" ] && eval "$bundle_exports"
elif compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/certvllm-site \
    .whl/*.whl && export PYTHONPATH="/tmp/certvllm-site${PYTHONPATH:+:$PYTHONPATH}"
fi
if ! python3 -c "import certvllm.triton_kernels" 2>/dev/null; then
  if ! python3 -m pip install -q --no-deps --no-build-isolation -e . >/tmp/certvllm-pip.log 2>&1; then
    echo "gpu_env: pip install -e . failed (see /tmp/certvllm-pip.log): running from the source tree"
    ln -sfn ../triton_kernels certvllm/triton_kernels
    ln -sfn ../configs certvllm/configs
    ln -sfn ../csrc certvllm/csrc
    mkdir -p /tmp/certvllm-src && ln -sfn "$PWD/certvllm" /tmp/certvllm-src/certvllm
    export PYTHONPATH="/tmp/certvllm-src${PYTHONPATH:+:$PYTHONPATH}"
  fi
fi
