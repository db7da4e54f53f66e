#!/usr/bin/env bash
# The GPU check of certvllm, one command on a CUDA machine (the lent H200): install, the GPU tests
# (`pytest -m gpu`), then the decode benchmark. Results and logs go to $OUT (default runs/).
#
#   OUT=runs bash benchmarks/gpu_check.sh
#   PYTEST_FLAGS="-q" BENCH_ARGS="--contexts 8192 32768" bash benchmarks/gpu_check.sh
#   SKIP_TESTS=1 SWEEP="CERTVLLM_P1_BLK=4 CERTVLLM_P1_WARPS=4;CERTVLLM_P1_BLK=8 CERTVLLM_P1_WARPS=8" \
#     BENCH_ARGS="--contexts 131072 --batches 8" bash benchmarks/gpu_check.sh
#
# RETRY_ENV: environment assignments for a second test run (and the benchmark) if the first fails.
# SWEEP: ';'-separated sets of environment assignments (kernel tile sizes, warps, the split plan); the
# benchmark runs once per set, all output in bench.log and the JSON files in sweep.tar.
#
# Wheels in .whl/ (pydantic and its dependencies, which the H200 image lacks) are installed first.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 CERTVLLM_CPU_KERNEL=0
OUT="${OUT:-runs}"
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/certvllm-site .whl/*.whl \
    && export PYTHONPATH="/tmp/certvllm-site${PYTHONPATH:+:$PYTHONPATH}"
fi
if ! python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/pip.log" 2>&1; then
  echo "pip install -e . failed (see pip.log): running from the source tree"
  ln -sfn ../triton_kernels certvllm/triton_kernels
  ln -sfn ../configs certvllm/configs
  ln -sfn ../csrc certvllm/csrc
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
test_rc=0
if [ -z "${SKIP_TESTS:-}" ]; then
  # shellcheck disable=SC2086
  python3 -m pytest -m gpu ${PYTEST_FLAGS:--x -q} tests/test_gpu.py 2>&1 | tee "$OUT/pytest_gpu.log"
  test_rc=${PIPESTATUS[0]}
  if [ "$test_rc" -ne 0 ] && [ -n "${RETRY_ENV:-}" ]; then
    # e.g. RETRY_ENV="CERTVLLM_ATTEND_GLUON=0": run the tests again, and benchmark, in that configuration
    echo "gpu_check: tests failed (rc=$test_rc); again with $RETRY_ENV" | tee -a "$OUT/pytest_gpu.log"
    # shellcheck disable=SC2163
    for kv in $RETRY_ENV; do export "$kv"; done
    # shellcheck disable=SC2086
    python3 -m pytest -m gpu ${PYTEST_FLAGS:--x -q} tests/test_gpu.py 2>&1 | tee -a "$OUT/pytest_gpu.log"
    test_rc=${PIPESTATUS[0]}
  fi
fi
bench_rc=0
if [ -n "${SWEEP:-}" ]; then
  mkdir -p /tmp/sweep
  i=0
  IFS=';' read -ra cfgs <<<"$SWEEP"
  for cfg in "${cfgs[@]}"; do
    i=$((i + 1))
    echo "=== sweep $i: $cfg" | tee -a "$OUT/bench.log"
    # shellcheck disable=SC2086
    env $cfg python3 benchmarks/bench_decode.py --out "/tmp/sweep/decode_$i.json" ${BENCH_ARGS:-} 2>&1 | tee -a "$OUT/bench.log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || bench_rc=1
  done
  tar -C /tmp/sweep -cf "$OUT/sweep.tar" .
else
  # shellcheck disable=SC2086
  python3 benchmarks/bench_decode.py --out "$OUT/decode.json" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log"
  bench_rc=${PIPESTATUS[0]}
fi
echo "gpu_check: pytest rc=$test_rc, bench rc=$bench_rc"
exit $(( test_rc != 0 || bench_rc != 0 ))
