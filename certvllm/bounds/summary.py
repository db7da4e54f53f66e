"""The per-head summary of a layer call's INT8 scoring pass that selection, phase 2 and the certificate
read: produced by the torch reference (``certvllm.attention.epilogue.summarize``) and by the CUDA kernel
``triton_kernels.prepare``, field for field the same values.

Shapes: ``R`` rows, ``K`` KV heads, ``G`` query heads per KV head, ``N`` = 16 tokens of the partial
block, ``D`` head dim. Float32 unless stated.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Phase1Summary:
    """Attributes:
    s_tail: ``[R, K, G, N]`` exact scores of the trailing partial block (−inf past its tokens).
    tail_v: ``[R, K, N, D]`` its values (0 past its tokens).
    l_tail: ``[R, K, G]`` logsumexp of ``s_tail``.
    lse: ``[R, K, G]`` logsumexp of every block's INT8 log-mass and ``l_tail``.
    score_abs1: ``[R, K, G]`` largest finite |s| of the INT8 scores and the partial block.
    base_round: ``[R, K, G]`` R without the exp term: the largest score rounding of the row.
    round1: ``[R, K, G]`` ``base_round`` + the exp term at ``score_abs1``.
    v_max: ``[R, K, 1]`` V_max, the largest value norm of the row (partial block included).
    eta_max: ``[R, K, 1]`` the largest η_b.
    """

    s_tail: torch.Tensor
    tail_v: torch.Tensor
    l_tail: torch.Tensor
    lse: torch.Tensor
    score_abs1: torch.Tensor
    base_round: torch.Tensor
    round1: torch.Tensor
    v_max: torch.Tensor
    eta_max: torch.Tensor
