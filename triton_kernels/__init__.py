"""Triton kernels of certvllm, shipped as ``certvllm.triton_kernels`` (never as a top-level
``triton_kernels`` module, which would shadow vLLM's own). Each kernel sits beside its launcher:

* ``encode``  — write path: quantize full 16-token blocks into tier-1 pages (``encode_pages``, bit-identical);
* ``gather``  — zero-copy page-in of shadow pages by block id from pinned host memory;
* ``phase1``  — INT8 scoring: scores, block log-mass, Δ_b, rounding, annotations (split-K);
* ``phase2``  — promotion pass (exact scores from the shadow, canary) and the attend pass (FP16 and
  INT8/INT4 blocks in one softmax, float64 accumulation, the bound accumulators).

Every launch-time knob (tiles, warps, the split plan, the staging grid, and whether the Gluon kernels may
run) is a field of ``tuning.KernelTuning``, which the launchers take as ``tuning=``.

On a machine without CUDA the kernels can only run in Triton's interpreter, so importing this package
there sets ``TRITON_INTERPRET=1`` unless it is already set (before any kernel is defined; the
interpreter operates on CPU tensors).
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
