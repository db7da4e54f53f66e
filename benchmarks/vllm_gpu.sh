#!/usr/bin/env bash
# certvllm inside vLLM on a CUDA machine without a registry (the lent H200): the offline bundle's parts are
# installed as they arrive, then the GPU vLLM tests and the serving benchmark run. One stage per run; on a
# machine that keeps /tmp between runs the stages follow each other:
#
#   bash benchmarks/vllm_gpu.sh part .bundle/h200-vllm0.26.0/part-000      # one run per carried part
#   bash benchmarks/vllm_gpu.sh tests [PYTEST ARGS...]                     # pytest -m gpu, through vLLM
#   bash benchmarks/vllm_gpu.sh bench [bench_serving.py ARGS...]           # certified vs auto vs fp8
#
# The run that carries the last part may go on to another stage in the same command:
#   bash benchmarks/vllm_gpu.sh part .bundle/h200-vllm0.26.0/part-003 && bash benchmarks/vllm_gpu.sh tests
# Logs and results go to $OUT (default runs/). The model folder for the 8B-shaped runs is .device/llama8b-dummy
# (python -m certvllm.models dummy .device/llama8b-dummy builds it; carry it with the run).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-runs}"
mkdir -p "$OUT"
export KIT="${KIT:-/tmp/kit}" SITE="${SITE:-/tmp/site}"
stage="${1:-}"
shift || true
case "$stage" in
  part)
    mkdir -p "$KIT"
    for part in "$@"; do cp "$part" "$KIT/"; done
    cp "$(dirname "${1:?a part to copy}")/install.sh" "$KIT/"
    bash "$KIT/install.sh" "$KIT" "$SITE" >/dev/null
    ;;
  tests)
    # shellcheck source=benchmarks/gpu_env.sh
    source benchmarks/gpu_env.sh
    python3 -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__, torch.cuda.get_device_name())"
    # -P: the repository root stays off sys.path (its triton_kernels/ would shadow vLLM's module)
    python3 -P -m pytest -m gpu -p no:cacheprovider -q -x "${@:-tests/vllm_plugin/test_gpu_vllm.py}" 2>&1 \
      | tee "$OUT/pytest_gpu_vllm.log"
    exit "${PIPESTATUS[0]}"
    ;;
  bench)
    # shellcheck source=benchmarks/gpu_env.sh
    source benchmarks/gpu_env.sh
    python3 -P benchmarks/bench_serving.py .device/llama8b-dummy --out "$OUT/serving.json" "$@" 2>&1 \
      | tee "$OUT/bench_serving.log"
    exit "${PIPESTATUS[0]}"
    ;;
  *)
    echo "usage: $0 part PART... | tests [PYTEST ARGS] | bench [BENCH ARGS]" >&2
    exit 2
    ;;
esac
