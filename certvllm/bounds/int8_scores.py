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
from certvllm.bounds.terms import rounding_factor, sum_inflation

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


# -- the fixed-point split of the phase-1 MMA kernel (``triton_kernels/phase1_mma.py``, docs §5.3) ----------------
MMA_HEADROOM = LIMB_HEADROOM
"""|x_c| ≤ 126·2^24: e_q from the head's max|q'| (σ ≤ 2^E_b), never from a reduction over the block."""
MMA_E_MIN = -100
MMA_E_MAX = 100
"""The clamp of e_q (a larger e_q only coarsens the grid; e_q above MMA_E_MAX would need max|q'| > 2^106)."""
MMA_GRID_MIN = -102
MMA_GRID_MAX = 105
MMA_EXPONENT_MAX = 120
"""The range of e = E_b + e_q (and of E_b) in which every power-of-two factor of the kernel is a normal float32 and
|J_k|·2^(e−8k) < 2^127 for D ≤ 512; outside it (tiny queries on tiny keys, or keys above 2^120) the block's scores are
0 and its R_b is +inf, which escalates the head (rung 3; finite scores keep the canary quiet). A zero query head is
always in range (all its terms are 0)."""
MMA_LIMB_MAGNITUDE = 1.004
"""Σ_k |a_k|·256^(3−k) ≤ |X| + 1.004·2^24 for the biased byte split (|a_1..3| ≤ 128: 2·128·65793 < 1.004·2^24)."""
KEY_MAGNITUDE_SLACK = 4 * UNIT_ROUNDOFF
"""The float32 key magnitude fl(max(|ℓ̃|, |fl(ℓ̃ + 255σ)|) + σ) is within 4u of the real M_c."""


def mma_score_rounding_factors(d: int) -> tuple[float, float, float]:
    """(c_W, c_P, c_S): R_b = c_W·W + c_P·P + c_S·2^e bounds |s_t − ŝ_t| for every token of the block, where W and P are
    the kernel's float32 sums Σ_c|q'_c·ℓ'_c| (ℓ' = fl(ℓ̃ + 128σ), the block's mid-offset) and Σ_c|p̃_c| (c_W, c_P carry
    the inflation of those sums) and e the block's grid exponent (docs §5.3).

    R_b also bounds the float32 path's scores of the same block (the promotion pass's exact ones, within
    ``rounding_factor(d)``·Σ|q'|·M_c, with M_c ≤ (1 + 2u)|ℓ'_c| + 129σ_c and the float32 M_c within 4u of it): c_W and
    c_P are at least that path's factors on those terms."""
    u = UNIT_ROUNDOFF
    g_dot, g4 = gamma(d), gamma(4)
    query = 2.0 * u * (1.0 + 3.0 * u) * (1.0 + 2.0 * u)  # fl(q·λ) against λq, on Σ|q'||k̂| ≤ (1+2u)(W + 129(1+2u)P)
    limb_w = g_dot + u * (1.0 + 2.0 * u) + g4 * (1.0 + g_dot) + query
    limb_p = 128.0 * u * (1.0 + 2.0 * u) + 128.0 * g4 + 129.0 * (1.0 + 2.0 * u) * query
    float32_path = (g_dot + 6.0 * u) * (1.0 + KEY_MAGNITUDE_SLACK)  # ``rounding_factor`` before its sum inflation
    inflate = sum_inflation(d)
    c_w = max(limb_w, float32_path * (1.0 + 2.0 * u)) * inflate
    c_p = max(limb_p, float32_path * 129.0 * (1.0 + 2.0 * u) ** 2) * inflate
    c_s = (128.0 * 2.0**-25 + 128.0 * 2.0**-174 + 128.0 * g4 * (2.0**-25 + MMA_LIMB_MAGNITUDE)) * d * GAMMA_SLACK
    assert c_w >= rounding_factor(d)
    return c_w, c_p, c_s


def mma_query_exponents(q_scaled: torch.Tensor) -> torch.Tensor:
    """e_q per query head (``q_scaled`` float32 ``[..., D]`` → int64 ``[...]``), as the kernel forms it: ⌈log₂⌉ of the
    float32 product max|q'|·fl((1 + 2^-20)/126) from its bits, MMA_E_MIN for a zero head, clamped to
    [MMA_E_MIN, MMA_E_MAX] (the raw value is returned too, for the range check)."""
    qa = q_scaled.abs()
    qmax = torch.where(torch.isfinite(qa), qa, torch.zeros_like(qa)).amax(dim=-1)
    need = qmax * torch.tensor((1.0 + 2.0**-20) / MMA_HEADROOM, dtype=torch.float32)
    bits = need.view(torch.int32).to(torch.int64)
    raw = ((bits >> 23) & 255) - 127 + ((bits & 8388607) != 0).to(torch.int64)
    raw = torch.where(qmax > 0, raw, torch.full_like(raw, MMA_E_MIN))
    return raw


def mma_scores(q_scaled: torch.Tensor, offsets: torch.Tensor, mantissa: torch.Tensor, exponent: torch.Tensor,
               codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The MMA kernel's arithmetic for one query head and block, emulated in float32/int64 (any leading dims): scores
    float32 ``[..., N]`` and R_b ``[...]`` (outside the kernel's range 0 and +inf, as the kernel writes them).

    Args:
        q_scaled: q' float32 ``[..., D]``; offsets: ℓ̃ float32 ``[..., D]``; mantissa: LUT[j_c] float32 ``[..., D]``;
        exponent: E_b int ``[...]``; codes: uint8 ``[..., N, D]``.
    """
    d = q_scaled.shape[-1]
    raw = mma_query_exponents(q_scaled)
    e_q = raw.clamp(MMA_E_MIN, MMA_E_MAX)
    ex = exponent.to(torch.int64).clamp(-126, 127)
    e = ex + e_q
    zero = q_scaled.abs().amax(dim=-1) == 0
    in_range = zero | ((raw <= MMA_E_MAX) & (e >= MMA_GRID_MIN) & (e <= MMA_GRID_MAX) & (ex <= MMA_EXPONENT_MAX))
    e = e.clamp(MMA_GRID_MIN, MMA_GRID_MAX)

    def pow2(k: torch.Tensor) -> torch.Tensor:
        return torch.pow(2.0, k.double()).float()

    qx = q_scaled * pow2(24 - e_q)[..., None]  # q'' (exact)
    x = qx * mantissa  # p̃·2^(24 − e)
    x_int = torch.round(x.double()).to(torch.int64)
    biased = x_int + 8421504
    limbs = torch.stack([biased >> 24, ((biased >> 16) & 255) - 128, ((biased >> 8) & 255) - 128, (biased & 255) - 128])
    j = ((codes.to(torch.int64) - 128)[None] * limbs[..., None, :]).sum(-1)  # [4, ..., N] exact
    sigma = mantissa * pow2(ex)[..., None]
    mid = offsets + 128.0 * sigma  # ℓ' = fl(ℓ̃ + 128σ)
    w = qx * mid
    unit = pow2(e_q - 24)
    lo = w.sum(-1) * unit  # L″ = Σ q'ℓ'
    w_sum = w.abs().sum(-1) * unit
    p_sum = x.abs().sum(-1) * pow2(e - 24)
    terms = sum(j[k].to(torch.float32) * pow2(e - 8 * k)[..., None] for k in range(4))
    score = terms + lo[..., None]
    c_w, c_p, c_s = mma_score_rounding_factors(d)
    bound = w_sum * c_w + p_sum * c_p + c_s * pow2(e)
    return torch.where(in_range[..., None], score, 0.0), torch.where(in_range, bound, float("inf"))
