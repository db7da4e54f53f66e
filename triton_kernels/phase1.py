"""Phase 1: INT8 scoring of every full block, split over the sequence (split-K), with the scores on the tensor cores.

One program per (row, KV head, split) walks its blocks and, per block and query head of the GQA group, writes

* the INT8 scores s̃⁸ (an int8 MMA of the codes against a fixed-point split of the scaled query:
  ``phase1_mma``, docs/certification.md §5.2; phase 2 reuses them instead of reading the keys again),
* ℓ⁸_b = logsumexp of the block's scores and their maximum,
* Δ_b = delta_factor · Σ_c |q_c·λ| σ_c (``bounds.block_delta``),
* η_b, ν_b from the page header,

and per block the score rounding R_b (``bounds.int8_scores.mma_score_rounding_factors``: it bounds the rounding of
these scores and of the float32 scores the promotion pass computes for the block), the largest finite |s̃⁸| and
whether the page carries a precondition flag or lacks ``FLAG_VALID`` (the caller reduces them over the blocks).
Blocks past a row's last full block get the reference's neutral values (ℓ = −inf, Δ = η = ν = R = 0).

On CUDA the Gluon kernel (``phase1_mma_gluon``) runs when it supports the shape; the Triton kernel
(``phase1_mma``: the same arithmetic) runs under the interpreter and otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from certvllm.formats.layout import PageLayout

from . import phase1_mma
from .common import GluonGate, interpreting, launch_device_ok
from .tuning import DEFAULT_TUNING, KernelTuning

PHASE1_GLUON_GATE = GluonGate("phase-1")


def use_gluon(head_dim: int, group: int, tuning: KernelTuning = DEFAULT_TUNING) -> bool:
    """Whether :func:`phase1` runs the Gluon kernel (``phase1_mma_gluon``): compiled (not the interpreter),
    ``tuning.dialect`` not ``"triton"``, Gluon importable and compiling (``PHASE1_GLUON_GATE``) and a supported shape
    (one block per warp: ``tuning.phase1_warps`` blocks per iteration)."""
    if interpreting() or tuning.dialect == "triton" or PHASE1_GLUON_GATE.failure is not None:
        return False
    try:
        from . import phase1_mma_gluon
    except ImportError:  # a Triton without Gluon or its mma_v2
        return False
    return phase1_mma_gluon.supported(head_dim, group, tuning.phase1_warps, tuning.phase1_warps)


@dataclass
class Phase1Out:
    """Phase-1 results (shapes as in :func:`phase1`)."""

    scores: torch.Tensor
    l8: torch.Tensor
    m8: torch.Tensor
    delta: torch.Tensor
    eta: torch.Tensor
    nu: torch.Tensor
    rmax: torch.Tensor
    amax: torch.Tensor
    bad: torch.Tensor


def phase1(
    qs: torch.Tensor,
    pages: torch.Tensor,
    tables: torch.Tensor,
    nfull: torch.Tensor,
    lut: torch.Tensor,
    layout: PageLayout,
    num_kv_heads: int,
    sub_blocks: int,
    delta_factor: float,
    splits: int,
    blocks_per_split: int,
    *,
    tuning: KernelTuning = DEFAULT_TUNING,
) -> Phase1Out:
    """Launch phase 1.

    Args:
        qs: ``[R, H_q, D]`` float32 scaled queries.
        pages: ``[E, H_kv, m·page_bytes]`` uint8 tier-1 pages.
        tables: ``[R, B]`` int64 block ids; nfull: ``[R]`` int64 full blocks per row.
        lut: ``[256]`` float32 :func:`~certvllm.formats.layout.key_scale_lut` on the device.
        splits, blocks_per_split: the split-K plan (``splits·blocks_per_split ≥ B``).
        tuning: blocks per loop iteration (``phase1_blk``; the Gluon kernel: one block per warp), warps per
            program (``phase1_warps``) and the kernel dialect.

    Returns:
        :class:`Phase1Out` with scores ``[R, H_kv, B, G, 16]``, l8/m8/delta ``[R, H_kv, G, B]``,
        eta/nu ``[R, H_kv, B]``, rmax/amax ``[R, H_kv, G, B]`` float32 and bad ``[R, H_kv, B]`` int32
        (per block: reduce over the last axis).
    """
    launch_device_ok(pages)
    R, Hq, D = qs.shape
    K = num_kv_heads
    G = Hq // K
    B = tables.shape[1]
    dev = qs.device
    f32 = dict(dtype=torch.float32, device=dev)
    out = Phase1Out(
        scores=torch.empty(R, K, B, G, 16, **f32),
        l8=torch.empty(R, K, G, B, **f32),
        m8=torch.empty(R, K, G, B, **f32),
        delta=torch.empty(R, K, G, B, **f32),
        eta=torch.empty(R, K, B, **f32),
        nu=torch.empty(R, K, B, **f32),
        rmax=torch.empty(R, K, G, B, **f32),
        amax=torch.empty(R, K, G, B, **f32),
        bad=torch.empty(R, K, B, dtype=torch.int32, device=dev),
    )

    def launch_triton():
        phase1_mma.launch(out, qs, pages, tables, nfull, lut, layout, K, sub_blocks, delta_factor, splits,
                          blocks_per_split, tuning)  # fmt: skip

    if use_gluon(D, G, tuning):
        from . import phase1_mma_gluon

        PHASE1_GLUON_GATE.run(
            lambda: phase1_mma_gluon.launch(out, qs, pages, tables, nfull, lut, layout, K, sub_blocks, delta_factor,
                                            splits, blocks_per_split, tuning.phase1_warps),
            launch_triton,
        )  # fmt: skip
    else:
        launch_triton()
    return out
