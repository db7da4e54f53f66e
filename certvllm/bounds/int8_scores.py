"""INT8 tensor-core key scores with a limb-split query: the arithmetic a kernel would run, and its rounding term.

Issue 17 item 2 (derivation: ``docs/certification.md`` §5.2). No kernel uses it yet; this module is the float64-
checkable specification a kernel must match.

For one query head and one 16-token block the INT8 score is, in real arithmetic,

    ŝ_t = Σ_c q'_c·(ℓ̃_c + code_{t,c}·σ_c) = L + Σ_c p_c·code_{t,c},    L = Σ_c q'_c·ℓ̃_c,   p_c = q'_c·σ_c,

with q' = fl(q·λ) (float32, the query every path uses), ℓ̃ the block's fp16 channel offsets, σ the channel scales
(exact float32: LUT value × 2^E) and codes in 0..255. An int8 × int8 → int32 product is exact, so the codes can be
multiplied exactly once the query is made of integers: p̃ = fl(q'·σ) is split into K int8 limbs over one power-of-
two scale S per (query head, block),

    p̃_c = S·Σ_k 256^(1−k)·a_{k,c} + r_c,    a_{k,c} ∈ [−128, 127],    |r_c| ≤ S·256^(1−K)/2,

the kernel forms each limb's integer sum I_{k,t} = Σ_c a_{k,c}·code_{t,c} exactly (an int8 MMA against the codes
shifted to int8, code − 128, plus the per-block constant 128·Σ_c a_{k,c}; |I_k| ≤ 128·255·D < 2^24 for D ≤ 512, so
its float32 conversion is exact too), scales it by the power of two S·256^(1−k) (exact), and adds the K + 1 float32
terms

    score_t = fl(L̃ + Σ_k S·256^(1−k)·I_{k,t})   in any order,    L̃ = fl(Σ_c q'_c·ℓ̃_c)  (a D-term dot product).

Bound (proved in the docs; :func:`limb_score_rounding` evaluates it so that its float32 value is ≥ the real one):

    |score_t − ŝ_t| ≤ γ_{D+K}·Σ_c|q'_c·ℓ̃_c| + 255·(Σ_c|r_c| + u·Σ_c|q'_c|·σ_c + γ_K·A),
    A = S·Σ_k 256^(1−k)·Σ_c|a_{k,c}|

It replaces the dot product's γ_D and the dequantization's 2u of ``rounding_factor``; the query's own rounding
(fl(q·λ) against λq) stays as it is. Shapes: ``[..., D]`` per query head and block (any leading dims), codes
``[..., N, D]`` uint8.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from certvllm.bounds.rounding import GAMMA_SLACK, UNIT_ROUNDOFF, gamma

CODE_MAX = 255
"""Largest key code (the product format's; the stress formats use fewer, which the bound covers)."""
LIMB_HEADROOM = 126
"""|p̃_c / S| ≤ 126, so that the leading limb stays ≤ 127 after a carry from the ones below it."""
DEFAULT_LIMBS = 3
"""Three limbs: the split's residual (≤ S·2^-17) is then below the float32 roundings (the measured sizes are in the
docs); two leave a residual of up to S/512, 2–23 % of Δ_b on the tests' blocks."""
EXACT_FLOAT32_INT = 2**24


@dataclass(frozen=True)
class QueryLimbs:
    """The limb split of p̃ = fl(q'·σ) for each leading index.

    Attributes:
        scale: S, a power of two, float32 ``[...]`` (1 where p̃ is all zero).
        limbs: a, int8 ``[K, ..., D]``, most significant first (limb k weighs S·256^(−k), k from 0).
        residual: r = p̃ − S·Σ_k 256^(−k)·a_k, float64 ``[..., D]`` (exact: every quantity is a float32 or a small
            integer times a power of two), |r| ≤ S·256^(1−K)/2.
    """

    scale: torch.Tensor
    limbs: torch.Tensor
    residual: torch.Tensor

    def weights(self) -> torch.Tensor:
        """S·256^(−k) per limb, float64 ``[K, ...]``."""
        k = torch.arange(self.limbs.shape[0], dtype=torch.float64, device=self.scale.device)
        return torch.pow(256.0, -k).reshape(-1, *([1] * self.scale.dim())) * self.scale.double()


def split_query_limbs(p: torch.Tensor, count: int = DEFAULT_LIMBS) -> QueryLimbs:
    """Split ``p`` (float32 ``[..., D]``, the per-block scaled query fl(q'·σ)) into ``count`` int8 limbs.

    S = 2^⌈log2(max|p|/126)⌉; each limb is the nearest integer (ties to even) to what the limbs above leave, times
    256; a limb of +128 is carried into the one above it (−128 left behind), from the last limb up. In float64
    every step is exact (p/S is a float32 scaled by a power of two; the limbs are small integers)."""
    if p.dtype != torch.float32:
        raise TypeError(f"p must be float32 (the kernel's fl(q'·σ)), got {p.dtype}")
    if not 1 <= count <= 4:
        raise ValueError(f"count={count}: give 1 to 4 limbs (3 is the default)")
    p64 = p.double()
    peak = p64.abs().amax(dim=-1)
    exponent = torch.ceil(torch.log2(torch.where(peak > 0, peak / LIMB_HEADROOM, torch.ones_like(peak))))
    scale = torch.pow(2.0, exponent)
    rest = p64 / scale[..., None]
    limbs = []
    for _ in range(count):
        limb = torch.round(rest)  # ties to even, as the kernel's cvt.rni
        limbs.append(limb)
        rest = (rest - limb) * 256.0
    for k in range(count - 1, 0, -1):  # carries: +128 does not fit int8
        carry = limbs[k] == 128.0
        limbs[k] = limbs[k] - 256.0 * carry
        limbs[k - 1] = limbs[k - 1] + carry
    residual = rest * scale[..., None] / 256.0**count
    return QueryLimbs(scale.float(), torch.stack(limbs).to(torch.int8), residual)


def limb_integer_scores(codes: torch.Tensor, split: QueryLimbs) -> torch.Tensor:
    """I_{k,t} = Σ_c a_{k,c}·code_{t,c} for every limb, as the kernel forms them: int8 × int8 products of the limb
    with the codes shifted to int8 (code − 128), an int32 sum, plus the per-block constant 128·Σ_c a_{k,c}.
    ``codes`` uint8 ``[..., N, D]``; returns int64 ``[K, ..., N]`` (checked below 2^24: exact in float32)."""
    shifted = codes.to(torch.int64) - 128  # int8 range
    a = split.limbs.to(torch.int64)
    sums = (shifted * a[..., None, :]).sum(-1) + 128 * a.sum(-1, keepdim=True)
    if bool((sums.abs() >= EXACT_FLOAT32_INT).any()):
        raise OverflowError("a limb's integer score reaches 2^24: its float32 conversion would round (D > 512?)")
    return sums


def limb_scores(q_scaled: torch.Tensor, offsets: torch.Tensor, sigma: torch.Tensor, codes: torch.Tensor,
                count: int = DEFAULT_LIMBS) -> tuple[torch.Tensor, QueryLimbs]:  # fmt: skip
    """The kernel's scores, emulated: float32 ``[..., N]`` and the split they used.

    Args:
        q_scaled: q' = fl(q·λ), float32 ``[..., D]``.
        offsets: ℓ̃, the block's channel offsets, float32 ``[..., D]`` (fp16 values).
        sigma: σ, the block's channel scales, float32 ``[..., D]``.
        codes: the block's key codes, uint8 ``[..., N, D]``.
        count: K, the limbs of the query.
    """
    split = split_query_limbs(q_scaled * sigma, count)  # p̃: one float32 rounding per channel
    score = (q_scaled * offsets).sum(-1, keepdim=True)  # L̃: a D-term float32 dot product
    weights = split.weights().float()  # powers of two: exact
    for integer, weight in zip(limb_integer_scores(codes, split).to(torch.float32), weights, strict=True):
        score = score + integer * weight[..., None]  # exact product, one rounding per addition
    return score, split


def limb_score_rounding(q_scaled: torch.Tensor, offsets: torch.Tensor, sigma: torch.Tensor, split: QueryLimbs,
                        code_max: int = CODE_MAX) -> torch.Tensor:  # fmt: skip
    """The bound on |score_t − ŝ_t| for every token of the block, float32 ``[...]``, ≥ the real-number bound:
    γ_{D+K}·Σ|q'ℓ̃| + code_max·(Σ|r| + u·Σ|q'|σ + γ_K·A), each D-term sum inflated by (1 + γ_{D+K+2})·GAMMA_SLACK."""
    d, count = q_scaled.shape[-1], split.limbs.shape[0]
    inflate = (1.0 + gamma(d + count + 2)) * GAMMA_SLACK
    offset_part = gamma(d + count) * (q_scaled * offsets).abs().sum(-1)
    limb_abs = (split.limbs.double().abs().sum(-1) * split.weights()).sum(0)  # A, exact in float64
    exact_parts = split.residual.abs().sum(-1) + gamma(count) * limb_abs  # float64: rounded below by ≤ 2^-50
    scale_part = UNIT_ROUNDOFF * (q_scaled.abs() * sigma).sum(-1)
    return (offset_part + code_max * (exact_parts.float() + scale_part)) * inflate
