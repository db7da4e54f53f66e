# Sourced by the GPU scripts (gpu_check.sh, vllm_gpu.sh) on a CUDA machine: makes certvllm importable.
#
# * the offline vLLM bundle, when its parts are in $KIT (default /tmp/kit; scripts/gpu_bundle.py builds it):
#   install.sh installs it once into $SITE (default /tmp/site) and prints the export line;
# * wheels in .whl/ (pydantic and its dependencies, for runs without the bundle or before its last part);
# * certvllm itself: this working tree's package directory first on PYTHONPATH (never the repository root: our
#   top-level triton_kernels/ would shadow vLLM's own module); `pip install -e .` only where no installed
#   certvllm provides the vLLM plugin entry point.
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1
KIT="${KIT:-/tmp/kit}"
SITE="${SITE:-/tmp/site}"
bundle_exports=""
if [ -f "$KIT/install.sh" ]; then  # prints nothing while parts are still missing
  bundle_exports="$(bash "$KIT/install.sh" "$KIT" "$SITE")" || return 1 2>/dev/null || exit 1
fi
if [ -n "$bundle_exports" ]; then
  eval "$bundle_exports"
elif compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/certvllm-site \
    .whl/*.whl && export PYTHONPATH="/tmp/certvllm-site${PYTHONPATH:+:$PYTHONPATH}"
fi
# this working tree's certvllm, ahead of any installed copy (the bundle carries a certvllm wheel of its own,
# built when the bundle was, and its entry point, which loads the plugin from whichever certvllm comes first)
ln -sfn ../triton_kernels certvllm/triton_kernels
ln -sfn ../configs certvllm/configs
ln -sfn ../csrc certvllm/csrc
mkdir -p /tmp/certvllm-src && ln -sfn "$PWD/certvllm" /tmp/certvllm-src/certvllm
export PYTHONPATH="/tmp/certvllm-src${PYTHONPATH:+:$PYTHONPATH}"
if ! python3 -P -c "import importlib.metadata as m; assert m.entry_points(group='vllm.general_plugins')" 2>/dev/null; then
  python3 -m pip install -q --no-deps --no-build-isolation -e . >/tmp/certvllm-pip.log 2>&1 \
    || echo "gpu_env: no certvllm entry point and pip install -e . failed (see /tmp/certvllm-pip.log)"
fi
