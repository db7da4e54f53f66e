#!/usr/bin/env bash
# The GPU check of certvllm, one command on a CUDA machine (the lent H200): install, the GPU tests
# (`pytest -m gpu`), then the decode benchmark. Results and logs go to $OUT (default runs/).
#
#   OUT=runs bash benchmarks/gpu_check.sh
#   PYTEST_FLAGS="-q" BENCH_ARGS="--contexts 8192 32768" bash benchmarks/gpu_check.sh
#   SKIP_TESTS=1 BENCH_ARGS="--contexts 131072 --batches 8" bash benchmarks/gpu_check.sh
#
# Kernel tuning (tiles, warps, the split plan, Triton instead of Gluon) is not set through the environment:
# it is a certvllm.triton_kernels.tuning.KernelTuning passed to the launchers (benchmarks/bench_attend.py
# compares the attend pass's configurations).
#
# Wheels in .whl/ (pydantic and its dependencies, which the H200 image lacks) are installed first.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-runs}"
mkdir -p "$OUT"
# shellcheck source=benchmarks/gpu_env.sh
source benchmarks/gpu_env.sh
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
test_rc=0
if [ -z "${SKIP_TESTS:-}" ]; then
  # shellcheck disable=SC2086
  python3 -m pytest -m gpu ${PYTEST_FLAGS:--x -q} tests/triton_kernels 2>&1 | tee "$OUT/pytest_gpu.log"
  test_rc=${PIPESTATUS[0]}
  # the audit's device checks: CPU tests (Triton interpreter) that run the compiled kernels where a GPU is
  # present, so they carry no gpu marker and -m gpu above does not select them
  python3 -m pytest -q tests/attention/test_audit.py -k "device_checks or cuda_path" 2>&1 \
    | tee "$OUT/pytest_gpu_audit.log"
  test_rc=$(( test_rc != 0 || PIPESTATUS[0] != 0 ))
fi
# shellcheck disable=SC2086
python3 benchmarks/bench_decode.py --out "$OUT/decode.json" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log"
bench_rc=${PIPESTATUS[0]}
echo "gpu_check: pytest rc=$test_rc, bench rc=$bench_rc"
exit $(( test_rc != 0 || bench_rc != 0 ))
